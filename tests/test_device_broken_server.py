"""A device's view of a broken server: it waits, never in silence, and rides out an outage with its update kept.

A server answering 500 forever, one serving a base with NaN, one that vanishes (connection refused) during an
upload and comes back, before or after the round's deadline. Time is virtual (the sleeps advance a clock), so
hours of waiting take milliseconds; one test runs the real `edgepfl device run` against a loopback server.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_device_e2e import device_command
from test_device_hostile import Recorder
from test_device_replies import loopback  # noqa: F401 (a fixture: the real HTTP server on loopback)
from test_device_runtime import DEVICE_BUNDLE, ScriptedServer, _open_device, save_npz
from typer.testing import CliRunner

from edgepfl.device_runtime.cli import device_app
from edgepfl.device_runtime.client import RetryPolicy, ServerClient
from edgepfl.device_runtime.options import DeviceOptions
from edgepfl.device_runtime.runner import run_device
from edgepfl.device_runtime.waiting import WAIT_FILE, WaitLog, read_wait

START = 1_800_000_000.0  # the virtual clock's start, unix seconds


@pytest.fixture(scope="module")
def mlp_bundle(bundle_factory) -> Path:
    return bundle_factory(**DEVICE_BUNDLE)


class Stop(Exception):
    """Ends a run that would wait forever."""


class VirtualTime:
    """A clock that only the sleeps move; after `stop_at` virtual seconds a sleep raises Stop."""

    def __init__(self, stop_at: float = float("inf")):
        self.now, self.stop_at = START, START + stop_at
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds
        if self.now >= self.stop_at:
            raise Stop


def _device(mlp_bundle, tmp_path, handle, time_: VirtualTime, events: Recorder | None = None, retries: int = 3):
    """The device's parts wired as `device run` wires them: one WaitLog fed by the loop and the client's retries."""
    engine, data, state, server = _open_device(mlp_bundle, tmp_path)
    events = events or Recorder(state)
    waits = WaitLog(state.folder, events.waiting, time_.clock)
    client = ServerClient(
        "http://device.test",
        "t",
        RetryPolicy(attempts=retries),
        transport=httpx.MockTransport(handle(server)),
        sleep=time_.sleep,
        on_retry=lambda failure: waits.waiting("the server", failure),
    )

    def run(**options):
        return run_device(
            engine,
            data,
            state,
            client,
            DeviceOptions(poll_interval=1.0, **options),
            events,
            sleep=time_.sleep,
            waits=waits,
            clock=time_.clock,
        )

    return state, server, events, run


def _status(state_folder: Path) -> dict:
    result = CliRunner().invoke(device_app, ["status", "--state", str(state_folder), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def test_a_server_answering_500_forever_is_said_once_then_at_growing_intervals(mlp_bundle, tmp_path):
    time_ = VirtualTime(stop_at=3 * 3600)

    def handle(server):
        def answer(request):
            server.calls.append((request.method, request.url.path))
            return httpx.Response(500, json={"detail": "database is locked"})

        return answer

    state, server, events, run = _device(mlp_bundle, tmp_path, handle, time_)
    with pytest.raises(Stop):
        run()
    polls = len(server.calls)
    said = [m for m in events.messages if "GET /v1/task answered HTTP 500 database is locked" in m]
    assert said[0] == "waiting for the server: GET /v1/task answered HTTP 500 database is locked"
    assert all(m.startswith("still waiting after ") and " for the server: GET" in m for m in said[1:])
    assert polls > 150 and 5 <= len(said) <= 9, (polls, said)  # 3 hours: at 0, 1, 3, 7, 15, 31, 63, 123 min
    assert not [m for m in events.messages if m not in said]
    assert max(time_.sleeps) <= 60.0  # the device keeps polling at least once a minute
    status = _status(state.folder)
    assert status["waiting_for"] == "the server" and "HTTP 500" in status["waiting_why"]
    assert state.state.last_completed_round is None


def test_a_base_with_nan_is_refused_once_and_the_wait_says_why(mlp_bundle, tmp_path):
    time_ = VirtualTime(stop_at=600)

    def handle(server):
        server.base = {name: np.full_like(value, np.nan) for name, value in server.base.items()}
        return server.handle  # round 1 stays open, its base poisoned

    state, server, events, run = _device(mlp_bundle, tmp_path, handle, time_)
    with pytest.raises(Stop):
        run()
    assert server.calls.count(("GET", "/v1/rounds/1/base")) == 1  # refused once, not fetched on every poll
    waits = [m for m in events.messages if "holds NaN or Inf" in m]
    assert len(waits) == 4, events.messages  # at 0, 1, 3 and 7 minutes of 10
    assert waits[3].startswith("still waiting after 7 min for the next round: the base of round 1 holds NaN")
    assert waits[0].startswith("waiting for the next round: the base of round 1 holds NaN or Inf in ")
    assert "kept the bundle's initial model and skipped the round" in waits[0] and "ask the operator" in waits[0]
    status = _status(state.folder)
    assert status["waiting_for"] == "the next round" and "holds NaN or Inf" in status["waiting_why"]
    assert status["last_completed_round"] is None


def _outage(time_: VirtualTime, until: float, deadline: float):
    """A server whose /update refuses connections for `until` virtual seconds; round 1 closes at `deadline`."""
    until, deadline = START + until, START + deadline

    def handle(server: ScriptedServer):
        def answer(request: httpx.Request) -> httpx.Response:
            path = request.url.path
            if server.round_id == 1 and time_.now >= deadline:
                server.round_id = 2  # round 1 closed at its deadline, with or without this device
            if path.endswith("/update") and time_.now < until:
                server.calls.append((request.method, path))
                raise httpx.ConnectError("connection refused", request=request)
            response = server.handle(request)
            if path == "/v1/task":
                body = json.loads(response.content)
                body["deadline"] = deadline if server.round_id == 1 else deadline + 3600
                return httpx.Response(200, json=body)
            return response

        return answer

    return handle


def test_an_update_is_kept_through_an_outage_and_delivered_when_the_server_comes_back(mlp_bundle, tmp_path):
    time_ = VirtualTime(stop_at=3600)  # a device that never gets on would stop here, not loop forever
    state, server, events, run = _device(mlp_bundle, tmp_path, _outage(time_, 90, 600), time_)
    summary = run()
    assert summary.finished and summary.rounds_trained == 2
    assert [round_id for round_id, _ in server.uploads] == [1, 2]  # round 1's update went out after 90 s
    attempts = server.calls.count(("POST", "/v1/rounds/1/update"))
    kept = [m for m in events.messages if "/v1/rounds/1/update" in m]
    assert attempts >= 4 and len(kept) <= 4, (attempts, events.messages)  # retried often, said sparsely
    assert kept[0].startswith("waiting for the server: POST /v1/rounds/1/update got no answer (ConnectError")
    assert any("the update is kept and sent again until its deadline" in m for m in kept)
    assert "round 1's update is delivered after the outage" in events.messages
    assert [(h.get("round"), h.get("upload")) for h in state.state.history if not h.get("final")] == [
        (1, "delivered"),
        (2, "delivered"),
    ]
    assert not (state.folder / WAIT_FILE).exists()  # the run ended: no wait left behind


def test_an_update_the_deadline_passed_is_dropped_and_the_device_goes_on(mlp_bundle, tmp_path):
    time_ = VirtualTime(stop_at=3600)
    state, server, events, run = _device(mlp_bundle, tmp_path, _outage(time_, 300, 120), time_)
    summary = run()
    assert summary.finished and summary.rounds_trained == 2
    assert [round_id for round_id, _ in server.uploads] == [2]  # round 1's update was dropped at its deadline
    dropped = [m for m in events.messages if "deadline passed before its update could be sent" in m]
    assert len(dropped) == 1 and "the update is dropped, the device rejoins the next round" in dropped[0]
    history = [(h.get("round"), h.get("upload")) for h in state.state.history if not h.get("final")]
    assert history == [(1, "dropped"), (2, "delivered")]
    assert server.calls.count(("POST", "/v1/rounds/1/update")) >= 4  # retried until the deadline, not given up early


def test_a_restarted_device_knows_its_pending_updates_deadline(mlp_bundle, tmp_path):
    time_ = VirtualTime(stop_at=60)
    state, server, events, run = _device(mlp_bundle, tmp_path, _outage(time_, 10_000, 100), time_)
    with pytest.raises(Stop):  # killed in the outage, its update pending
        run()
    pending = state.state.pending_upload
    assert pending is not None and pending.round_id == 1 and pending.deadline == START + 100
    status = _status(state.folder)
    assert status["pending_upload_round"] == 1 and status["pending_upload_deadline"] == START + 100
    assert status["waiting_for"] == "the server to take round 1's update"
    assert read_wait(state.folder) is not None


def test_device_run_against_a_server_answering_500_says_so_on_stderr_and_in_status(mlp_bundle, tmp_path, loopback):  # noqa: F811
    calls: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(500, json={"detail": "boom"})

    loopback.handle = answer  # type: ignore[attr-defined]
    data = save_npz(tmp_path / "d.npz", (0, 1), 40)
    state = tmp_path / "state"
    url = f"http://127.0.0.1:{loopback.server_address[1]}"
    process = subprocess.Popen(
        device_command(
            "device",
            "run",
            "--bundle",
            mlp_bundle,
            "--data",
            data,
            "--state",
            state,
            "--engine",
            "portable",
            "--server",
            url,
            "--token",
            "t",
            "--retries",
            "2",
            "--poll-interval",
            "0.05",
            "--json",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60  # a few seconds unloaded; the import alone takes longer on a busy machine
        while len(calls) < 10 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        assert len(calls) >= 10, (calls, process.poll())
        status = _status(state)
    finally:
        process.terminate()
        _, err = process.communicate(timeout=10)
    assert status["waiting_for"] == "the server" and status["waiting_why"] == "GET /v1/task answered HTTP 500 boom"
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["waiting for the server: GET /v1/task answered HTTP 500 boom"], err  # once, under --json too
