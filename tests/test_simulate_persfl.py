"""edgepfl simulate --algorithm persfl: stage 1 keeps each client's lowest-loss global model, stage 2 distils."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgepfl.device_runtime.engine import DistillStep

pytest.importorskip("torch")

from test_simulate import tiny_config  # noqa: E402

from edgepfl.device_runtime.persfl import TeacherStore  # noqa: E402
from edgepfl.errors import DataError, UsageError  # noqa: E402
from edgepfl.manifest import load_manifest  # noqa: E402
from edgepfl.simulate.bundle import open_sim_engine  # noqa: E402
from edgepfl.simulate.config import config_from_json  # noqa: E402
from edgepfl.simulate.loop import BUNDLE_DIR, TEACHERS_DIR, run_simulation  # noqa: E402
from edgepfl.simulate.results import load_results  # noqa: E402


@pytest.fixture(scope="module")
def tiny_npz(stand_in_digits):
    """600 + 200 learnable stand-in digits (conftest)."""
    return stand_in_digits


def persfl_config(tiny_npz, out, **changes):
    grid = {"rounds": 3, "distill_lambdas": (0.3, 0.7), "distill_temperatures": (2.0,), "distill_epochs": 2}
    return tiny_config(tiny_npz, out, algorithm="persfl", **{**grid, **changes})


def test_persfl_teacher_is_the_lowest_validation_loss_and_students_are_distilled(tiny_npz, tmp_path):
    out = tmp_path / "persfl"
    results = run_simulation(persfl_config(tiny_npz, out, rounds=4, lr=0.15))  # lr 0.15: some losses rise again
    document = json.loads((out / "results.json").read_text())
    manifest = load_manifest(out / BUNDLE_DIR)
    assert manifest.kp == 0 and all(entry.get("distill") for entry in manifest.engines.values())
    section = document["persfl"]
    assert len(section["clients"]) == 4
    for entry in section["clients"]:
        losses = {r["round"]: r["start_val_loss"][entry["client"]] for r in document["rounds"]}
        assert len(losses) == 4
        assert entry["teacher_round"] == min(losses, key=lambda round_id: (losses[round_id], round_id))
        assert entry["teacher_val_loss"] == pytest.approx(losses[entry["teacher_round"]])
        assert entry["lambda"] in (0.3, 0.7) and entry["T"] == 2.0 and len(entry["grid"]) == 2
        assert entry["teacher"]["val_loss"] == pytest.approx(losses[entry["teacher_round"]], rel=1e-5)
        for role in ("teacher", "student"):
            assert 0.0 <= entry[role]["test_accuracy"] <= 1.0
        record = TeacherStore(out / TEACHERS_DIR / entry["client"], manifest).record
        assert record.round_id == entry["teacher_round"]
    assert any(entry["teacher_round"] < 4 for entry in section["clients"])  # not merely the last global model
    for role in ("teacher", "student"):
        per_client = [entry[role]["val_accuracy"] for entry in section["clients"]]
        assert section[role]["val_accuracy"]["mean"] == pytest.approx(np.mean(per_client))
    assert section["student"]["val_accuracy"]["mean"] >= section["teacher"]["val_accuracy"]["mean"]
    assert load_results(out).persfl == results.persfl == section


@pytest.mark.slow
def test_persfl_resume_keeps_the_teachers_and_reruns_stage_two(tiny_npz, tmp_path):
    out = tmp_path / "resume"
    run_simulation(persfl_config(tiny_npz, out, rounds=2))
    resumed = run_simulation(persfl_config(tiny_npz, out, rounds=3))
    straight = run_simulation(persfl_config(tiny_npz, tmp_path / "straight", rounds=3))
    assert [r.round for r in resumed.rounds] == [1, 2, 3]
    assert resumed.persfl["clients"] == straight.persfl["clients"]


@pytest.mark.slow
def test_persfl_grid_options_are_checked_and_read_from_a_config_file(tiny_npz, tmp_path):
    config = config_from_json({"algorithm": "persfl", "distill_lambdas": "0.2,0.4", "distill_temperatures": [1, 3]})
    assert config.distill.lambdas == (0.2, 0.4) and config.distill.temperatures == (1.0, 3.0)
    assert config_from_json(config.to_json()) == config
    with pytest.raises(UsageError, match="lambdas"):
        persfl_config(tiny_npz, tmp_path / "bad", distill_lambdas=(1.5,))
    sparse = run_simulation(persfl_config(tiny_npz, tmp_path / "sparse", rounds=1, fraction=0.5))
    skipped = [entry for entry in sparse.persfl["clients"] if entry["teacher_round"] is None]
    assert len(skipped) == 2 and sparse.persfl["student"]["test_accuracy"]["per_client"].count(None) == 0
    assert len(sparse.persfl["student"]["test_accuracy"]["per_client"]) == 2
    with pytest.raises(DataError, match="no validation samples"):
        run_simulation(persfl_config(tiny_npz, tmp_path / "no-val", split=(0.8, 0.0, 0.2)))


def test_torch_distill_step_matches_the_bundle_engine(tiny_npz, tmp_path):
    out = tmp_path / "bundle-run"
    run_simulation(persfl_config(tiny_npz, out, rounds=1, distill_epochs=1, distill_lambdas=(0.5,)))
    manifest = load_manifest(out / BUNDLE_DIR)
    bundle_engine = open_sim_engine(
        "ort-training" if "ort-training" in manifest.engines else "portable", out / BUNDLE_DIR, manifest
    )
    torch_engine = open_sim_engine("torch", out / BUNDLE_DIR, manifest)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, *manifest.input.shape)).astype(np.float32)
    y = rng.integers(0, manifest.num_classes, 32)
    teacher = rng.normal(size=(32, manifest.num_classes)).astype(np.float32)
    for variant, temperature in (("kd", 3.0), ("gd", 2.0)):
        losses = [
            engine.distill_step(DistillStep(x, y, teacher, lr=0.1, temperature=temperature, lam=0.6, variant=variant))
            for engine in (bundle_engine, torch_engine)
        ]
        assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    np.testing.assert_allclose(torch_engine.logits(x), bundle_engine.logits(x), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_simulate_cli_takes_the_distillation_grid_and_pfedla_knobs(tiny_npz, tmp_path):
    from typer.testing import CliRunner

    from edgepfl.cli import app

    common = ["simulate", "--model", "mlp", "--kp", "1", "--dataset", str(tiny_npz), "--data-root", str(tmp_path)]
    common += ["--partition", "classes:2", "--clients", "4", "--rounds", "1", "--epochs", "1", "--batch-size", "32"]
    runner = CliRunner()
    flags = ["--distill-lambdas", "0.2,0.8", "--distill-temperatures", "3", "--distill-epochs", "1"]
    flags += ["--distill-lr", "0.1", "--distill-variant", "gd"]
    result = runner.invoke(app, [*common, "--algorithm", "persfl", "--out", str(tmp_path / "p"), *flags])
    assert result.exit_code == 0, result.output
    distill = load_results(tmp_path / "p").persfl["distill"]
    assert distill["lambdas"] == [0.2, 0.8] and distill["temperatures"] == [3.0]
    assert (distill["epochs"], distill["lr"], distill["variant"]) == (1, 0.1, "gd")
    flags = ["--algorithm", "heurpfedla", "--hn-lr", "0.02", "--retain-top-k", "2", "--out", str(tmp_path / "h")]
    result = runner.invoke(app, [*common, *flags])
    assert result.exit_code == 0, result.output
    config = load_results(tmp_path / "h").config
    assert (config.strategy_knobs.hn_lr, config.strategy_knobs.retain_top_k) == (0.02, 2)
    bad = runner.invoke(app, [*common, "--algorithm", "persfl", "--distill-lambdas", "x", "--out", str(tmp_path / "b")])
    assert bad.exit_code != 0 and "Traceback" not in bad.output and "lambda" in bad.output.lower()
