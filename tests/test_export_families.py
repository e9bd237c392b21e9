"""torchvision's mobile families through both engines at 32x32, batch 4, against float64 PyTorch.

Each family is its torchvision class at a reduced width and depth (the same layers and operations:
inverted residuals, squeeze-and-excitation, Hardswish/Hardsigmoid, SiLU, ReLU6, channel shuffle,
stochastic depth, residual adds), so that its step graphs export in about a minute on two cores.
One SGD step is compared with PyTorch in float64: the exported ATen arithmetic itself within 1e-5
(traced in float64); the float32 engines' BatchNorm statistics and parameters no farther from float64
than 1e-5 plus twice PyTorch float32's own distance (a float32 step at initialisation is
ill-conditioned through BatchNorm's backward, see tests/test_portable.py, and these families hold
tensors that are zero up to rounding, where any float32 result is relatively far).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
from edgepfl.device_runtime.engine import open_engine, training_build_installed  # noqa: E402

pytestmark = pytest.mark.slow
SHAPE = (3, 32, 32)
BATCH = 4
CLASSES = 10
RTOL = 1e-5
ZERO = 1e-5
ENGINES = ["portable", "ort-training"]


def build_family(name: str) -> torch.nn.Module:
    """A small member of the torchvision family `name` (seeded)."""
    from torchvision.models import efficientnet, mobilenetv3, resnet, shufflenetv2

    torch.manual_seed(0)
    if name == "mobilenet_v2":
        setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 1, 2]]
        return torchvision.models.MobileNetV2(CLASSES, width_mult=0.25, inverted_residual_setting=setting)
    if name in ("mobilenet_v3_small", "mobilenet_v3_large"):
        setting, _ = mobilenetv3._mobilenet_v3_conf(name, width_mult=0.25)
        setting = setting[:5] if name == "mobilenet_v3_small" else [setting[i] for i in (0, 3, 6, 7)]
        return torchvision.models.MobileNetV3(setting, last_channel=64, num_classes=CLASSES)
    if name == "resnet18":
        return torchvision.models.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=CLASSES)
    if name == "efficientnet_b0":
        setting, last = efficientnet._efficientnet_conf(name, width_mult=0.25, depth_mult=0.25)
        return torchvision.models.EfficientNet(setting[:3], dropout=0.2, num_classes=CLASSES, last_channel=last)
    assert name == "shufflenet_v2_x1_0"
    # two blocks in stage 2: the second has stride 1, whose channel split (chunk) exports as split_copy
    return shufflenetv2.ShuffleNetV2([2, 1, 1], [8, 16, 32, 64, 64], num_classes=CLASSES)


FAMILIES = [
    "mobilenet_v3_small",
    "efficientnet_b0",
    "shufflenet_v2_x1_0",
    "resnet18",
    "mobilenet_v2",
    "mobilenet_v3_large",
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, module, bundle, notices): the family's bundle with every engine this environment builds."""
    from edgepfl.export.bundle import export_bundle
    from edgepfl.export.options import ExportOptions, default_engines

    torch.set_num_threads(2)
    module = build_family(request.param)
    out = tmp_path_factory.mktemp(request.param) / "bundle"
    notices: list[str] = []
    options = ExportOptions(engines=default_engines(), portable_batch=BATCH, force=True)
    export_bundle(module, 2, out, options, input_shape=SHAPE, notice=notices.append)
    return request.param, module, out, notices


def batch(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((BATCH, *SHAPE)).astype(np.float32), rng.integers(0, CLASSES, BATCH)


def torch_step(module, x, y, dtype, lr: float = 0.1) -> dict[str, np.ndarray]:
    """PyTorch's SGD step with random layers off (as on the device), as float64 arrays."""
    from edgepfl.export.prepare import without_random_layers

    reference = without_random_layers(module).to(dtype).train()
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(x).to(dtype)), torch.from_numpy(y))
    loss.backward()
    optimizer.step()
    return {n: t.detach().double().numpy() for n, t in reference.state_dict().items()}


def relative_error(ours, reference, floor: float = 1e-9) -> float:
    """Largest deviation over the tensor's largest magnitude. Some tensors are zero up to rounding (a BatchNorm
    after a linear bottleneck sees zero-mean inputs, and the bias before it gets no gradient): `floor` keeps
    their float64 rounding noise (~1e-17) from counting as a relative error."""
    reference = np.asarray(reference, dtype=np.float64)
    return float(np.abs(np.asarray(ours, np.float64) - reference).max() / max(np.abs(reference).max(), floor))


@pytest.mark.slow
def test_family_blocks_and_random_layers_are_recorded(family):
    name, module, bundle, notices = family
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["model"]["blocks_from"].startswith("torchvision"), name
    assert manifest["blocks"][-1]["name"] in ("classifier", "fc")
    random_layers = manifest["model"]["random_layers_off"]
    assert bool(random_layers) == (name != "resnet18" and name != "shufflenet_v2_x1_0"), random_layers
    assert any("evaluation mode" in line for line in notices) == bool(random_layers)
    if training_build_installed():
        assert set(manifest["engines"]) == {"portable", "ort-training"}, notices


@pytest.mark.slow
def test_family_step_arithmetic_matches_float64_pytorch(family):
    """The ATen graph the portable step exports (our decompositions), run in float64, within 1e-5."""
    import copy

    from edgepfl.export import portable
    from edgepfl.export.prepare import without_random_layers

    name, module, _, _ = family
    model = without_random_layers(module).double()
    params = [n for n, _ in model.named_parameters()]
    buffers = [n for n, _ in model.named_buffers() if not n.endswith("num_batches_tracked")]
    state = {n: t.detach() for n, t in model.state_dict().items()}
    x, y = batch()
    inputs = [state[n] for n in params + buffers] + [
        torch.from_numpy(x).double(),
        torch.from_numpy(y),
        torch.ones(BATCH, dtype=torch.float64),
        torch.tensor(0.1, dtype=torch.float64),
    ]
    step_model = portable.MaskedModel(copy.deepcopy(model), portable.StepShape(SHAPE, CLASSES))
    step_model.train()
    graph = portable.trace(portable.step_function(step_model, params, buffers, params), inputs, tracing_mode="real")
    outputs = dict(zip(params + buffers, (t.numpy() for t in graph(*inputs)[1:])))
    reference = torch_step(module, x, y, torch.float64)
    worst = max(params + buffers, key=lambda n: relative_error(outputs[n], reference[n]))
    assert relative_error(outputs[worst], reference[worst]) <= RTOL, f"{name} {worst}"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_family_engine_step_is_as_close_to_float64_as_pytorch_float32(family, engine):
    if engine == "ort-training" and not training_build_installed():
        pytest.skip("needs onnxruntime-training-cpu")
    name, module, bundle, _ = family
    runtime = open_engine(bundle, engine, threads=2)
    x, y = batch()
    runtime.train_step(x, y, lr=0.1)
    ours = runtime.get_tensors()
    exact = torch_step(module, x, y, torch.float64)
    eager = torch_step(module, x, y, torch.float32)
    # tensors that are zero up to rounding (below ZERO in float64) have no relative error to speak of:
    # float32 noise there must stay below ZERO in absolute terms
    zero = [n for n in ours if np.abs(exact[n]).max() < ZERO]
    for tensor in zero:
        assert np.abs(ours[tensor] - exact[tensor]).max() < ZERO, (name, engine, tensor)
    buffers = [n for n in ours if "running_" in n and n not in zero]
    params = [n for n in ours if "running_" not in n and n not in zero]
    for group in (buffers, params):  # the running statistics, then the parameters
        mine = max(relative_error(ours[n], exact[n]) for n in group)
        theirs = max(relative_error(eager[n], exact[n]) for n in group)
        assert mine <= RTOL + 2 * theirs, (name, engine, group[0], mine, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("trainable, frozen_role", [("personal", "base"), ("base", "personal")])
def test_family_frozen_tensors_stay_bit_identical(family, trainable, frozen_role):
    name, _, bundle, _ = family
    x, y = batch(2)
    for engine in ENGINES if training_build_installed() else ENGINES[:1]:
        runtime = open_engine(bundle, engine, threads=2)
        before = runtime.tensors_by_role(frozen_role)
        moving = runtime.tensors_by_role("personal" if frozen_role == "base" else "base")
        for _ in range(2):
            runtime.train_step(x, y, lr=0.1, trainable=trainable)
        after = runtime.tensors_by_role(frozen_role)
        assert before and all(np.array_equal(before[n], after[n]) for n in before), (name, engine)
        moved = runtime.tensors_by_role("personal" if frozen_role == "base" else "base")
        assert any(not np.array_equal(moving[n], moved[n]) for n in moving), (name, engine)


@pytest.mark.slow
def test_family_inference_model_equals_pytorch_eval(family):
    import onnxruntime

    name, module, bundle, _ = family
    x, _ = batch(3)
    session = onnxruntime.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = module.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(session.run(None, {"input": x})[0], expected, rtol=0, atol=1e-4, err_msg=name)
    # every tensor keeps its manifest name, so that `device export-model` bakes a device's tensors into this graph
    import onnx

    named = {init.name for init in onnx.load(str(bundle / "model.onnx")).graph.initializer}
    assert {t["name"] for t in json.loads((bundle / "manifest.json").read_text())["tensors"]} <= named, name
