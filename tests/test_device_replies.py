"""The device against replies that are not what the protocol says: bad settings and tasks, HTML pages, foreign URLs.

Each ends in one line naming the problem and the fix, with the state folder as it was; the device token never
leaves the configured server.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_device_hostile import Recorder, _folder_bytes
from test_device_runtime import (
    DEVICE_BUNDLE,
    ScriptedServer,
    _open_device,
    save_npz,
)
from typer.testing import CliRunner

from edgepfl.device_runtime.cli import device_app
from edgepfl.device_runtime.client import RetryPolicy, ServerClient, ServerError
from edgepfl.device_runtime.engine import open_engine
from edgepfl.device_runtime.options import DeviceOptions
from edgepfl.device_runtime.runner import run_device
from edgepfl.device_runtime.state import StateFolder
from edgepfl.errors import WireError
from edgepfl.protocol import RoundSettings, Task
from edgepfl.wire import encode_tensors

HTML = "<html><body>Welcome to the free Wi-Fi. Please log in.</body></html>"


@pytest.fixture(scope="module")
def mlp_bundle(bundle_factory) -> Path:
    return bundle_factory(**DEVICE_BUNDLE)


# round settings and tasks: one parser (edgepfl.protocol) with types and bounds


@pytest.mark.parametrize(
    "field, value, problem",
    [
        ("batch_size", 0, "batch_size 0 is not an integer in 1..1048576"),
        ("batch_size", 2.5, "batch_size 2.5 is not an integer"),
        ("epochs", "abc", "epochs 'abc' is not an integer in 0..1000"),
        ("epochs", True, "epochs True is not an integer"),
        ("epochs", 10**6, "epochs 1000000 is not an integer in 0..1000"),
        ("finetune_epochs", -1, "finetune_epochs -1 is not an integer"),
        ("lr", "x", "lr 'x' is not a positive number"),
        ("lr", 0, "lr 0.0 is not a positive number"),
        ("lr", math.nan, "lr nan is not a positive number"),
        ("algorithm", "fedprox", "algorithm 'fedprox' is not one of fedsim, fedalt, local"),
        ("share_buffers", "yes", "share_buffers 'yes' is not true or false"),
        ("extra", [1], "extra [1] is not an object"),
        ("kept_on_device", "hidden.weight", "kept_on_device 'hidden.weight' is not a list of tensor names"),
        ("kept_on_device", [1], "kept_on_device (1,) is not a list of tensor names"),
        ("upload_encoding", "int4", "upload_encoding 'int4' is not fp32, fp16, int8"),
        ("upload_encoding", 8, "upload_encoding 8 is not fp32, fp16, int8"),
        ("download_encoding", "int8", "download_encoding 'int8' is not one of fp32, fp16"),
        ("clip_norm", -1, "clip_norm -1.0 is not a positive number"),
        ("clip_norm", "x", "clip_norm 'x' is not a positive number"),
    ],
)
def test_round_settings_are_checked_for_type_and_range(field, value, problem):
    with pytest.raises(WireError) as caught:
        RoundSettings.from_json({**RoundSettings().to_json(), field: value})
    assert caught.value.problem.startswith(f"the server's round settings are invalid: {problem}")
    assert "ask the operator" in caught.value.fix


def test_settings_a_server_sends_parse_back_unchanged():
    settings = RoundSettings(
        algorithm="fedalt",
        epochs=3,
        batch_size=8,
        lr=0.05,
        finetune_epochs=1,
        personal_epochs=2,
        share_buffers=True,
        extra={"pfedla": {"slot": 2}},
        kept_on_device=("hidden.weight",),
        upload_encoding="int8-block256-sr",
        download_encoding="fp16",
        clip_norm=1.5,
    )
    assert RoundSettings.from_json(json.loads(json.dumps(settings.to_json()))) == settings
    assert RoundSettings.from_json({"lr": 1}).lr == 1.0 and RoundSettings.from_json({}) == RoundSettings()
    assert RoundSettings().problem() is None


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"retry_after": -5}, "retry_after -5 is not a number of seconds >= 0"),
        ({"retry_after": math.nan}, "retry_after nan is not a number of seconds >= 0"),
        ({"retry_after": "soon"}, "retry_after 'soon' is not a number of seconds >= 0"),
        ({"deadline": math.inf}, "deadline inf is not a number of seconds >= 0"),
        ({"round": "one"}, "round 'one' is not a round number"),
        ({"base_url": {"x": 1}}, "base_url {'x': 1} is not a URL"),
        ({"action": "dance"}, "unknown action 'dance'"),
    ],
)
def test_a_malformed_task_names_its_field(change, problem):
    with pytest.raises(WireError) as caught:
        Task.from_json({**Task("wait", "h", round_id=1, retry_after=1.0).to_json(), **change})
    assert problem in caught.value.problem and "\n" not in str(caught.value)


def test_a_task_that_is_not_an_object_or_lacks_a_field_is_one_line():
    with pytest.raises(WireError, match="the server's task is list, not a JSON object"):
        Task.from_json([1, 2])
    with pytest.raises(WireError, match="the server's task is malformed \\(no 'base_layout_hash'\\)"):
        Task.from_json({"action": "wait"})


@pytest.mark.parametrize("header", ["-3", "nan", "inf", "soon"])
def test_a_bad_retry_after_header_falls_back_to_backoff(header):
    sleeps: list[float] = []
    answers = iter(
        [httpx.Response(503, headers={"Retry-After": header}), httpx.Response(200, json=Task("wait", "h").to_json())]
    )
    client = ServerClient(
        "http://device.test",
        "t",
        RetryPolicy(first_delay=0.5),
        transport=httpx.MockTransport(lambda r: next(answers)),
        sleep=sleeps.append,
    )
    assert client.task().action == "wait"
    assert len(sleeps) == 1 and 0.25 <= sleeps[0] <= 0.5


def test_a_too_slow_upload_cut_off_by_the_server_is_retried():
    """The server answers 408 too_slow to a sender under --min-upload-rate: a bad link may do better next time."""
    sleeps: list[float] = []
    too_slow = {"error": "too_slow", "detail": "the body arrived too slowly", "fix": "retry on a better link"}
    answers = iter([httpx.Response(408, json=too_slow), httpx.Response(200, json=Task("wait", "h").to_json())])
    client = ServerClient(
        "http://device.test",
        "t",
        RetryPolicy(first_delay=0.5),
        transport=httpx.MockTransport(lambda r: next(answers)),
        sleep=sleeps.append,
    )
    assert client.task().action == "wait"
    assert len(sleeps) == 1


# replies that are not the server's: a captive portal's HTML page


@pytest.mark.slow
def test_an_html_reply_to_the_upload_keeps_the_round_pending(mlp_bundle, tmp_path):
    engine, data, state, server = _open_device(mlp_bundle, tmp_path, server_rounds=1)
    server.faults["/v1/rounds/1/update"] = [httpx.Response(200, text=HTML, headers={"content-type": "text/html"})]
    client = ServerClient("http://device.test", "t", transport=server.transport(), sleep=pytest.fail)
    with pytest.raises(ServerError) as caught:
        run_device(engine, data, state, client, DeviceOptions(), sleep=pytest.fail)
    assert "POST /v1/rounds/1/update is not edgepfl JSON (200, text/html): a captive portal" in caught.value.problem
    assert "log in to the Wi-Fi portal" in caught.value.fix and "\n" not in str(caught.value)
    pending = state.state.pending_upload
    assert state.state.last_completed_round == 1 and pending is not None and pending.round_id == 1
    saved_body = state.pending_payload()
    # run again: the saved update goes out as it was, and the run completes
    summary = run_device(engine, data, state, client, DeviceOptions(), sleep=pytest.fail)
    assert summary.finished and server.uploads == [(1, saved_body)] and state.state.last_uploaded_round == 1


@pytest.mark.slow
def test_an_html_reply_to_the_base_is_one_line_before_training(mlp_bundle, tmp_path):
    engine, data, state, server = _open_device(mlp_bundle, tmp_path, server_rounds=1)
    server.faults["/v1/rounds/1/base"] = [httpx.Response(200, text=HTML, headers={"content-type": "text/html"})]
    client = ServerClient("http://device.test", "t", transport=server.transport(), sleep=pytest.fail)
    with pytest.raises(ServerError, match=r"GET /v1/rounds/1/base is not safetensors \(200, text/html\): a captive"):
        run_device(engine, data, state, client, DeviceOptions(), sleep=pytest.fail)
    assert state.state.last_completed_round is None and not server.uploads


def test_an_html_reply_to_the_metrics_only_warns(mlp_bundle, tmp_path):
    engine, data, state, server = _open_device(mlp_bundle, tmp_path, server_rounds=1)
    server.faults["/v1/rounds/1/metrics"] = [httpx.Response(200, text=HTML, headers={"content-type": "text/html"})]
    client = ServerClient("http://device.test", "t", transport=server.transport(), sleep=pytest.fail)
    events = Recorder(state)
    summary = run_device(engine, data, state, client, DeviceOptions(), events, sleep=pytest.fail)
    assert summary.finished and state.state.last_uploaded_round == 1
    assert any(m.startswith("metrics of round 1 not reported: the reply to POST") for m in events.messages)


# the device token goes to the configured server only


@pytest.mark.parametrize(
    "url",
    [
        "http://evil.test/v1/rounds/1/base",
        "https://device.test:8080/v1/rounds/1/base",  # another scheme
        "http://device.test:9090/v1/rounds/1/base",  # another port
        "//evil.test/v1/rounds/1/base",  # another host, scheme-relative
    ],
)
def test_a_base_url_on_another_origin_is_refused_before_the_token_is_sent(url):
    requests: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, content=encode_tensors({"w": np.ones(2, np.float32)}))

    client = ServerClient("http://device.test:8080", "secret-token", transport=httpx.MockTransport(handle))
    with pytest.raises(ServerError) as caught:
        client.fetch_tensors(url)
    assert not requests
    assert "which is not the configured server http://device.test:8080" in caught.value.problem
    assert "--server" in caught.value.fix
    for allowed in ("/v1/rounds/1/base", "http://device.test:8080/v1/rounds/1/base", "HTTP://Device.test:8080/v1/x"):
        np.testing.assert_array_equal(client.fetch_tensors(allowed)["w"], np.ones(2, np.float32))
    assert [str(r.url) for r in requests] == [
        "http://device.test:8080/v1/rounds/1/base",
        "http://device.test:8080/v1/rounds/1/base",
        "http://device.test:8080/v1/x",
    ]
    assert all(r.headers["authorization"] == "Bearer secret-token" and r.url.host == "device.test" for r in requests)


# the whole `edgepfl device run` against a hostile server on loopback: one line, exit 2, state unchanged


class _Bridge(BaseHTTPRequestHandler):
    """Serves a real HTTP socket from a ScriptedServer-like `handle(httpx.Request) -> httpx.Response`."""

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        request = httpx.Request(
            self.command, f"http://{self.headers['host']}{self.path}", headers=dict(self.headers), content=body
        )
        response = self.server.handle(request)  # type: ignore[attr-defined]
        response.read()
        self.send_response(response.status_code)
        for key, value in response.headers.items():
            if key.lower() not in ("content-length", "transfer-encoding"):
                self.send_header(key, value)
        self.send_header("content-length", str(len(response.content)))
        self.end_headers()
        self.wfile.write(response.content)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def loopback() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Bridge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def _task(server: ScriptedServer, change: dict) -> httpx.Response:
    task = Task("train", server.manifest.base_layout_hash, 2, RoundSettings(batch_size=16, lr=0.1), "/v1/rounds/2/base")
    body = task.to_json()
    body["settings"].update(change.get("settings", {}))
    body.update({k: v for k, v in change.items() if k != "settings"})
    return httpx.Response(200, content=json.dumps(body), headers={"content-type": "application/json"})  # NaN too


@pytest.mark.parametrize(
    "change, message",
    [
        ({"settings": {"batch_size": 0}}, "round settings are invalid: batch_size 0 is not an integer in 1..1048576"),
        ({"settings": {"epochs": "abc"}}, "round settings are invalid: epochs 'abc' is not an integer"),
        ({"settings": {"lr": "x"}}, "round settings are invalid: lr 'x' is not a positive number"),
        ({"action": "wait", "retry_after": -1}, "task is malformed (retry_after -1 is not a number of seconds >= 0)"),
        ({"action": "wait", "retry_after": math.nan}, "task is malformed (retry_after nan is not a number of seconds"),
        ({"base_url": "http://evil.test/v1/rounds/2/base"}, "points the device at http://evil.test/v1/rounds/2/base"),
        ({"html": True}, "the reply to GET /v1/task is not edgepfl JSON (200, text/html): a captive portal"),
    ],
    ids=["batch-size-0", "epochs-abc", "lr-x", "retry-after-negative", "retry-after-nan", "foreign-base-url", "html"],
)
def test_device_run_against_a_hostile_reply_is_one_line(mlp_bundle, tmp_path, loopback, change, message):
    engine = open_engine(mlp_bundle, "portable")
    state = tmp_path / "state"
    saved = StateFolder(state, engine.manifest, engine.name)
    saved.commit(engine.get_tensors(), {"round": 1}, round_id=1)
    saved.close()
    scripted = ScriptedServer(engine.manifest, {})
    html = httpx.Response(200, text=HTML, headers={"content-type": "text/html"})
    scripted.faults["/v1/task"] = [html if change.get("html") else _task(scripted, change)]
    loopback.handle = scripted.handle  # type: ignore[attr-defined]
    data = save_npz(tmp_path / "d.npz", (0, 1), 40)
    common = ["--bundle", str(mlp_bundle), "--data", str(data), "--state", str(state), "--engine", "portable"]
    before = _folder_bytes(state)
    url = f"http://127.0.0.1:{loopback.server_address[1]}"
    result = CliRunner().invoke(
        device_app, ["run", *common, "--server", url, "--token", "t", "--retries", "1", "--json"]
    )
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert lines[0].endswith(")") and "Traceback" not in result.output  # "problem (fix)"
    assert _folder_bytes(state) == before
    assert all(path in ("/v1/task",) for _, path in scripted.calls)  # nothing fetched, nothing uploaded
