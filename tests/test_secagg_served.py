"""Secure rounds over HTTP (issue 34): Python devices (the device runtime's own loop, in threads) mask their updates
through a real `edgepfl serve` on loopback (the output layer or adapters personal); the server and a device killed
mid-protocol resume."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_helpers import LocalServer, enroll
from test_device_runtime import DEVICE_BUNDLE, local_data, mlp_bundle  # noqa: F401 - the fixture

from edgepfl.device_runtime import secure_round
from edgepfl.device_runtime.client import RetryPolicy, ServerClient
from edgepfl.device_runtime.engine import open_engine
from edgepfl.device_runtime.options import DeviceOptions
from edgepfl.device_runtime.runner import RunSummary, run_device
from edgepfl.device_runtime.state import StateFolder
from edgepfl.encoding import Encoding, decode_payload
from edgepfl.manifest import load_manifest
from edgepfl.privacy import clip_delta
from edgepfl.protocol import UploadMeta
from edgepfl.secagg.config import levels, padded_size
from edgepfl.server.launch import free_port
from edgepfl.server.store import Store
from edgepfl.wire import decode_metadata, decode_tensors

NAMES = ("a", "b", "c")
CLIP, MAX_WEIGHT = 1.0, 100
OPTIONS = (
    "--min-clients",
    "3",
    "--rounds",
    "2",
    "--round-timeout",
    "60",
    "--poll-interval",
    "0.2",
    "--no-web",
    "--secure-aggregation",
    "--secagg-clip",
    str(CLIP),
    "--secagg-max-weight",
    str(MAX_WEIGHT),
    "--secagg-step-timeout",
    "20",
    "--lr",
    "0.1",
    "--batch-size",
    "16",
)


class Recorded:
    """What each device quantized, per round: its clipped delta and weight (read from its pending upload)."""

    def __init__(self) -> None:
        self.items: dict[int, dict[str, tuple[dict[str, np.ndarray], int]]] = {}
        self.plans: dict[int, tuple[int, int, int]] = {}  # round -> (devices, bits, base size)
        self._lock = threading.Lock()
        self._ring_vector = secure_round.ring_vector

    def __call__(self, payload: bytes, book, seed: int, round_id: int) -> np.ndarray:
        delta = decode_payload(payload, Encoding.parse("fp32"))
        weight = UploadMeta.from_metadata(decode_metadata(payload)).num_samples
        device = threading.current_thread().name.removeprefix("device-")
        with self._lock:
            self.items.setdefault(round_id, {})[device] = (delta, weight)
            self.plans[round_id] = (book.plan.devices, book.plan.bits, book.base_size)
        return self._ring_vector(payload, book, seed, round_id)


def start_devices(
    bundle: Path,
    server: LocalServer,
    tokens: dict[str, str],
    folder: Path,
    names=NAMES,
    crash: Callable[[str, httpx.Request], None] | None = None,
) -> dict[str, threading.Thread]:
    """Each device's loop (it resumes from its state folder) in a thread named after it; what it returned, or the
    exception that ended it, in OUTCOMES."""
    threads = {}
    for name in names:

        def device(name: str = name) -> None:
            engine = open_engine(bundle, "portable")
            state = StateFolder(folder / name, engine.manifest, engine.name)
            transport = httpx.HTTPTransport() if crash is None else Crashing(name, crash)
            client = ServerClient(
                server.url, tokens[name], RetryPolicy(attempts=40, first_delay=0.1, max_delay=0.5), transport=transport
            )
            index = NAMES.index(name)
            try:
                data = local_data(engine.manifest, count=96, seed=index)
                OUTCOMES[name] = run_device(engine, data, state, client, DeviceOptions(seed=index, poll_interval=0.1))
            except BaseException as error:  # noqa: BLE001 - the test reads it
                OUTCOMES[name] = error
            finally:
                client.close()
                state.close()

        threads[name] = threading.Thread(target=device, name=f"device-{name}", daemon=True)
        threads[name].start()
    return threads


OUTCOMES: dict[str, RunSummary | BaseException] = {}


class Crashing(httpx.HTTPTransport):
    """A device's transport that `crash(name, request)` may make fail once, as a device killed there would."""

    def __init__(self, name: str, crash: Callable[[str, httpx.Request], None]):
        super().__init__()
        self.name, self.crash = name, crash

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.crash(self.name, request)
        return response


def join(threads: dict[str, threading.Thread], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for thread in threads.values():
        thread.join(max(0.0, deadline - time.monotonic()))
        assert not thread.is_alive(), "a device never finished"


def check_rounds(url: str, token: str, recorded: Recorded) -> dict:
    """Each closed round's global base moved by the weighted mean of what the devices quantized (within what the
    rounding may add), and its status says 3 devices were masked."""
    status = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}).json()
    assert status["secure_aggregation"]["clip_norm"] == CLIP
    previous = None
    for row in status["rounds"]:
        assert row["state"] == "closed" and row["uploads"] == 0
        assert {key: row["secure_aggregation"][key] for key in ("phase", "masked", "dropped", "recovered")} == {
            "phase": "done",
            "masked": 3,
            "dropped": 0,
            "recovered": 0,
        }
        result = httpx.get(f"{url}/v1/rounds/{row['round']}/result", headers={"Authorization": f"Bearer {token}"})
        base = decode_tensors(result.content)
        if previous is not None:
            items = recorded.items[row["round"]]
            weights = {device: min(weight, MAX_WEIGHT) for device, (_, weight) in items.items()}
            total = sum(weights.values())
            expected = {
                name: sum(
                    weights[d] * clip_delta(delta, CLIP)[name].astype(np.float64) for d, (delta, _) in items.items()
                )
                / total
                for name in base
            }
            devices, bits, size = recorded.plans[row["round"]]
            step = 4 * CLIP / math.sqrt(padded_size(size)) / levels(devices, bits)
            bound = devices * step * math.sqrt(padded_size(size)) * MAX_WEIGHT / total
            error = math.sqrt(sum(float(np.sum((base[n] - previous[n] - expected[n]) ** 2)) for n in base))
            moved = math.sqrt(sum(float(np.sum(expected[n] ** 2)) for n in base))
            assert error <= bound and moved > 0, (error, bound, moved)
        previous = base
    return status


@pytest.fixture
def recorded(monkeypatch) -> Recorded:
    OUTCOMES.clear()
    recorder = Recorded()
    monkeypatch.setattr(secure_round, "ring_vector", recorder)
    return recorder


@pytest.fixture(params=[1, "adapters:4"], ids=["output-layer", "adapters"])
def personal_bundle(request, bundle_factory) -> Path:
    """The device mlp with its output layer personal, or with adapters personal (the whole original network summed)."""
    return bundle_factory(**{**DEVICE_BUNDLE, "kp": request.param})


@pytest.mark.slow
def test_three_python_devices_aggregate_two_rounds_securely(personal_bundle, tmp_path, recorded):
    tokens = enroll(tmp_path / "server", *NAMES)
    server = LocalServer(personal_bundle, tmp_path / "server", *OPTIONS, log=tmp_path / "server.log")
    with server:
        join(start_devices(personal_bundle, server, tokens, tmp_path))
        for name in NAMES:
            assert isinstance(OUTCOMES[name], RunSummary) and OUTCOMES[name].finished, OUTCOMES[name]
        check_rounds(server.url, tokens["a"], recorded)
    base = set(load_manifest(personal_bundle).names("base"))  # what was masked: the base, whatever is personal
    assert all(set(delta) == base for items in recorded.items.values() for delta, _ in items.values())
    for name in NAMES:  # no secure session is left on a device; its rounds were delivered
        assert not list((tmp_path / name).glob("secagg-r*.json"))
    store = Store(tmp_path / "server")
    try:  # the server stored no update, and nothing of the protocol but each round's counts
        assert store.updates(1) == [] and store.updates(2) == []
        assert store.read("SELECT COUNT(*) FROM secure_messages")[0][0] == 0
        assert store.read("SELECT COUNT(*) FROM secure_rounds WHERE snapshot IS NOT NULL")[0][0] <= 1
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize("after", ["advert", "shares", "masked", "reveal"])
def test_a_device_killed_after_each_step_resumes_and_is_counted_once(mlp_bundle, tmp_path, recorded, after):  # noqa: F811
    """Device b dies right after its `after` message of round 1 was accepted, then starts again from its folder."""
    tokens = enroll(tmp_path / "server", *NAMES)
    crashed = []

    def crash(name: str, request: httpx.Request) -> None:
        if name == "b" and not crashed and request.url.path == f"/v1/rounds/1/secagg/{after}":
            crashed.append(name)
            raise KeyboardInterrupt("killed")  # leaves the device loop as a kill would: nothing after it runs

    server = LocalServer(mlp_bundle, tmp_path / "server", *OPTIONS, log=tmp_path / "server.log")
    with server:
        threads = start_devices(mlp_bundle, server, tokens, tmp_path, crash=crash)
        threads["b"].join(60)
        assert isinstance(OUTCOMES["b"], KeyboardInterrupt) and (tmp_path / "b" / "secagg-r000001.json").is_file()
        restarted = start_devices(mlp_bundle, server, tokens, tmp_path, names=("b",))
        join({**threads, **restarted})
        for name in NAMES:
            assert isinstance(OUTCOMES[name], RunSummary) and OUTCOMES[name].finished, OUTCOMES[name]
        check_rounds(server.url, tokens["a"], recorded)


@pytest.mark.slow
def test_the_server_killed_mid_protocol_resumes_from_its_snapshot_and_log(mlp_bundle, tmp_path, recorded):  # noqa: F811
    tokens = enroll(tmp_path / "server", *NAMES)
    server = LocalServer(mlp_bundle, tmp_path / "server", *OPTIONS, log=tmp_path / "server.log", port=free_port())
    masked: list[str] = []

    def watch(name: str, request: httpx.Request) -> None:
        if request.url.path == "/v1/rounds/1/secagg/masked":
            masked.append(name)

    with server:
        threads = start_devices(mlp_bundle, server, tokens, tmp_path, crash=watch)
        deadline = time.monotonic() + 60
        while len(masked) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.kill()  # kill -9 with masked uploads logged since the inputs step's snapshot
        server.start()
        join(threads)
        for name in NAMES:
            assert isinstance(OUTCOMES[name], RunSummary) and OUTCOMES[name].finished, OUTCOMES[name]
        check_rounds(server.url, tokens["a"], recorded)
