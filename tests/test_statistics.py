"""Issue 18, FedPer on MobileNet: a device re-estimates its BatchNorm statistics when a base arrives.

The cause (bench/results/NOTES-issue18.md §2): a device's running statistics were accumulated under the base it
trained; under the next base they no longer describe its activations, and its held model scores near chance.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgepfl.data import make_local_data  # noqa: E402
from edgepfl.device_runtime.engine import open_engine  # noqa: E402
from edgepfl.device_runtime.statistics import receive, recompute_statistics  # noqa: E402
from edgepfl.errors import WireError  # noqa: E402
from edgepfl.manifest import load_manifest  # noqa: E402
from edgepfl.protocol import RoundSettings  # noqa: E402
from edgepfl.simulate.torch_engine import TorchEngine  # noqa: E402
from edgepfl.wire import load_tensors  # noqa: E402

BATCH = 8


def _open(engine_name: str, bundle):
    manifest = load_manifest(bundle)
    if engine_name == "torch":
        initial = load_tensors(bundle / manifest.engines["portable"]["initial"])
        return TorchEngine(bundle, manifest, initial, threads=1)
    return open_engine(bundle, engine_name, threads=1)


def _data(manifest, count: int = 37, seed: int = 0):
    rng = np.random.default_rng(seed)
    channels, height, width = manifest.input.shape
    images = rng.integers(0, 256, (count, height, width, channels), dtype=np.uint8)
    labels = rng.integers(0, manifest.num_classes, count)
    return make_local_data(images, labels, manifest, 0.2, seed=seed)


def _reference(engine, data, batch_size: int) -> dict[str, np.ndarray]:
    """torch's own answer for the engine's current weights (see _update_bn)."""
    from edgepfl.export.source import rebuild_module

    model = rebuild_module(engine.manifest.model)
    tensors = engine.get_tensors()
    model.load_state_dict({n: torch.from_numpy(v) for n, v in tensors.items()}, strict=False)
    return _update_bn(model, engine.manifest.batchnorm_statistics(), data, batch_size)


def _update_bn(model, names: list[str], data, batch_size: int) -> dict[str, np.ndarray]:
    """Running statistics as torch's `update_bn` computes them (momentum None: the plain average over the batches),
    in float64, on the same full batches in stored order."""
    import copy

    reference = copy.deepcopy(model).double()
    for module in reference.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None
    reference.train()
    with torch.no_grad():
        for x, _ in data.train_batches_in_order(batch_size, full_only=True):
            reference(torch.from_numpy(x.astype(np.float64)))
    buffers = dict(reference.named_buffers())
    return {name: buffers[name].numpy() for name in names}


def _train_a_little(engine, data) -> None:
    """A few steps, so that the statistics are the trained model's and far from a fresh estimate."""
    for x, y in data.train_batches(BATCH, seed=1, epoch=0):
        engine.train_step(x, y, 0.05, "full")


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ["torch", "portable", "ort-training"])
def test_recomputed_statistics_equal_torchs_update_bn_and_leave_every_weight(bundle_factory, engine_name) -> None:
    bundle = bundle_factory("cnn", 1, engines=("ort-training", "portable"), norm="batch", width=0.25)
    engine = _open(engine_name, bundle)
    data = _data(engine.manifest)
    _train_a_little(engine, data)
    weights = engine.get_tensors(engine.manifest.trainable("full"))
    stale = engine.get_tensors(engine.manifest.batchnorm_statistics())
    want = _reference(engine, data, BATCH)
    used = recompute_statistics(engine, data, BATCH)
    assert used == data.num_train - data.num_train % BATCH  # the partial last batch is left out
    got = engine.get_tensors(list(want))
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
        assert not np.allclose(got[name], stale[name], atol=1e-3), f"{name} kept its stale value"
    for name, value in engine.get_tensors(list(weights)).items():
        assert np.array_equal(value, weights[name]), f"{name} moved"


def test_statistics_do_not_depend_on_which_engine_recomputes_them(bundle_factory) -> None:
    bundle = bundle_factory("cnn", 1, engines=("ort-training", "portable"), norm="batch", width=0.25)
    tensors = _open("torch", bundle)
    data = _data(tensors.manifest)
    _train_a_little(tensors, data)
    state = tensors.get_tensors()
    estimates = {}
    for name in ("torch", "portable", "ort-training"):
        engine = _open(name, bundle)
        engine.set_tensors(state)
        recompute_statistics(engine, data, BATCH)
        estimates[name] = engine.get_tensors(engine.manifest.batchnorm_statistics())
    for name, value in estimates["torch"].items():
        for other in ("portable", "ort-training"):
            np.testing.assert_allclose(estimates[other][name], value, rtol=1e-5, atol=1e-5, err_msg=f"{other} {name}")


def test_a_received_base_gets_statistics_of_its_own_and_recompute_bn_off_keeps_the_old(bundle_factory) -> None:
    """The cause: before the fix the held model kept the statistics of the base it trained (fails then)."""
    bundle = bundle_factory("cnn", 1, engines=("ort-training", "portable"), norm="batch", width=0.25)
    engine = _open("portable", bundle)
    data = _data(engine.manifest)
    received = {n: v for n, v in engine.get_tensors().items() if n in engine.manifest.names("base")}  # a fresh base
    _train_a_little(engine, data)
    own = engine.get_tensors()
    stale = engine.get_tensors(engine.manifest.batchnorm_statistics())

    receive(engine, received, data, RoundSettings(batch_size=BATCH, recompute_bn=False))
    kept = engine.get_tensors(list(stale))
    assert all(np.array_equal(kept[n], stale[n]) for n in stale)

    engine.set_tensors(own)
    receive(engine, received, data, RoundSettings(batch_size=BATCH))
    want = _reference(engine, data, BATCH)  # the received base with this device's personal part
    got = engine.get_tensors(list(want))
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    for name, value in engine.get_tensors(engine.manifest.names("personal")).items():
        assert np.array_equal(value, own[name])
    for name, value in engine.get_tensors(list(received)).items():
        assert np.array_equal(value, received[name])


@pytest.mark.slow
def test_nothing_received_or_no_batchnorm_changes_nothing(bundle_factory) -> None:
    mlp = _open("portable", bundle_factory("mlp", 1, engines=("portable",)))
    data = _data(mlp.manifest)
    before = mlp.get_tensors()
    assert recompute_statistics(mlp, data, BATCH) == 0
    assert all(np.array_equal(v, before[n]) for n, v in mlp.get_tensors().items())
    cnn = _open("portable", bundle_factory("cnn", 1, engines=("ort-training", "portable"), norm="batch", width=0.25))
    _train_a_little(cnn, data := _data(cnn.manifest))
    before = cnn.get_tensors()
    receive(cnn, {}, data, RoundSettings(batch_size=BATCH))  # local training: nothing arrives, nothing re-estimated
    assert all(np.array_equal(v, before[n]) for n, v in cnn.get_tensors().items())


def test_fewer_samples_than_a_batch_are_one_batch(bundle_factory) -> None:
    engine = _open("torch", bundle_factory("cnn", 1, engines=("ort-training", "portable"), norm="batch", width=0.25))
    data = _data(engine.manifest, count=6)
    assert recompute_statistics(engine, data, BATCH) == data.num_train < BATCH
    one = _data(engine.manifest, count=2)  # one training sample: no variance to estimate, the statistics stay
    assert one.num_train == 1
    before = engine.get_tensors()
    assert recompute_statistics(engine, one, BATCH) == 0
    assert all(np.array_equal(v, before[n]) for n, v in engine.get_tensors().items())


@pytest.mark.slow
def test_layers_with_different_momenta_are_read_by_name(tmp_path) -> None:
    """A model whose BatchNorm layers use different momenta: the portable entry lists each statistic's."""
    from torch import nn

    from edgepfl.export.bundle import ExportOptions, export_bundle

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=0.1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=0.01), nn.ReLU()),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)),
    )
    export_bundle(model, 1, tmp_path / "b", ExportOptions(engines=("portable",), force=True), input_shape=(3, 8, 8))
    engine = open_engine(tmp_path / "b", "portable", threads=1)
    momenta = engine.statistics_momenta()
    assert momenta == {
        "0.1.running_mean": 0.1,
        "0.1.running_var": 0.1,
        "1.1.running_mean": 0.01,
        "1.1.running_var": 0.01,
    }
    data = _data(engine.manifest, count=20)
    engine_reference = _update_bn(model, engine.manifest.batchnorm_statistics(), data, BATCH)
    recompute_statistics(engine, data, BATCH)
    for name, value in engine_reference.items():
        np.testing.assert_allclose(engine.get_tensors([name])[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_recompute_bn_must_be_true_or_false() -> None:
    with pytest.raises(WireError, match="recompute_bn 'yes' is not true or false"):
        RoundSettings.from_json({"recompute_bn": "yes"})
    assert RoundSettings.from_json({}).recompute_bn is True
    assert RoundSettings.from_json({"recompute_bn": False}).recompute_bn is False


def test_serve_and_simulate_can_turn_it_off() -> None:
    import typer

    from edgepfl.cli import app

    for name in ("serve", "simulate"):
        command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
        assert any("--no-recompute-bn" in param.secondary_opts for param in command.params), name
