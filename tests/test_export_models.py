"""`edgepfl export` of any nn.Module: a model file with its own blocks, --weights, --num-classes, MODEL strings
and the one-line refusals (unsupported op, orphan parameter, bad MODEL string, missing --input-shape)."""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pytest
from conftest import run_without_torch

torch = pytest.importorskip("torch")
from typer.testing import CliRunner  # noqa: E402

from edgepfl.cli import app  # noqa: E402
from edgepfl.device_runtime.engine import open_engine, training_build_installed  # noqa: E402

FAST_ENGINE = "ort-training" if training_build_installed() else "portable"  # ORT artifacts export in seconds
# a model of its own: declared blocks, BatchNorm, depthwise conv, GroupNorm, squeeze-and-excitation, a residual
# add, Hardswish, SiLU, LayerNorm, Dropout; 3x8x8 inputs so that its four step graphs export in seconds
MODEL_FILE = """
import torch
from torch import nn
import torch.nn.functional as F


class Small(nn.Module):
    edgepfl_input_shape = (3, 8, 8)

    def __init__(self, classes=5):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.Hardswish()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.gn = nn.GroupNorm(2, 8)
        self.se = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(8, classes)

    def edgepfl_blocks(self):
        return [("stem", ["conv", "bn"]), ("body", ["dw", "gn", "se"]), ("head", ["ln", "fc"])]

    def forward(self, x):
        x = self.act(self.bn(self.conv(x)))
        y = F.silu(self.gn(self.dw(x)))
        y = y * torch.sigmoid(self.se(y.mean((2, 3)))).unsqueeze(-1).unsqueeze(-1) + x
        return self.fc(self.drop(self.ln(F.adaptive_avg_pool2d(y, 1).flatten(1))))


def build():
    return Small()


def no_shape():
    model = Small()
    del Small.edgepfl_input_shape
    return model


class Orphan(Small):
    def edgepfl_blocks(self):
        return [("stem", ["conv", "bn"]), ("body", ["dw", "gn"]), ("head", ["ln", "fc"])]


def orphan():
    return Orphan()


class Twice(Small):
    def edgepfl_blocks(self):
        return [("stem", ["conv", "bn", "dw"]), ("body", ["dw", "gn", "se"]), ("head", ["ln", "fc"])]


def twice():
    return Twice()


class Cumulative(Small):
    def forward(self, x):
        return self.fc(torch.cumsum(super().forward(x), 1)[:, :1].expand(-1, 8))


def cumulative():
    return Cumulative()


class RandomInForward(Small):
    def forward(self, x):
        return F.dropout(super().forward(x), 0.5, self.training)


def random_in_forward():
    return RandomInForward()


def returns_int():
    return 3


def grey():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Dropout(0.1), nn.Linear(4, 3),
    )
"""


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("own-model") / "small.py"
    path.write_text(textwrap.dedent(MODEL_FILE))
    return path


def load_factory(model_file, name: str = "build"):
    from edgepfl.export import source

    return source.build_from_string(source.parse_model(f"{model_file}:{name}"))


@pytest.fixture(scope="module")
def own_bundle(model_file, tmp_path_factory):
    """The model file's network exported with both engines (portable batch 4), and the module it came from.

    About 40 s of CPU for its four portable step graphs: the tests that use it are marked slow."""
    from edgepfl.export.bundle import export_bundle
    from edgepfl.export.options import ExportOptions, default_engines

    torch.set_num_threads(2)
    loaded = load_factory(model_file)
    out = tmp_path_factory.mktemp("own-bundle") / "bundle"
    notices = []
    export_bundle(
        loaded.module,
        2,
        out,
        ExportOptions(engines=default_engines(), portable_batch=4, force=True),
        input_shape=loaded.input_shape,
        description=loaded.description,
        notice=notices.append,
    )
    return out, loaded.module, notices


@pytest.mark.slow
def test_own_model_file_exports_with_its_declared_blocks(own_bundle):
    bundle, module, notices = own_bundle
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [b["name"] for b in manifest["blocks"]] == ["stem", "body", "head"]
    roles = {t["name"]: t["role"] for t in manifest["tensors"]}
    assert roles["conv.weight"] == "base" and roles["se.weight"] == "personal" and roles["fc.bias"] == "personal"
    assert roles["bn.running_var"] == "buffer"
    assert manifest["model"]["blocks_from"] == "declared by the model"
    # dropout: off in on-device training, said once and recorded
    assert manifest["model"]["random_layers_off"] == ["drop"]
    assert len(notices) == 1 and "Dropout" in notices[0] and "drop" in notices[0]
    expected = {"portable", "ort-training"} if training_build_installed() else {"portable"}
    assert set(manifest["engines"]) == expected


@pytest.mark.slow
def test_own_model_onnx_equals_pytorch_eval_logits(own_bundle):
    import onnxruntime

    bundle, module, _ = own_bundle
    x = np.random.default_rng(0).standard_normal((6, 3, 8, 8)).astype(np.float32)
    session = onnxruntime.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"input": x})
    with torch.no_grad():
        expected = module.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["portable", "ort-training"])
def test_own_model_trains_where_torch_cannot_be_imported(own_bundle, engine):
    if engine == "ort-training" and not training_build_installed():
        pytest.skip("needs onnxruntime-training-cpu")
    bundle, _, _ = own_bundle
    code = f"""
import numpy as np
from edgepfl.device_runtime.engine import open_engine
engine = open_engine({str(bundle)!r}, {engine!r}, threads=1)
rng = np.random.default_rng(0)
x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
y = rng.integers(0, 5, 4)
losses = [engine.train_step(x, y, lr=0.1) for _ in range(8)]
print("losses", losses)
print("torch loaded:", sys.modules.get("torch") is not None)
"""
    result = run_without_torch(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch loaded: False" in result.stdout
    losses = json.loads(result.stdout.split("losses ")[1].splitlines()[0].replace("'", '"'))
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["portable", "ort-training"])
def test_own_model_one_step_matches_float64_pytorch(own_bundle, engine):
    """Parameters and BatchNorm statistics after one SGD step, against PyTorch in float64 (dropout off)."""
    if engine == "ort-training" and not training_build_installed():
        pytest.skip("needs onnxruntime-training-cpu")
    from edgepfl.export.prepare import without_random_layers

    bundle, module, _ = own_bundle
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 5, 4)
    runtime = open_engine(bundle, engine, threads=1)
    runtime.train_step(x, y, lr=0.1)
    ours = runtime.get_tensors()
    reference = without_random_layers(module).double().train()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(reference(torch.from_numpy(x).double()), torch.from_numpy(y)).backward()
    optimizer.step()
    state = reference.state_dict()
    for name, value in ours.items():
        expected = state[name].numpy()
        error = np.abs(value - expected).max() / max(np.abs(expected).max(), 1e-12)
        assert error <= 1e-5, f"{engine} {name}: relative error {error:.1e}"


@pytest.mark.slow
@pytest.mark.parametrize("trainable, frozen_role", [("personal", "base"), ("base", "personal")])
def test_own_model_frozen_tensors_stay_bit_identical(own_bundle, trainable, frozen_role):
    bundle, _, _ = own_bundle
    rng = np.random.default_rng(2)
    for engine in ["portable", "ort-training"] if training_build_installed() else ["portable"]:
        runtime = open_engine(bundle, engine, threads=1)
        before = runtime.tensors_by_role(frozen_role)
        for _ in range(3):
            runtime.train_step(
                rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, 4), 0.1, trainable
            )
        after = runtime.tensors_by_role(frozen_role)
        assert before and all(np.array_equal(before[n], after[n]) for n in before), engine


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output  # stdout and stderr as the user sees them


def one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


def test_weights_give_the_same_eval_logits_and_num_classes_changes_only_the_head(model_file, tmp_path):
    import onnxruntime

    torch.manual_seed(5)
    trained = load_factory(model_file).module
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)  # weights unlike a fresh seed's
        trained.bn.running_mean.add_(0.3)
    weights = tmp_path / "trained.pt"
    torch.save(trained.state_dict(), weights)
    x = np.random.default_rng(3).standard_normal((5, 3, 8, 8)).astype(np.float32)

    code, output = invoke(
        "export",
        f"{model_file}:build",
        "--weights",
        str(weights),
        "--kp",
        "1",
        "--engines",
        FAST_ENGINE,
        "--out",
        str(tmp_path / "same"),
    )
    assert code == 0, output
    session = onnxruntime.InferenceSession(str(tmp_path / "same" / "model.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = trained.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(session.run(None, {"input": x})[0], expected, rtol=0, atol=1e-5)

    from safetensors.torch import save_file

    safetensors_weights = tmp_path / "trained.safetensors"
    save_file(trained.state_dict(), str(safetensors_weights))
    code, output = invoke(
        "export",
        f"{model_file}:build",
        "--weights",
        str(safetensors_weights),
        "--kp",
        "1",
        "--num-classes",
        "7",
        "--engines",
        FAST_ENGINE,
        "--out",
        str(tmp_path / "head"),
    )
    assert code == 0, output
    manifest = json.loads((tmp_path / "head" / "manifest.json").read_text())
    assert manifest["num_classes"] == 7 and manifest["model"]["new_head"] == "fc"
    assert manifest["model"]["weights"]["file"] == "trained.safetensors"
    tensors = open_engine(tmp_path / "head", FAST_ENGINE).get_tensors()
    state = trained.state_dict()
    for name, value in tensors.items():
        if name.startswith("fc."):
            assert value.shape[0] == 7, name
        else:
            assert np.array_equal(value, state[name].numpy()), name


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not a pickle at all", "cannot read weights file"),
        ("other", "does not fit the model: 2 missing (fc.weight, fc.bias); 1 unexpected (head.weight) key(s)"),
        ("shape", "have another shape, e.g. fc.weight is (3, 8)"),
        ("list", "holds a list, not a state_dict"),
    ],
)
def test_wrong_weights_file_is_one_line(model_file, tmp_path, content, message):
    path = tmp_path / "weights.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        state = load_factory(model_file).module.state_dict()
        if content == "other":
            state["head.weight"] = state.pop("fc.weight")
            del state["fc.bias"]
        elif content == "shape":
            state["fc.weight"] = torch.zeros(3, 8)
        torch.save(list(state.values()) if content == "list" else state, path)
    code, output = invoke("export", f"{model_file}:build", "--weights", str(path), "--out", str(tmp_path / "b"))
    assert code == 2
    assert message in one_error_line(output)
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, extra, message",
    [
        ("{file}:cumulative", [], "cannot differentiate aten.cumsum (in module (model))"),
        ("{file}:random_in_forward", [], "(model) calls the random operation aten."),
        ("{file}:orphan", [], "tensor 'se.weight' belongs to no block"),
        ("{file}:twice", [], "tensor 'dw.weight' is in two blocks ('stem' and 'body')"),
        ("{file}:no_shape", [], "does not say its input shape (pass --input-shape C,H,W)"),
        ("{file}:no_shape", ["--input-shape", "3,8"], "--input-shape '3,8' is not C,H,W"),
        ("{file}:returns_int", [], "returned a int, not a torch.nn.Module"),
        ("{file}:missing", [], "has no function 'missing'"),
        ("nowhere/model.py:build", [], "model file nowhere/model.py does not exist"),
        ("no_such_package_xyz.models:build", [], "cannot import no_such_package_xyz.models"),
        ("torchvision:resnet_9000", [], "has no classification model 'resnet_9000'"),
        ("lenet", [], "unknown model 'lenet'"),
        ("torchvision:resnet18", ["--width", "0.5"], "--width applies to zoo models only"),
        ("mlp", ["--input-shape", "1,28,28"], "--input-shape is for torchvision:/factory models"),
    ],
)
def test_bad_model_is_one_line_and_exit_2(model_file, tmp_path, model, extra, message):
    code, output = invoke("export", model.format(file=model_file), *extra, "--out", str(tmp_path / "b"))
    assert code == 2, output
    assert message in one_error_line(output)
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_torchvision_families_split_by_their_structure():
    from edgepfl.export import source
    from edgepfl.export.blocks import check_blocks, find_blocks

    expected = {
        "mobilenet_v2": (20, "features.0", "classifier"),
        "mobilenet_v3_small": (14, "features.0", "classifier"),
        "mobilenet_v3_large": (18, "features.0", "classifier"),
        "resnet18": (10, "stem", "fc"),
        "efficientnet_b0": (10, "features.0", "classifier"),
        "shufflenet_v2_x1_0": (19, "conv1", "fc"),
    }
    for name in source.TORCHVISION_TESTED:
        module = source.load_source(source.parse_model(f"torchvision:{name}")).module
        blocks, origin = find_blocks(module)
        check_blocks(module, blocks)
        assert (len(blocks), blocks[0][0], blocks[-1][0]) == expected[name], name
        assert origin.startswith("torchvision"), name


def test_show_blocks_prints_sizes_and_uploads_per_kp(model_file):
    code, output = invoke("export", f"{model_file}:build", "--show-blocks")
    assert code == 0, output
    assert "declared by the model" in output and "one round" in output
    assert [line.split("│")[2].strip() for line in output.splitlines() if line.count("│") == 7] == [
        "stem",
        "body",
        "head",
    ]


def test_unknown_children_fall_back_to_top_level_children_and_refuse_root_tensors():
    from edgepfl.errors import UsageError
    from edgepfl.export.blocks import check_blocks, find_blocks

    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    blocks, origin = find_blocks(plain)
    assert blocks == [("0", ["0"]), ("2", ["2"])] and origin == "top-level children"

    class WithToken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.token = torch.nn.Parameter(torch.zeros(4))
            self.fc = torch.nn.Linear(4, 2)

    module = WithToken()
    with pytest.raises(UsageError, match="tensor 'token' belongs to no block"):
        check_blocks(module, find_blocks(module)[0])


def test_simulate_takes_a_model_string(model_file, tmp_path):
    """`simulate --model file.py:factory`: the dataset's shape, a head for its classes, blocks from the children."""
    from edgepfl.simulate.config import SimulateConfig
    from edgepfl.simulate.loop import run_simulation

    rng = np.random.default_rng(0)
    data = tmp_path / "grey.npz"
    np.savez(
        data,
        x_train=rng.integers(0, 256, (160, 28, 28), dtype=np.uint8),
        y_train=np.arange(160) % 10,
        x_test=rng.integers(0, 256, (40, 28, 28), dtype=np.uint8),
        y_test=np.arange(40) % 10,
    )
    config = SimulateConfig(
        out=str(tmp_path / "run"),
        model=f"{model_file}:grey",
        kp=1,
        dataset=str(data),
        data_root=str(tmp_path),
        partition="iid",
        clients=2,
        rounds=1,
        epochs=1,
        batch_size=16,
        engine="torch",
        threads=1,
    )
    results = run_simulation(config)
    manifest = json.loads((tmp_path / "run" / "bundle" / "manifest.json").read_text())
    assert manifest["model"]["source"] == config.model and manifest["model"]["new_head"] == "6"
    assert manifest["num_classes"] == 10 and manifest["input"]["shape"] == [1, 28, 28]
    assert [b["name"] for b in manifest["blocks"]] == ["0", "1", "6"]
    assert manifest["model"]["random_layers_off"] == ["5"]
    assert len(results.rounds) == 1 and math.isfinite(results.rounds[0].test_accuracy["mean"])


def test_the_export_target_is_what_the_options_name(tmp_path):
    """export.target.command_target: the zoo spec from --width/--num-classes, HAPT's class names by default for
    har-cnn, and a sensor option refused on an image model."""
    from edgepfl.datasets.har import HAR_ACTIVITIES
    from edgepfl.errors import UsageError
    from edgepfl.export.options import ExportCommand
    from edgepfl.export.target import command_target
    from edgepfl.options import validated

    target, options = command_target(validated(ExportCommand, {"model": "mlp", "num_classes": 4}))
    assert target.num_classes == 4 and options.class_names == ()
    target, options = command_target(validated(ExportCommand, {"model": "har-cnn"}))
    assert target.kind.name == "sensor" and options.class_names == HAR_ACTIVITIES
    with pytest.raises(UsageError, match="applies to text and sensor models only"):
        command_target(validated(ExportCommand, {"model": "mlp", "window": 64}))
