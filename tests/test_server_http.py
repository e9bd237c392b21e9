"""The server as a real uvicorn process on loopback: a full round, every bad input, kill -9, TLS, the CLI."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_helpers import (
    DeviceClient,
    LiveServer,
    enroll,
    make_bundle,
    upload_body,
    wait_status,
    weighted_mean,
)
from typer.testing import CliRunner

from edgepfl.cli import app as cli_app
from edgepfl.wire import decode_tensors, encode_tensors


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """Start servers on a fresh bundle and state; every one is killed at teardown."""
    started: list[LiveServer] = []
    make_bundle(tmp_path / "bundle")

    def start(*options: str, tls: tuple[Path, Path] | None = None) -> LiveServer:
        server = LiveServer(tmp_path / "bundle", tmp_path / "state", *options, tls=tls).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


def _train(device: DeviceClient, shift: float, manifest, num_samples: int) -> tuple[int, dict, bytes]:
    task = device.wait_for_train()
    base = device.base(task["round"])
    new = {name: value + np.float32(shift) for name, value in base.items()}
    return task["round"], new, upload_body(new, manifest, num_samples=num_samples)


@pytest.mark.slow
def test_full_round_with_three_devices_equals_the_weighted_mean(live, tmp_path: Path) -> None:
    manifest = make_bundle(tmp_path / "bundle")
    tokens = enroll(tmp_path / "state", "a", "b", "c")
    server = live("--min-clients", "3", "--rounds", "1", "--poll-interval", "0.2")
    devices = {name: DeviceClient(server.url, token) for name, token in tokens.items()}
    for device in devices.values():
        device.task()
    expected = []
    for shift, (name, device) in zip((0.5, -1.0, 2.0), devices.items()):
        task = device.wait_for_train()
        assert task["base_url"] == "/v1/rounds/1/base" and task["settings"]["share_buffers"] is False
        reply = device.http.get(task["base_url"])
        etag = reply.headers["etag"]
        assert device.http.get(task["base_url"], headers={"If-None-Match": etag}).status_code == 304
        base = decode_tensors(reply.content)
        assert sorted(base) == sorted(manifest.names("base"))  # base tensors only
        new = {k: v + np.float32(shift) for k, v in base.items()}
        samples = {"a": 10, "b": 30, "c": 60}[name]
        reply = device.upload(1, upload_body(new, manifest, num_samples=samples))
        assert reply.status_code == 200, reply.text
        expected.append((new, samples))
    status = wait_status(server.url, tokens["a"], lambda s: s["rounds_completed"] == 1)
    assert status["rounds"][0]["uploads"] == 3 and status["state"] == "done"
    done = devices["a"].task()
    assert done["action"] == "done" and done["base_url"] == "/v1/rounds/1/result"
    result = decode_tensors(devices["a"].http.get(done["base_url"]).content)
    for name, value in weighted_mean(expected).items():
        np.testing.assert_allclose(result[name], value, rtol=1e-6, atol=1e-7)
    reply = devices["b"].http.post("/v1/rounds/1/metrics", json={"accuracy": 0.9, "num_samples": 50, "loss": 0.3})
    assert reply.status_code == 200, reply.text
    page = devices["a"].http.get("/")
    assert page.status_code == 200 and "data:image/png;base64," in page.text
    assert devices["a"].http.get("/plot.png").content.startswith(b"\x89PNG")
    assert httpx.get(f"{server.url}/v1/status").status_code == 401  # not public unless --public-status
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/task", "/v1/rounds/{round_id}/base", "/v1/rounds/{round_id}/update"} <= set(spec["paths"])


# ---- bad input: one server with an open round; each case must leave the stored state untouched


@pytest.fixture(scope="module")
def open_round(tmp_path_factory) -> Iterator[dict]:
    folder = tmp_path_factory.mktemp("bad-input")
    manifest = make_bundle(folder / "bundle")
    tokens = enroll(folder / "state", "a", "b", "c", "outsider")
    server = LiveServer(
        folder / "bundle", folder / "state", "--min-clients", "3", "--poll-interval", "0.2", "--max-upload-mb", "0.01"
    ).start()
    try:
        devices = {name: DeviceClient(server.url, tokens[name]) for name in ("a", "b", "c")}
        for device in devices.values():
            device.task()
        task = devices["a"].wait_for_train()
        base = devices["a"].base(task["round"])
        yield {
            "server": server,
            "manifest": manifest,
            "tokens": tokens,
            "devices": devices,
            "base": base,
            "state": folder / "state",
        }
    finally:
        server.kill()


def _with(base: dict, **changes) -> dict:
    tensors = dict(base)
    for name, value in changes.items():
        if value is None:
            tensors.pop(name.replace("__", "."))
        else:
            tensors[name.replace("__", ".")] = value
    return tensors


BAD_UPLOADS = {
    # name: (body builder(base, manifest), status, error)
    "layout hash mismatch": (lambda b, m: upload_body(b, m, base_layout_hash="0" * 64), 409, "layout_mismatch"),
    "missing tensor": (lambda b, m: upload_body(_with(b, mid__weight=None), m), 422, "bad_tensors"),
    "extra tensor": (lambda b, m: upload_body(_with(b, bogus=np.zeros(2, np.float32)), m), 422, "bad_tensors"),
    "personal tensor": (
        lambda b, m: upload_body(_with(b, head__weight=np.zeros((2, 3), np.float32)), m),
        422,
        "personal_tensors",
    ),
    "unshared BN statistics": (
        lambda b, m: upload_body(_with(b, stem_bn__running_mean=np.zeros(4, np.float32)), m),
        422,
        "buffers_not_shared",
    ),
    "wrong shape": (lambda b, m: upload_body(_with(b, stem__bias=np.zeros(5, np.float32)), m), 422, "bad_tensors"),
    "wrong dtype": (lambda b, m: upload_body(_with(b, stem__bias=np.zeros(4, np.float64)), m), 422, "bad_tensors"),
    "NaN": (lambda b, m: upload_body(_with(b, stem__bias=np.full(4, np.nan, np.float32)), m), 422, "bad_tensors"),
    "Inf": (lambda b, m: upload_body(_with(b, stem__bias=np.full(4, -np.inf, np.float32)), m), 422, "bad_tensors"),
    "malformed bytes": (lambda b, m: b"\x00" * 3 + b"not safetensors at all", 400, "malformed"),
    "truncated safetensors": (lambda b, m: upload_body(b, m)[:-7], 400, "malformed"),
    "header length out of range": (lambda b, m: (2**40).to_bytes(8, "little") + b"{}", 400, "malformed"),
    "header not JSON": (lambda b, m: (4).to_bytes(8, "little") + b"{{{{", 400, "malformed"),
    "no metadata": (lambda b, m: encode_tensors(b), 422, "bad_metadata"),
    "negative sample count": (lambda b, m: upload_body(b, m, num_samples=-5), 422, "bad_metadata"),
    "zero sample count": (lambda b, m: upload_body(b, m, num_samples=0), 422, "bad_metadata"),
    "absurd sample count": (lambda b, m: upload_body(b, m, num_samples=10**15), 422, "bad_metadata"),
    "non-numeric sample count": (lambda b, m: upload_body(b, m, num_samples="many"), 422, "bad_metadata"),
    "accuracy out of range": (lambda b, m: upload_body(b, m, val_accuracy=1.5), 422, "bad_metadata"),
    "infinite loss": (lambda b, m: upload_body(b, m, train_loss="inf"), 422, "bad_metadata"),
    "body over --max-upload-mb": (
        lambda b, m: upload_body(_with(b, big=np.zeros(8000, np.float32)), m),
        413,
        "too_large",
    ),
    "empty body": (lambda b, m: b"", 400, "malformed"),
}


def _stored(ctx: dict) -> tuple:
    blobs = sorted(p.name for p in (ctx["state"] / "blobs").rglob("*") if p.is_file())
    status = httpx.get(f"{ctx['server'].url}/v1/status", headers={"Authorization": f"Bearer {ctx['tokens']['a']}"})
    rounds = [(r["round"], r["state"], r["uploads"]) for r in status.json()["rounds"]]
    return blobs, rounds


def _assert_refused(reply: httpx.Response, status: int, error: str) -> None:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error", "detail", "fix"} and body["error"] == error and body["fix"], body


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_upload_is_refused_and_nothing_stored_changes(open_round: dict, case: str) -> None:
    build, status, error = BAD_UPLOADS[case]
    before = _stored(open_round)
    reply = open_round["devices"]["a"].upload(1, build(open_round["base"], open_round["manifest"]))
    _assert_refused(reply, status, error)
    assert _stored(open_round) == before
    assert open_round["devices"]["a"].task()["action"] == "train"  # still serving, still expecting a's upload


def _raw(ctx: dict, token: str | None, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.request(method, f"{ctx['server'].url}{path}", headers=headers, timeout=10, **kwargs)


BAD_REQUESTS = {
    "no token": (lambda ctx: _raw(ctx, None, "GET", "/v1/task"), 401, "unauthorized"),
    "invalid token": (lambda ctx: _raw(ctx, "forged", "GET", "/v1/task"), 401, "unauthorized"),
    "invalid token on upload": (
        lambda ctx: _raw(ctx, "forged", "POST", "/v1/rounds/1/update", content=b"x"),
        401,
        "unauthorized",
    ),
    "wrong round": (
        lambda ctx: ctx["devices"]["a"].upload(99, upload_body(ctx["base"], ctx["manifest"])),
        404,
        "no_such_round",
    ),
    "round zero": (lambda ctx: ctx["devices"]["a"].upload(0, b""), 422, "invalid_request"),
    "round not a number": (lambda ctx: ctx["devices"]["a"].http.get("/v1/rounds/abc/base"), 422, "invalid_request"),
    "device not sampled": (
        lambda ctx: _raw(
            ctx,
            ctx["tokens"]["outsider"],
            "POST",
            "/v1/rounds/1/update",
            content=upload_body(ctx["base"], ctx["manifest"]),
        ),
        403,
        "not_sampled",
    ),
    "chunked body over the cap": (
        lambda ctx: ctx["devices"]["a"].upload(1, iter([b"\x00" * 4096] * 8)),
        413,
        "too_large",
    ),
    "result of an open round": (lambda ctx: ctx["devices"]["a"].http.get("/v1/rounds/1/result"), 409, "no_result"),
    "metrics not JSON": (
        lambda ctx: ctx["devices"]["a"].http.post("/v1/rounds/1/metrics", content=b"{"),
        422,
        "bad_metrics",
    ),
    "metrics accuracy out of range": (
        lambda ctx: ctx["devices"]["a"].http.post("/v1/rounds/1/metrics", json={"accuracy": 2, "num_samples": 3}),
        422,
        "bad_metrics",
    ),
    "metrics NaN": (
        lambda ctx: ctx["devices"]["a"].http.post(
            "/v1/rounds/1/metrics", content=b'{"accuracy": NaN, "num_samples": 3}'
        ),
        422,
        "bad_metrics",
    ),
    "unknown route": (lambda ctx: _raw(ctx, None, "GET", "/v2/task"), 404, "not_found"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_nothing_stored_changes(open_round: dict, case: str) -> None:
    send, status, error = BAD_REQUESTS[case]
    before = _stored(open_round)
    _assert_refused(send(open_round), status, error)
    assert _stored(open_round) == before


@pytest.mark.slow
def test_second_upload_is_idempotent_if_identical_and_409_otherwise(open_round: dict) -> None:
    device, base, manifest = open_round["devices"]["b"], open_round["base"], open_round["manifest"]
    device.task()
    body = upload_body({k: v + 1 for k, v in base.items()}, manifest, num_samples=7)
    first = device.upload(1, body)
    assert first.status_code == 200 and first.json()["duplicate"] is False
    again = device.upload(1, body)
    assert again.status_code == 200 and again.json()["duplicate"] is True
    before = _stored(open_round)
    _assert_refused(device.upload(1, upload_body(base, manifest, num_samples=7)), 409, "duplicate_update")
    assert _stored(open_round) == before


@pytest.mark.slow
def test_kill_9_during_a_round_and_after_an_accepted_upload(live, tmp_path: Path) -> None:
    manifest = make_bundle(tmp_path / "bundle")
    tokens = enroll(tmp_path / "state", "a", "b", "c")
    # the plain weighted mean: 70 samples are more than twice the median, which the default caps
    options = ("--min-clients", "3", "--poll-interval", "0.2", "--rounds", "5", "--weight-multiple", "0")
    server = live(*options)
    devices = {name: DeviceClient(server.url, tokens[name]) for name in tokens}
    for device in devices.values():
        device.task()
    devices["a"].wait_for_train()
    server.kill()  # kill -9 with round 1 open and nothing uploaded

    server = live(*options)
    devices = {name: DeviceClient(server.url, tokens[name]) for name in tokens}
    round_id, new_a, body_a = _train(devices["a"], 1.0, manifest, 10)
    assert round_id == 1
    assert devices["a"].upload(1, body_a).status_code == 200
    server.kill()  # kill -9 right after an accepted upload

    server = live(*options)
    devices = {name: DeviceClient(server.url, tokens[name]) for name in tokens}
    assert devices["a"].task()["action"] == "wait"  # its upload survived
    assert devices["a"].upload(1, body_a).json()["duplicate"] is True
    expected = [(new_a, 10)]
    for shift, name, samples in ((2.0, "b", 20), (-3.0, "c", 70)):
        round_id, new, body = _train(devices[name], shift, manifest, samples)
        assert round_id == 1 and devices[name].upload(1, body).status_code == 200
        expected.append((new, samples))
    status = wait_status(server.url, tokens["a"], lambda s: s["rounds_completed"] == 1)
    result_sha = status["rounds"][0]["result_sha256"]
    result = decode_tensors(devices["a"].http.get("/v1/rounds/1/result").content)
    for name, value in weighted_mean(expected).items():
        np.testing.assert_allclose(result[name], value, rtol=1e-6, atol=1e-7)
    server.kill()

    server = live(*options)  # closed rounds are intact, nothing is aggregated twice
    status = wait_status(server.url, tokens["a"], lambda s: True)
    assert [(r["round"], r["state"]) for r in status["rounds"]][0] == (1, "closed")
    assert status["rounds_completed"] == 1 and status["rounds"][0]["result_sha256"] == result_sha


@pytest.mark.slow
def test_kill_9_while_uploads_are_in_flight_loses_no_acknowledged_upload(live, tmp_path: Path) -> None:
    manifest = make_bundle(tmp_path / "bundle")
    names = [f"d{i}" for i in range(8)]
    tokens = enroll(tmp_path / "state", *names)
    options = ("--min-clients", "8", "--poll-interval", "0.2")
    server = live(*options)
    devices = {name: DeviceClient(server.url, tokens[name]) for name in names}
    for device in devices.values():
        device.task()
    bodies = {name: _train(device, i, manifest, 1 + i)[2] for i, (name, device) in enumerate(devices.items())}
    acknowledged: list[str] = []

    def send(name: str) -> None:
        try:
            if devices[name].upload(1, bodies[name]).status_code == 200:
                acknowledged.append(name)
        except httpx.TransportError:
            pass

    threads = [threading.Thread(target=send, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    time.sleep(0.03)
    server.kill()
    for thread in threads:
        thread.join()
    server = live(*options)
    for name in names:
        reply = DeviceClient(server.url, tokens[name]).upload(1, bodies[name])
        assert reply.status_code == 200, reply.text
        if name in acknowledged:
            assert reply.json()["duplicate"] is True, f"{name}'s acknowledged upload was lost"
    wait_status(server.url, tokens["d0"], lambda s: s["rounds_completed"] == 1)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_a_self_signed_certificate(live, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    tokens = enroll(tmp_path / "state", "a", "b")
    server = live("--min-clients", "2", tls=(cert, key))
    assert server.url.startswith("https://")
    device = DeviceClient(server.url, tokens["a"], verify=ssl.create_default_context(cafile=str(cert)))
    assert device.task()["action"] == "wait"
    for reply in (device.http.get("/v1/task"), device.http.get("/v1/rounds/9/base"), device.http.get("/nowhere")):
        assert reply.headers["strict-transport-security"] == "max-age=31536000", reply.status_code  # over TLS only
        assert reply.headers["x-content-type-options"] == "nosniff"
    with pytest.raises(httpx.ConnectError):  # an unverified certificate is refused by default
        httpx.get(f"{server.url}/v1/task")
    with pytest.raises(httpx.TransportError):  # and plain HTTP is not served on the TLS port
        httpx.get(server.url.replace("https://", "http://") + "/v1/task")


def test_cli_tokens_and_one_line_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    state = tmp_path / "state"
    added = runner.invoke(cli_app, ["serve", "tokens", "add", "phone-1", "--state", str(state)])
    assert added.exit_code == 0 and len(added.stdout.strip()) >= 40
    again = runner.invoke(cli_app, ["serve", "tokens", "add", "phone-1", "--state", str(state)])
    assert again.exit_code == 2 and again.output.startswith("error: ") and "--replace" in again.output
    listed = runner.invoke(cli_app, ["serve", "tokens", "list", "--state", str(state)])
    assert listed.exit_code == 0 and listed.stdout.startswith("phone-1\t")
    db_text = b"".join(p.read_bytes() for p in state.glob("*sqlite3*"))
    assert added.stdout.strip().encode() not in db_text  # only a hash is stored
    make_bundle(tmp_path / "bundle", with_initial=False)
    refused = runner.invoke(cli_app, ["serve", "--bundle", str(tmp_path / "bundle"), "--state", str(state)])
    assert refused.exit_code == 2 and refused.output.count("\n") == 1 and "--init" in refused.output
    bad = runner.invoke(
        cli_app, ["serve", "--bundle", str(tmp_path / "bundle"), "--state", str(state), "--fraction", "0"]
    )
    assert bad.exit_code == 2 and "--fraction" in bad.output
