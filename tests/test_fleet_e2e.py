"""Issue 32 with real device processes against a real `edgepfl serve`: over-selection survives killed devices
without waiting for the deadline, and FedBuff's served run equals the in-process engine on the same event order,
through a kill -9 of the server between uploads, with the output layer or adapters personal."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from server_helpers import LiveServer, enroll, free_port
from test_device_e2e import device_command, finish, history, run_args
from test_device_runtime import DEVICE_BUNDLE, save_npz

from edgepfl.data import load_device_data
from edgepfl.device_runtime.engine import open_engine
from edgepfl.manifest import load_manifest
from edgepfl.server.config import ServerConfig
from edgepfl.server.driver import ManualClock
from edgepfl.server.engine import create_engine
from edgepfl.server.launch import LocalServer
from edgepfl.server.store import Store
from edgepfl.simulate.workers import ClientData, train_client
from edgepfl.wire import decode_tensors

pytestmark = pytest.mark.slow

# the device CLI, which stops in round 1 at its first training step until it is killed (a marker file says so)
STALLING_IN_ROUND_ONE = """
import pathlib, sys, time
sys.modules['torch'] = None
marker = pathlib.Path(sys.argv.pop(1))
import edgepfl.device_runtime.progress as progress

class Stalling(progress.RichEvents):
    def round_started(self, round_id, settings, total_steps):
        super().round_started(round_id, settings, total_steps)
        if round_id == 1:
            marker.write_text('training round 1')
            time.sleep(600)

progress.RichEvents = Stalling
sys.argv[0] = 'edgepfl'
from edgepfl.cli import app
app()
"""
TRAINING = ("--lr", "0.1", "--batch-size", "16", "--epochs", "1")
SETTINGS = ("--poll-interval", "0.2", *TRAINING)
DEVICE = ("--engine", "portable", "--seed", "5", "--retries", "10")  # retries: the server is restarted once


@pytest.fixture(scope="module")
def bundle(bundle_factory) -> Path:
    return bundle_factory(**{**DEVICE_BUNDLE, "engines": ("portable",)})


@pytest.fixture(scope="module", params=[1, "adapters:4"], ids=["output-layer", "adapters"])
def fedbuff_bundle(request, bundle_factory) -> Path:
    """The mlp with its output layer personal, or with adapters personal (the whole original network shared)."""
    return bundle_factory(**{**DEVICE_BUNDLE, "engines": ("portable",), "kp": request.param})


def stored(state: Path):
    store = Store(state)
    try:
        return store.rounds(), {r.round_id: store.updates(r.round_id, status=None) for r in store.rounds()}
    finally:
        store.close()


@pytest.mark.slow
def test_over_selection_closes_at_its_target_when_two_of_six_devices_are_killed(bundle, tmp_path):
    names = [f"d{i}" for i in range(6)]
    tokens = enroll(tmp_path / "server", *names)
    # target max(2, ceil(0.6 x 6)) = 4 of 6; with --over-select 0.5 all 6 are sampled (ceil(4 x 1.5))
    options = ("--min-clients", "2", "--fraction", "0.6", "--over-select", "0.5", "--rounds", "2")
    # the killed devices stay available (last seen at round 1's start) until round 2 opens, however long round 1
    # takes on a loaded machine: round 2 then samples all six, whichever of them polls first
    options += ("--available-for", "600")
    # round 1 opens once all six have polled, or one poll interval after the first two did: 0.2 s let a round
    # open with five on a loaded CI machine (one device process had not polled yet); 10 s gives every process time
    # to start, and costs a device that polls before a round is ready at most 10 s
    settings = ("--poll-interval", "10", *TRAINING)
    server = LiveServer(bundle, tmp_path / "server", *options, "--round-timeout", "600", *settings).start()
    try:
        data = {n: save_npz(tmp_path / f"{n}.npz", (i % 4, (i + 1) % 4), 64, seed=i) for i, n in enumerate(names)}
        markers = {name: tmp_path / f"{name}.stalled" for name in names[:2]}
        killed = {
            name: subprocess.Popen(
                device_command(
                    markers[name],
                    *run_args(bundle, data[name], server, tokens[name], tmp_path / name),
                    code=STALLING_IN_ROUND_ONE,
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            for name in names[:2]
        }
        others = {
            name: subprocess.Popen(
                device_command(*run_args(bundle, data[name], server, tokens[name], tmp_path / name, "--rounds", "1")),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            for name in names[2:]
        }
        # a liveness bound, not a speed one: six device processes start on a loaded 2-core CI machine (120 s was
        # missed by 0.06 s in one run here)
        deadline = time.monotonic() + 300
        while not all(marker.exists() for marker in markers.values()):
            assert time.monotonic() < deadline, "the stalling devices never started round 1"
            time.sleep(0.1)
        for process in killed.values():
            process.kill()  # kill -9 mid-round: training, nothing saved
            process.wait()
        results = {name: finish(process, timeout=120) for name, process in others.items()}
        rounds, updates = stored(tmp_path / "server")
        one = rounds[0]
        assert one.state == "closed" and len(one.sampled) == 6 and one.target == 4
        assert one.closed - one.opened < 120, "the round closed at its target, not at its 600 s deadline"
        assert sorted(u.device for u in updates[1]) == sorted(names[2:])
        assert all(result["rounds_trained"] == 1 for result in results.values())

        # the killed devices come back: they join round 2 and upload once. They come back first, and the others
        # only once both have trained it: round 2 closes at its 4th upload, and on a loaded machine the others'
        # four could otherwise close it before a slow-starting killed device has even asked for its task
        def come_back(group: list[str]) -> dict[str, subprocess.Popen]:
            return {
                name: subprocess.Popen(
                    device_command(*run_args(bundle, data[name], server, tokens[name], tmp_path / name)),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=REPO,
                )
                for name in group
            }

        back = come_back(names[:2])
        deadline = time.monotonic() + 300
        trained = [tmp_path / name / "state.json" for name in names[:2]]  # written at a round's commit
        while not all(path.exists() and any(h["round"] == 2 for h in history(path.parent)) for path in trained):
            assert time.monotonic() < deadline, "the killed devices did not train round 2 when they came back"
            time.sleep(0.1)
        back.update(come_back(names[2:]))
        for process in back.values():
            finish(process, timeout=180)
    finally:
        server.stop()
    rounds, updates = stored(tmp_path / "server")
    assert [r.state for r in rounds] == ["closed", "closed"]
    for by_round in updates.values():  # one upload per device and round, never a second one
        devices = [u.device for u in by_round]
        assert len(devices) == len(set(devices))
    assert not {"d0", "d1"} & {u.device for u in updates[1]}
    for name in ("d0", "d1"):  # they trained round 2 (its upload accepted, or dropped if the round had closed)
        assert [h["round"] for h in history(tmp_path / name) if not h.get("final")] == [2]


@pytest.mark.slow
def test_fedbuff_served_run_equals_the_engine_in_process_through_a_server_kill(fedbuff_bundle, tmp_path):
    bundle = fedbuff_bundle
    names = ["slow", "mid", "fast"]
    tokens = enroll(tmp_path / "server", *names)
    sizes = {"slow": 2400, "mid": 160, "fast": 48}  # more samples: a slower device (its uploads arrive stale)
    data = {name: save_npz(tmp_path / f"{name}.npz", (i, i + 1), sizes[name], seed=i) for i, name in enumerate(names)}
    fleet = ("--aggregation", "fedbuff", "--buffer-size", "2", "--max-staleness", "8", "--server-lr", "0.8")
    options = (*fleet, "--rounds", "4", "--min-clients", "1", *SETTINGS, "--seed", "3")
    log = tmp_path / "server.log"  # one port for both starts: the devices keep their --server
    server = LocalServer(bundle, tmp_path / "server", *options, log=log, port=free_port()).start()
    processes = {
        name: subprocess.Popen(
            device_command(*run_args(bundle, data[name], server, tokens[name], tmp_path / name, *DEVICE)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for name in names
    }
    try:
        deadline = time.monotonic() + 120
        while True:  # kill -9 the server between uploads: after its first step
            rounds, updates = stored(tmp_path / "server")
            if any(r.state == "closed" for r in rounds):
                break
            assert time.monotonic() < deadline, "no fedbuff step within 120 s"
            time.sleep(0.05)
        server.kill()
        server.start()  # the same --state: the buffer and the versions are where the kill left them
        for process in processes.values():
            finish(process, timeout=240)
    finally:
        server.stop()
    rounds, updates = stored(tmp_path / "server")
    closed = [r for r in rounds if r.state == "closed"]
    assert len(closed) == 4
    accepted = sorted((u for by_round in updates.values() for u in by_round), key=lambda u: (u.received, u.device))
    keys = [(u.round_id, u.device) for u in accepted]
    assert len(keys) == len(set(keys)), "nothing accepted twice"
    applied = [u for u in accepted if u.applied_in is not None]
    for step in range(1, 5):  # each step applied a full buffer; an upload never applied before its version
        assert len([u for u in applied if u.applied_in == step]) >= 2
    assert all(u.applied_in - u.round_id == u.staleness <= 8 for u in applied)

    store = Store(tmp_path / "server")
    base = set(load_manifest(bundle).names("base"))  # only the base left the devices, whatever is personal
    assert all(set(decode_tensors(store.blobs.read(u.blob_sha))) == base for u in accepted)
    replayed = replay(bundle, tmp_path, accepted, data, options_for(bundle, tmp_path))
    served = decode_tensors(store.blobs.read(closed[-1].result_sha))
    assert sorted(replayed) == sorted(served)
    for name, value in served.items():
        np.testing.assert_array_equal(replayed[name], value, err_msg=name)


def options_for(bundle: Path, tmp_path: Path) -> ServerConfig:
    """The served run's configuration, for an engine over a new state folder."""
    return ServerConfig(
        bundle=bundle,
        state=tmp_path / "replayed",
        rounds=4,
        min_clients=1,
        seed=3,
        poll_interval=0.2,
        web=False,
        round={"lr": 0.1, "batch_size": 16, "epochs": 1},
        fleet_rounds={"aggregation": "fedbuff", "buffer_size": 2, "max_staleness": 8, "server_lr": 0.8},
    )


def replay(bundle: Path, tmp_path: Path, accepted, data: dict[str, Path], config: ServerConfig) -> dict:
    """The served run's events on an in-process engine: each device trains (the simulator's client round) on the
    base version it trained on once that version is open and its previous upload is in, its upload arrives in the
    served order, and a step closes where the served one did (after the last upload it applied)."""
    engine = open_engine(bundle, "portable")
    manifest = engine.manifest
    initial = engine.get_tensors()
    server = create_engine(config, ManualClock())
    server.enroll_devices(sorted(data))
    clients = {}
    for name, path in data.items():
        local = load_device_data(path, manifest, 0.2, 5)
        clients[name] = ClientData(name, local, local, 5, tmp_path / "residuals" / name)  # its test split: unused
    tensors = {name: dict(initial) for name in data}
    plans_of = {name: [u.round_id for u in accepted if u.device == name] for name in data}
    outcomes = {}

    def start_trainings() -> None:
        version = server.next_round_id()
        for name, versions in plans_of.items():
            if versions and versions[0] == version and name not in outcomes:
                polled = server.poll(name)
                assert polled is not None and polled[0] == version
                outcome = train_client(engine, manifest, clients[name], tensors[name], polled[1], version, None)
                tensors[name] = outcome.tensors
                outcomes[name] = outcome

    for index, update in enumerate(accepted):
        start_trainings()
        outcome = outcomes.pop(update.device)
        assert plans_of[update.device].pop(0) == update.round_id
        server.accept_update(update.device, update.round_id, outcome.payload)
        # a device polls again as soon as its upload is in: before the step closes, when its next version is the
        # one still open (the served step may close after that poll, however soon the buffer filled)
        start_trainings()
        following = accepted[index + 1].applied_in if index + 1 < len(accepted) else None
        if update.applied_in is not None and following != update.applied_in:
            server.tick()  # the served step applied every upload buffered when it closed: 2 or more
    base = server.global_base()
    server.close()
    return base
