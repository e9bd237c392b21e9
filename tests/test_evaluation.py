"""Issue 18: one evaluation protocol: every method's reported accuracies are `evaluation.score` of the right model."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from test_simulate import tiny_config, tiny_npz  # noqa: E402, F401 (tiny_npz: the simulator tests' data fixture)

from edgepfl.device_runtime.evaluation import PROTOCOL, score  # noqa: E402
from edgepfl.simulate.loop import STATE_FILE, run_simulation  # noqa: E402
from edgepfl.wire import decode_tensors  # noqa: E402


def _clients_and_engine(results, out):
    """The run's clients (data and names) rebuilt from its config, and a torch engine on its bundle."""
    from edgepfl.datasets.images import load_dataset
    from edgepfl.datasets.partition import make_partition
    from edgepfl.manifest import load_manifest
    from edgepfl.simulate.bundle import open_sim_engine
    from edgepfl.simulate.loop import RESIDUALS_DIR, _make_client

    config = results.config
    dataset = load_dataset(config.data.dataset, config.data.data_root)
    data = config.data
    parts = make_partition(data.partition, dataset.y_train, dataset.y_test, data.clients, config.seed, data.split)
    manifest = load_manifest(out / "bundle")
    engine = open_sim_engine("torch", out / "bundle", manifest, 1)
    initial = engine.get_tensors()
    residuals = out / RESIDUALS_DIR
    clients = [
        _make_client(i, part, dataset, manifest, config.seed, initial, residuals) for i, part in enumerate(parts)
    ]
    return clients, engine


def _received(results, out, names):
    """What each client receives after the last round, read from the run's server state by a fresh engine over it."""
    from edgepfl.simulate.rounds import open_server

    config = results.config
    server = open_server(out, names, {}, config.server_options(), fresh=False)
    try:
        glob = server.global_base()
        return {name: dict(server.evaluation_base(name, glob)) for name in names}
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "kp", "model"),
    [
        ("fedavg", 0, "mlp"),
        ("fedper", 1, "mlp"),
        ("fedalt", 1, "mlp"),
        ("local", 1, "mlp"),
        ("pfedla", 0, "mlp"),
        ("pfedla", 1, "mlp"),
        ("heurpfedla", 0, "mlp"),
        ("fedper", 1, "cnn"),  # BatchNorm: the held model's statistics are re-estimated under the received base
        ("pfedla", 1, "cnn"),
    ],
)
def test_every_methods_reported_accuracies_are_the_protocols(tiny_npz, tmp_path, algorithm, kp, model) -> None:  # noqa: F811
    """held = own tensors after the round + the shared part received after it (BatchNorm statistics re-estimated on
    the client's training data); trained = own tensors as trained."""
    from edgepfl.simulate.loop import round_settings

    out = tmp_path / algorithm
    fields = {"model": model, "norm": "batch", "width": 0.25} if model == "cnn" else {"model": model}
    results = run_simulation(tiny_config(tiny_npz, out, algorithm=algorithm, kp=kp, rounds=2, **fields))
    settings = round_settings(results.config)
    assert settings.recompute_bn
    document = json.loads((out / "results.json").read_text())
    assert document["info"]["evaluation"] == PROTOCOL
    clients, engine = _clients_and_engine(results, out)
    state = decode_tensors((out / STATE_FILE).read_bytes())
    names = [client.name for client in clients]
    received = _received(results, out, names)
    last = results.rounds[-1]
    for number, client in enumerate(clients):
        own = {k.removeprefix(f"{client.name}/"): v for k, v in state.items() if k.startswith(f"{client.name}/")}
        held = score(engine, client.test, own, received[client.name], client.train, settings).accuracy
        trained = score(engine, client.test, own).accuracy  # the saved tensors are those local training left
        assert last.test_accuracy["per_client"][number] == pytest.approx(held, abs=1e-6)
        assert last.trained_test_accuracy["per_client"][number] == pytest.approx(trained, abs=1e-6)
    if algorithm == "local":  # nothing is received: the held model is the trained one
        assert last.test_accuracy["per_client"] == last.trained_test_accuracy["per_client"]


@pytest.mark.slow
def test_unsampled_clients_have_no_trained_score(tiny_npz, tmp_path) -> None:  # noqa: F811
    results = run_simulation(tiny_config(tiny_npz, tmp_path / "run", algorithm="fedper", fraction=0.5, rounds=1))
    record = results.rounds[-1]
    trained = record.trained_test_accuracy["per_client"]
    assert sum(value is not None for value in trained) == record.sampled == 2
    assert all(value is not None for value in record.test_accuracy["per_client"])  # every client holds a model
    assert np.isclose(record.trained_test_accuracy["mean"], np.mean([v for v in trained if v is not None]))
