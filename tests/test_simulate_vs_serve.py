"""`edgepfl simulate` and a real `edgepfl serve` with `edgepfl device run` processes give bit-identical global tensors.

One seeded experiment, run twice on the portable engine: once by `run_simulation`, once by a served run
whose devices are real processes (torch blocked), each holding its simulated client's training samples
as an .npz (no held-out split, so its training data is exactly the client's) and its client's seed.
Both runs go through the one round engine, so every round samples, plans and aggregates alike.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")  # the simulation exports its bundle with torch

from conftest import REPO  # noqa: E402
from server_helpers import LiveServer, enroll  # noqa: E402
from test_device_e2e import device_command, finish, run_args  # noqa: E402
from test_simulate import tiny_config, tiny_npz  # noqa: E402, F401 (tiny_npz: the simulator tests' data fixture)

from edgepfl.server.store import Store  # noqa: E402
from edgepfl.simulate.rounds import SERVER_DIR  # noqa: E402

CLIENTS = 4


def client_files(config, folder: Path) -> list[tuple[Path, int]]:
    """Each simulated client's training samples as an .npz, and the seed its device must use."""
    from edgepfl.datasets.images import load_dataset
    from edgepfl.datasets.partition import make_partition

    data = config.data
    dataset = load_dataset(data.dataset, data.data_root)
    parts = make_partition(data.partition, dataset.y_train, dataset.y_test, CLIENTS, config.seed, data.split)
    files = []
    for number, part in enumerate(parts):
        path = folder / f"client-{number:03d}.npz"
        np.savez(path, x=dataset.images(part.train), y=dataset.targets(part.train))
        files.append((path, int(np.random.SeedSequence([config.seed, number]).generate_state(1)[0])))
    return files


def rounds_of(state: Path) -> list[tuple]:
    """Per round: its state, sampled devices, the base blob each was sent and the aggregated result's sha256."""
    store = Store(state)
    try:
        rounds = store.rounds()
        sent = [[store.assignment(r.round_id, device).base_sha for device in r.sampled] for r in rounds]
        return [(r.round_id, r.state, r.sampled, bases, r.result_sha) for r, bases in zip(rounds, sent)]
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "fraction", "encoding"),
    [("pfedla", 0.5, "fp32"), ("fedper", 1.0, "fp32"), ("fedper", 1.0, "int8-block64-sr")],
)
def test_simulate_and_serve_give_bit_identical_global_tensors(tiny_npz, tmp_path, algorithm, fraction, encoding):  # noqa: F811
    """With an upload encoding too: the devices' encoded deltas (error feedback, stochastic rounding) are the
    simulated clients' bytes, and the served acceptance path decodes them alike."""
    from edgepfl.simulate.loop import run_simulation

    out = tmp_path / "sim"
    config = tiny_config(tiny_npz, out, algorithm=algorithm, engine="portable", clients=CLIENTS).updated(
        fraction=fraction,
        min_clients=2,
        seed=1,  # samples clients 0 and 3, then 0 and 1: client 1 first joins pFedLA in round 2
        upload_encoding=encoding,
    )
    run_simulation(config)
    simulated = rounds_of(out / SERVER_DIR)
    assert [r[1] for r in simulated] == ["closed", "closed"]
    if fraction < 1:
        assert len(simulated[0][2]) == 2 and simulated[0][2] != simulated[1][2], "the rounds sample differently"

    bundle = out / "bundle"
    names = [f"client-{number:03d}" for number in range(CLIENTS)]
    tokens = enroll(tmp_path / "served", *names)
    options = ["--strategy", config.plan.strategy, "--rounds", str(config.rounds), "--fraction", str(fraction)]
    options += ["--min-clients", "2", "--seed", str(config.seed), "--epochs", str(config.round.epochs)]
    options += ["--upload-encoding", encoding]
    options += ["--batch-size", str(config.round.batch_size), "--lr", str(config.round.lr), "--round-timeout", "300"]
    # round 1 opens once all four have polled, or a poll interval after two did: long enough for a loaded machine
    options += ["--poll-interval", "20"]
    if config.plan.strategy == "pfedla":  # its own options (another strategy refuses them)
        options += ["--pfedla-clients", str(CLIENTS), "--hn-lr", str(config.strategy_knobs.hn_lr)]
    server = LiveServer(bundle, tmp_path / "served", *options).start(timeout=120)
    try:
        processes = []
        for name, (data, seed) in zip(names, client_files(config, tmp_path)):
            extra = ("--engine", "portable", "--val-fraction", "0", "--seed", str(seed), "--threads", "1")
            args = run_args(bundle, data, server, tokens[name], tmp_path / name, *extra)
            pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
            processes.append(subprocess.Popen(device_command(*args), text=True, cwd=REPO, **pipes))
        results = [finish(process, timeout=400) for process in processes]
    finally:
        server.stop()
    assert all(result["finished"] for result in results), results
    assert rounds_of(tmp_path / "served") == simulated
