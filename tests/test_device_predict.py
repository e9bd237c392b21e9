"""The device uses what it learned: `device predict`, `device export-model` (fp32 and int8) and class names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import run_without_torch
from device_helpers import predict_all, read_inputs
from test_device_runtime import BN_BUNDLE, ENGINES, NUM_CLASSES, class_images
from typer.testing import CliRunner

from edgepfl.atomic import sha256_file
from edgepfl.data import make_local_data
from edgepfl.device_runtime.algorithms import Phase, train_phase
from edgepfl.device_runtime.cli import device_app
from edgepfl.device_runtime.engine import open_engine, softmax
from edgepfl.device_runtime.model_export import LOGITS, PROBABILITIES, export_device_model
from edgepfl.device_runtime.predict import open_device_model
from edgepfl.device_runtime.state import StateFolder
from edgepfl.errors import BundleError, DataError
from edgepfl.manifest import load_manifest

onnx = pytest.importorskip("onnx")
SIDE = BN_BUNDLE["input_size"]
NAMES = ("circle", "cross", "square", "wave")


@pytest.fixture(scope="module")
def bn_bundle(bundle_factory) -> Path:
    return bundle_factory(**BN_BUNDLE)


@pytest.fixture(scope="module")
def named_bundle(bn_bundle, tmp_path_factory) -> Path:
    """The BatchNorm cnn bundle with class names in its manifest (as `edgepfl export --class-names` writes them)."""
    folder = tmp_path_factory.mktemp("named") / "bundle"
    shutil.copytree(bn_bundle, folder)
    document = json.loads((folder / "manifest.json").read_text())
    document["class_names"] = list(NAMES)
    (folder / "manifest.json").write_text(json.dumps(document))
    return folder


def noisy_data(manifest, count: int, seed: int, val_fraction: float = 0.5):
    """Class images noisy enough that a few epochs give an accuracy below 100 %, so a point of it means something."""
    labels = np.random.default_rng(seed).integers(0, NUM_CLASSES, count)
    return make_local_data(class_images(labels, seed, noise=110.0, side=SIDE), labels, manifest, val_fraction, seed)


@pytest.fixture(scope="module")
def trained_state(bn_bundle, tmp_path_factory) -> Path:
    """A state folder holding the cnn after three epochs of local training (portable engine)."""
    folder = tmp_path_factory.mktemp("state")
    engine = open_engine(bn_bundle, "portable")
    data = noisy_data(engine.manifest, 640, seed=0)
    train_phase(engine, data, Phase("local", "full", 3, 0.05), 32, seed=0)
    state = StateFolder(folder, engine.manifest, engine.name)
    state.commit(engine.get_tensors(), {"local_training": True})
    state.close()
    return folder


def invoke(*args: str | Path):
    return CliRunner().invoke(device_app, [str(arg) for arg in args])


# predict


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ENGINES)
def test_predict_is_the_engines_evaluation(bn_bundle, trained_state, engine_name):
    model = open_device_model(bn_bundle, trained_state, engine_name)
    assert model.trained and "trained locally" in model.description
    data = noisy_data(model.engine.manifest, 45, seed=5, val_fraction=0.0)  # 45: not a multiple of the batch
    x, y = next(data.train_batches_in_order(45))
    probabilities = predict_all(model.engine, x)
    assert probabilities.shape == (45, NUM_CLASSES) and np.allclose(probabilities.sum(axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(probabilities, softmax(model.engine.logits(x)), rtol=0, atol=1e-7)
    evaluation = model.engine.eval_batch(x, y)  # the eval graph's own loss and correct count
    assert int((probabilities.argmax(axis=1) == y).sum()) == evaluation.correct
    assert -np.log(probabilities[np.arange(45), y]).mean() == pytest.approx(evaluation.loss, rel=1e-5)


@pytest.mark.slow
def test_both_engines_predict_alike(bn_bundle, trained_state):
    x = load_manifest(bn_bundle).kind.normalize(class_images(np.arange(7) % NUM_CLASSES, 3, side=SIDE))
    ort, portable = (predict_all(open_device_model(bn_bundle, trained_state, name).engine, x) for name in ENGINES)
    np.testing.assert_allclose(ort, portable, rtol=0, atol=1e-5)


def test_a_photo_or_two_go_through_the_one_sample_predict_graph_with_the_eval_graphs_numbers(bn_bundle, trained_state):
    engine = open_device_model(bn_bundle, trained_state, "portable").engine
    assert engine.entry["predict"]["batch_size"] == 1
    few = engine.batch_size // 8  # at most this many go one by one (the manifest says so to both engines)
    assert engine.entry["predict"]["up_to"] == few
    assert (engine.predict_graph(1), engine.predict_graph(few), engine.predict_graph(few + 1)) == (
        "predict",
        "predict",
        "eval",
    )
    x = engine.manifest.kind.normalize(class_images(np.arange(few + 1) % NUM_CLASSES, 3, side=SIDE))
    batched = engine.logits(x)  # few + 1 inputs: one padded batch of the eval graph
    one_by_one = np.concatenate([engine.logits(x[i : i + 1]) for i in range(few + 1)])
    np.testing.assert_allclose(one_by_one, batched, rtol=0, atol=1e-5)


def test_predict_cli_reads_images_folders_and_npz_as_training_data(named_bundle, trained_state, tmp_path):
    from PIL import Image

    labels = np.array([0, 1, 2, 3, 1])
    images = class_images(labels, 9, side=SIDE)
    (tmp_path / "photos" / ".thumbs").mkdir(parents=True)
    for index, pixels in enumerate(images[:3]):
        Image.fromarray(pixels[:, :, 0]).resize((40, 40)).save(tmp_path / "photos" / f"{index}.png")
    Image.fromarray(images[0, :, :, 0]).save(tmp_path / "photos" / ".thumbs" / "hidden.png")  # skipped
    (tmp_path / "photos" / "notes.txt").write_text("not an image: skipped in a folder")
    np.savez(tmp_path / "more.npz", x=images[3:])  # no y needed
    Image.fromarray(np.repeat(images[4], 3, axis=2)).save(tmp_path / "colour.png")  # converted to grey
    result = invoke(
        "predict",
        tmp_path / "photos",
        tmp_path / "more.npz",
        tmp_path / "colour.png",
        "--bundle",
        named_bundle,
        "--state",
        trained_state,
        "--top",
        "2",
        "--json",
        "--engine",
        "portable",
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["model"]["trained"] and document["model"]["last_completed_round"] is None
    shown = [p["input"] for p in document["predictions"]]
    assert shown == [str(tmp_path / "photos" / f"{i}.png") for i in range(3)] + [
        f"{tmp_path / 'more.npz'}[0]",
        f"{tmp_path / 'more.npz'}[1]",
        str(tmp_path / "colour.png"),
    ]
    model = open_device_model(named_bundle, trained_state, "portable")
    _, x = read_inputs([tmp_path / "photos", tmp_path / "more.npz", tmp_path / "colour.png"], model.engine)
    want = predict_all(model.engine, x)
    for row, prediction in zip(want, document["predictions"]):
        top = prediction["top"]
        assert [item["class"] for item in top] == list(np.argsort(-row, kind="stable")[:2])
        assert [item["name"] for item in top] == [NAMES[item["class"]] for item in top]
        assert [item["probability"] for item in top] == pytest.approx(row[[t["class"] for t in top]], abs=1e-6)
    table = invoke("predict", tmp_path / "colour.png", "--bundle", named_bundle, "--state", trained_state)
    assert table.exit_code == 0 and "device predict: trained locally" in table.output
    assert any(name in table.output for name in NAMES) and table.output.count("%") == 3  # --top 3 by default


def test_predict_without_a_trained_model_says_so_and_creates_nothing(bn_bundle, tmp_path):
    np.savez(tmp_path / "x.npz", x=class_images(np.array([1]), side=SIDE))
    result = invoke("predict", tmp_path / "x.npz", "--bundle", bn_bundle, "--state", tmp_path / "state", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert not document["model"]["trained"]
    assert "untrained: the bundle's initial model" in document["model"]["description"]
    top = document["predictions"][0]["top"]
    assert [item["name"] for item in top] == [str(item["class"]) for item in top]  # no class names: the indices
    assert not (tmp_path / "state").exists()


def test_predict_reads_a_state_that_a_running_device_holds(bn_bundle, trained_state):
    holder = StateFolder(trained_state, load_manifest(bn_bundle), "portable")  # as `device run` holds it
    try:
        assert open_device_model(bn_bundle, trained_state, "portable").trained
    finally:
        holder.close()


def _not_an_image(folder: Path) -> Path:
    (folder / "notes.txt").write_text("hello")
    return folder / "notes.txt"


def _broken_png(folder: Path) -> Path:
    (folder / "broken.png").write_bytes(b"not a png")
    return folder / "broken.png"


def _npz_without_x(folder: Path) -> Path:
    np.savez(folder / "labels.npz", y=np.arange(3))
    return folder / "labels.npz"


def _npz_wrong_channels(folder: Path) -> Path:
    np.savez(folder / "rgb.npz", x=class_images(np.arange(2), channels=3, side=SIDE))
    return folder / "rgb.npz"


def _empty_folder(folder: Path) -> Path:
    (folder / "empty").mkdir()
    (folder / "empty" / "a.txt").write_text("no images here")
    return folder / "empty"


@pytest.mark.parametrize(
    "make_input, message",
    [
        (_not_an_image, "notes.txt is neither an image (.png, .jpg"),
        (_broken_png, "broken.png is not a readable image"),
        (_npz_without_x, "labels.npz has no array 'x' (it holds y)"),
        (_npz_wrong_channels, "rgb.npz x has 3 channel(s) per image, the model takes 1"),
        (_empty_folder, "empty holds no images"),
        (lambda folder: folder / "missing.png", "missing.png does not exist"),
    ],
)
def test_a_bad_input_is_one_line(bn_bundle, trained_state, tmp_path, make_input, message):
    path = make_input(tmp_path)
    result = invoke("predict", path, "--bundle", bn_bundle, "--state", trained_state)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0] and "Traceback" not in lines[0]


def test_predict_works_without_torch(bn_bundle, trained_state, tmp_path):
    np.savez(tmp_path / "x.npz", x=class_images(np.array([0, 3]), side=SIDE))
    code = f"""
import sys
from typer.testing import CliRunner
from edgepfl.device_runtime.cli import device_app
result = CliRunner().invoke(device_app, ['predict', {str(tmp_path / "x.npz")!r}, '--bundle', {str(bn_bundle)!r},
                                         '--state', {str(trained_state)!r}, '--json', '--engine', 'portable'])
assert result.exit_code == 0, result.output
assert 'torch' not in {{name.split('.')[0] for name, module in sys.modules.items() if module is not None}}
print(result.output)
"""
    done = run_without_torch(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads(done.stdout.strip().splitlines()[-1])["predictions"]) == 2


# export-model


def _plain_session(path: Path):
    import onnxruntime

    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("engine_name", ENGINES)
def test_exported_fp32_model_gives_the_engines_probabilities(named_bundle, trained_state, tmp_path, engine_name):
    out = tmp_path / "model.onnx"
    result = invoke(
        "export-model",
        "--bundle",
        named_bundle,
        "--state",
        trained_state,
        "--out",
        out,
        "--engine",
        engine_name,
        "--json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["source_graph"] == "model.onnx" and report["quantize"] == "none"
    assert report["bytes"] == out.stat().st_size
    model = open_device_model(named_bundle, trained_state, engine_name)
    x = model.engine.manifest.kind.normalize(class_images(np.arange(37) % NUM_CLASSES, 4, noise=110.0, side=SIDE))
    session = _plain_session(out)
    assert [i.name for i in session.get_inputs()] == ["input"]
    assert [o.name for o in session.get_outputs()] == [LOGITS, PROBABILITIES]
    logits, probabilities = session.run(None, {"input": x})
    np.testing.assert_allclose(probabilities, model.engine.predict(x), rtol=0, atol=1e-5)
    np.testing.assert_allclose(logits, model.engine.logits(x), rtol=1e-5, atol=1e-5)
    meta = session.get_modelmeta().custom_metadata_map
    manifest = model.engine.manifest
    assert json.loads(meta["class_names"]) == list(NAMES) and meta["base_layout_hash"] == manifest.base_layout_hash
    assert json.loads(meta["input_shape"]) == ["batch", 1, SIDE, SIDE] and meta["input_layout"] == "NCHW"
    assert json.loads(meta["mean"]) == list(manifest.input.mean) and json.loads(meta["std"]) == list(manifest.input.std)
    assert "resize" in meta and meta["trained"] == "true" and meta["last_completed_round"] == ""
    assert meta["edgepfl_version"] and meta["quantization"] == "none"


def test_an_older_bundle_exports_through_its_ort_training_eval_graph(bn_bundle, trained_state, tmp_path):
    """model.onnx of bundles before this version has BatchNorm folded into the convolutions: no tensor names."""
    import torch

    from edgepfl.export.inference import _export
    from edgepfl.export.models import ModelSpec, build_model

    old = tmp_path / "old"
    shutil.copytree(bn_bundle, old)
    spec = {k: v for k, v in BN_BUNDLE.items() if k not in ("kp", "engines", "seed")}
    _export(build_model(ModelSpec(**spec)).eval(), (1, SIDE, SIDE), old / "model.onnx", torch.onnx.TrainingMode.EVAL)
    document = json.loads((old / "manifest.json").read_text())
    document["files"]["model.onnx"] = sha256_file(old / "model.onnx")
    (old / "manifest.json").write_text(json.dumps(document))
    folded = {init.name for init in onnx.load(str(old / "model.onnx")).graph.initializer}
    assert "conv1.0.weight" not in folded  # folded into the convolution
    model = open_device_model(old, trained_state, "portable")
    exported = export_device_model(model, tmp_path / "m.onnx")
    assert exported.source_graph == "ort-training/full/eval_model.onnx"
    x = model.engine.manifest.kind.normalize(class_images(np.arange(9) % NUM_CLASSES, 2, side=SIDE))
    probabilities = _plain_session(tmp_path / "m.onnx").run([PROBABILITIES], {"input": x})[0]
    np.testing.assert_allclose(probabilities, model.engine.predict(x), rtol=0, atol=1e-5)
    # the same older bundle without its ort-training artifacts has no graph that names its tensors
    document["engines"].pop("ort-training")
    (old / "manifest.json").write_text(json.dumps(document))
    with pytest.raises(BundleError, match="no inference graph that names its tensors") as refused:
        export_device_model(open_device_model(old, trained_state, "portable"), tmp_path / "n.onnx")
    assert "re-export the bundle" in refused.value.fix and not (tmp_path / "n.onnx").exists()


def test_int8_keeps_the_accuracy_at_under_a_third_of_the_size(bn_bundle, trained_state, tmp_path):
    model = open_device_model(bn_bundle, trained_state, "portable")
    data = noisy_data(model.engine.manifest, 1200, seed=7, val_fraction=0.5)  # 600 held out: 6 per point
    fp32 = export_device_model(model, tmp_path / "fp32.onnx", data=data)
    int8 = export_device_model(model, tmp_path / "int8.onnx", "int8", data, calibration_samples=256)
    assert 0.5 < fp32.val_accuracy < 0.99, fp32  # accuracy that a point of it means something
    assert int8.val_accuracy_fp32 == fp32.val_accuracy and abs(int8.val_accuracy - fp32.val_accuracy) <= 0.01, int8
    assert int8.bytes <= 0.3 * fp32.bytes and int8.calibration_samples == 256  # MobileNet x0.25: bench/device.py
    session = _plain_session(tmp_path / "int8.onnx")
    quantized = onnx.load(str(tmp_path / "int8.onnx"))
    assert {"QuantizeLinear", "DequantizeLinear", "Softmax"} <= {node.op_type for node in quantized.graph.node}
    assert {item.domain for item in quantized.opset_import} == {""}  # standard ONNX only: any runtime
    assert max(len(init.name) for init in quantized.graph.initializer) <= 4  # compacted: short names
    assert session.get_modelmeta().custom_metadata_map["quantization"].startswith("int8: static QDQ")


def test_int8_needs_the_devices_data(bn_bundle, trained_state, tmp_path):
    result = invoke(
        "export-model",
        "--bundle",
        bn_bundle,
        "--state",
        trained_state,
        "--out",
        tmp_path / "m.onnx",
        "--quantize",
        "int8",
    )
    assert result.exit_code == 2 and "int8 quantization is calibrated on the device's training data" in result.output
    assert not (tmp_path / "m.onnx").exists()


def test_predict_refuses_a_state_of_another_bundle(bn_bundle, trained_state, tmp_path):
    shutil.copytree(trained_state, tmp_path / "state", ignore=shutil.ignore_patterns(".lock"))
    document = json.loads((tmp_path / "state" / "state.json").read_text())
    (tmp_path / "state" / "state.json").write_text(json.dumps({**document, "base_layout_hash": "0" * 64}))
    result = invoke("predict", tmp_path / "state", "--bundle", bn_bundle, "--state", tmp_path / "state")
    assert result.exit_code == 2 and "belongs to a bundle with base_layout_hash 000000000000" in result.output


def test_read_inputs_refuses_nothing_to_predict(bn_bundle):
    with pytest.raises(DataError, match="no inputs to predict"):
        read_inputs([], open_engine(bn_bundle, "portable"))


def test_int8_never_keeps_an_overflowed_bias(bn_bundle, trained_state, tmp_path):
    """onnxruntime 1.19's quantizer casts bias / scale to int32 unchecked: an overflow is refused, not written."""
    import onnxruntime

    model = open_device_model(bn_bundle, trained_state, "portable")
    bias = model.engine.get_tensors(["fc2.bias"])["fc2.bias"]
    model.engine.set_tensors({"fc2.bias": bias + np.float32(3e6)})  # far beyond input scale x weight scale x 2^31
    data = noisy_data(model.engine.manifest, 200, seed=3)
    try:
        exported = export_device_model(model, tmp_path / "int8.onnx", "int8", data, calibration_samples=64)
    except DataError as refused:
        assert "would overflow a layer's int32 bias" in refused.problem and onnxruntime.__version__ < "1.20"
        assert not (tmp_path / "int8.onnx").exists()
    else:  # later onnxruntime releases adjust the weight scale so that the bias fits
        assert exported.val_accuracy == pytest.approx(exported.val_accuracy_fp32, abs=0.02)


def test_class_names_in_the_manifest_are_optional_and_checked(named_bundle, tmp_path):
    shutil.copytree(named_bundle, tmp_path / "b")
    path = tmp_path / "b" / "manifest.json"
    document = json.loads(path.read_text())
    assert load_manifest(tmp_path / "b").class_labels == NAMES
    path.write_text(json.dumps({k: v for k, v in document.items() if k != "class_names"}))  # an older export
    assert load_manifest(tmp_path / "b").class_labels == ("0", "1", "2", "3")
    for names, problem in (
        (["a", "b"], "2 class names for a model of 4 classes"),
        (["a", "b", "c", "A"], "'a' and 'A' are the same name"),
        (["a", "b", "c", " d"], "' d' has spaces around it"),
        (["a", "b", "c", ".d"], "'.d' cannot name an image folder"),
    ):
        path.write_text(json.dumps({**document, "class_names": names}))
        with pytest.raises(BundleError, match="manifest.json: ") as refused:
            load_manifest(tmp_path / "b")
        assert problem in refused.value.problem
