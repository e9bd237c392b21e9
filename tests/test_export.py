"""`edgepfl export`: ORT-training artifacts against PyTorch, frozen sets, the CLI's one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import run_without_torch

torch = pytest.importorskip("torch")
from edgepfl.device_runtime.engine import open_engine  # noqa: E402
from edgepfl.export.models import ModelSpec, build_model  # noqa: E402
from edgepfl.manifest import load_manifest  # noqa: E402

BN_CNN = dict(name="cnn", norm="batch")


def seeded_batches(shape, classes: int, count: int, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((batch, *shape)).astype(np.float32), rng.integers(0, classes, batch).astype(np.int64))
        for _ in range(count)
    ]


def torch_reference(spec: ModelSpec, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(spec).train()


def test_ort_training_matches_pytorch_20_sgd_steps(bundle_factory):
    bundle = bundle_factory("cnn", 2, norm="batch")
    engine = open_engine(bundle, "ort-training")
    reference = torch_reference(ModelSpec(**BN_CNN), seed=0)
    initial = engine.get_tensors()
    for name, value in reference.state_dict().items():
        if name in initial:
            np.testing.assert_array_equal(initial[name], value.numpy())
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for x, y in seeded_batches((3, 32, 32), 10, count=20, batch=8):
        engine.train_step(x, y, lr=0.05)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        optimizer.step()
    ours = engine.get_tensors()
    state = reference.state_dict()
    for name, value in ours.items():
        np.testing.assert_allclose(value, state[name].numpy(), rtol=0, atol=1e-6, err_msg=name)
    assert any("running_var" in name for name in ours)
    x, y = seeded_batches((3, 32, 32), 10, count=1, batch=8, seed=7)[0]
    reference.eval()
    with torch.no_grad():
        logits = reference(torch.from_numpy(x))
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y), reduction="sum").item()
    result = engine.eval_batch(x, y)
    assert result.correct == int((logits.argmax(1).numpy() == y).sum())
    assert result.loss_sum == pytest.approx(loss, rel=1e-5)


def test_eval_logits_match_pytorch(bundle_factory):
    import onnxruntime

    bundle = bundle_factory("cnn", 2, norm="batch")
    reference = torch_reference(ModelSpec(**BN_CNN), seed=0).eval()
    x, _ = seeded_batches((3, 32, 32), 10, count=1, batch=5, seed=3)[0]
    session = onnxruntime.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"input": x})
    with torch.no_grad():
        np.testing.assert_allclose(logits, reference(torch.from_numpy(x)).numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("trainable, frozen_role", [("personal", "base"), ("base", "personal")])
def test_frozen_sets_stay_bit_identical(bundle_factory, trainable, frozen_role):
    bundle = bundle_factory("cnn", 2, norm="batch")
    engine = open_engine(bundle, "ort-training")
    before = engine.tensors_by_role(frozen_role)
    trained_role = "personal" if frozen_role == "base" else "base"
    moving = engine.tensors_by_role(trained_role)
    for x, y in seeded_batches((3, 32, 32), 10, count=5, batch=8):
        engine.train_step(x, y, lr=0.1, trainable=trainable)
    after = engine.tensors_by_role(frozen_role)
    for name in before:
        assert np.array_equal(before[name], after[name]), name
    assert any(not np.array_equal(moving[n], v) for n, v in engine.tensors_by_role(trained_role).items())


def test_mobilenet_bundle_trains_and_infers(bundle_factory):
    import onnxruntime

    bundle = bundle_factory("mobilenet", 2, width=0.25)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["kp"] == 2 and len(manifest["blocks"]) == 15
    assert {"full", "personal", "base"} == set(manifest["engines"]["ort-training"]["sets"])
    for rel, digest in manifest["files"].items():
        assert (bundle / rel).is_file() and len(digest) == 64
    engine = open_engine(bundle, "ort-training")
    x, y = seeded_batches((3, 32, 32), 10, count=1, batch=16)[0]
    losses = [engine.train_step(x, y, lr=0.05) for _ in range(8)]
    assert losses[-1] < losses[0] - 0.1, losses
    session = onnxruntime.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input": x[:3]})
    assert logits.shape == (3, 10) and np.isfinite(logits).all()


def test_kp_extremes_write_only_the_sets_that_exist(bundle_factory):
    all_base = bundle_factory("mlp", 0)
    all_personal = bundle_factory("mlp", 2)
    sets0 = json.loads((all_base / "manifest.json").read_text())["engines"]["ort-training"]["sets"]
    sets2 = json.loads((all_personal / "manifest.json").read_text())["engines"]["ort-training"]["sets"]
    assert set(sets0) == {"full", "base"} and set(sets2) == {"full", "personal"}
    engine = open_engine(all_base, "ort-training")
    from edgepfl.errors import UsageError

    with pytest.raises(UsageError, match="no 'personal' trainable set"):
        engine.train_step(*seeded_batches((1, 28, 28), 10, 1, 4)[0], lr=0.1, trainable="personal")


def test_tampered_bundle_file_is_refused(bundle_factory, tmp_path):
    import shutil

    from edgepfl.errors import BundleError

    copy = tmp_path / "copy"
    shutil.copytree(bundle_factory("mlp", 1), copy)
    with open(copy / "model.onnx", "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(BundleError, match="model.onnx does not match its sha256"):
        open_engine(copy, "ort-training")


def test_runtime_loads_and_trains_without_torch(bundle_factory):
    bundle = bundle_factory("cnn", 2, norm="batch")
    code = f"""
import numpy as np
from edgepfl.device_runtime.engine import open_engine
engine = open_engine({str(bundle)!r}, "ort-training")
rng = np.random.default_rng(0)
x = rng.standard_normal((4, 3, 32, 32)).astype(np.float32)
y = rng.integers(0, 10, 4)
print("loss", engine.train_step(x, y, lr=0.1))
print("torch loaded:", "torch" in sys.modules and sys.modules["torch"] is not None)
"""
    result = run_without_torch(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "loss" in result.stdout and "torch loaded: False" in result.stdout


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgepfl.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["export", "lenet", "--out", "{out}"], "unknown model 'lenet'"),
        (["export", "mobilenet", "--kp", "16", "--out", "{out}"], "--kp 16 is outside 0..15"),
        (["export", "mlp", "--kp", "-1", "--out", "{out}"], "--kp -1: input should be greater than or equal to 0"),
        (["export", "mobilenet", "--width", "0.3", "--out", "{out}"], "width 0.3 is not allowed"),
        (["export", "mobilenet", "--norm", "layer", "--out", "{out}"], "--norm 'layer' is unknown (use one of: batch"),
        (["export", "mlp", "--engines", "tflite", "--out", "{out}"], "--engines 'tflite' is unknown"),
        (["export", "mlp", "--optimizer", "adam", "--out", "{out}"], "--optimizer 'adam' is unknown"),
        (["export", "mlp", "--seed", "-1", "--out", "{out}"], "--seed -1: input should be greater than or equal to 0"),
        (["export", "mlp", "--out", "{full}"], "is not empty"),
        (["export", "mlp", "--class-names", "a,b", "--out", "{out}"], "2 class names for a model of 10 classes"),
        (["export", "mlp", "--class-names", "cat,Cat", "--out", "{out}"], "'cat' and 'Cat' are the same name"),
        (["export", "mlp", "--class-names", "a,,b", "--out", "{out}"], "class name 1 is empty"),
        (["export", "mlp", "--class-names", "a/b,c", "--out", "{out}"], "'a/b' cannot name an image folder"),
        (["export", "mlp", "--class-names-file", "{out}", "--out", "{out}"], "--class-names-file"),
        (["export", "mlp", "--class-names", "a", "--class-names-file", "{out}"], "both --class-names and"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("precious")
    args = [a.format(out=tmp_path / "out", full=full) for a in args]
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert (full / "keep.txt").read_text() == "precious"


@pytest.mark.slow
def test_cli_export_prints_the_split(tmp_path):
    names = [f"digit {n}" for n in range(10)]  # a comma would split --class-names: a file takes any name
    (tmp_path / "names.txt").write_text("\n".join(names) + "\n")
    result = run_cli(
        "export",
        "mlp",
        "--kp",
        "1",
        "--out",
        str(tmp_path / "b"),
        "--engines",
        "ort-training",
        "--class-names-file",
        str(tmp_path / "names.txt"),
    )
    assert result.returncode == 0, result.stderr
    assert "personal" in result.stdout and "one round uploads" in result.stdout
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["kp"] == 1 and manifest["class_names"] == names
    assert load_manifest(tmp_path / "b").class_labels == tuple(names)


@pytest.mark.slow
def test_cli_export_without_frozen_variants_writes_the_plain_steps_only(tmp_path):
    """--no-frozen-variants: no step_*_frozen.onnx and no `frozen` entry; the portable engine trains on the plain
    graphs (by default a personal-only step has its variant)."""
    args = ("export", "cnn", "--kp", "1", "--engines", "portable")
    result = run_cli(*args, "--out", str(tmp_path / "plain"), "--no-frozen-variants")
    assert result.returncode == 0, result.stderr
    bundle = tmp_path / "plain"
    steps = json.loads((bundle / "manifest.json").read_text())["engines"]["portable"]["steps"]
    assert not [p.name for p in (bundle / "portable").glob("*_frozen.onnx")]
    assert not [name for name, step in steps.items() if "frozen" in step]
    engine = open_engine(bundle, "portable")
    engine.bake_after = 0
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, *engine.manifest.input.shape)).astype(np.float32)
    losses = [engine.train_step(x, np.arange(4) % 10, lr=0.1, trainable="personal") for _ in range(3)]
    assert losses[-1] < losses[0] and not engine._baked
    result = run_cli(*args, "--out", str(tmp_path / "default"))
    assert result.returncode == 0, result.stderr
    steps = json.loads((tmp_path / "default" / "manifest.json").read_text())["engines"]["portable"]["steps"]
    assert "frozen" in steps["personal"] and "frozen" not in steps["full"]
