"""The server against hostile devices and networks: bad headers, slow senders, enrollment floods, full disks."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from server_helpers import DeviceClient, LiveServer, enroll, make_bundle, upload_body
from test_server_engine import Clock, _open
from typer.testing import CliRunner

from edgepfl.cli import app as cli_app
from edgepfl.errors import WireError
from edgepfl.server.app import create_app
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import create_engine
from edgepfl.wire import decode_metadata, decode_tensors, encode_tensors


def _with_header(header: bytes, data: bytes = b"") -> bytes:
    """Safetensors bytes with a hand-written JSON header (padded to 8 bytes, as the format asks)."""
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data


def nested_header_payload(depth: int = 100_000) -> bytes:
    """A safetensors payload whose `__metadata__` is a list nested `depth` deep."""
    return _with_header(b'{"__metadata__":' + b"[" * depth + b"]" * depth + b"}")


def duplicate_name_payload() -> bytes:
    """Two entries named "stem.bias" in one header (JSON allows it; the last one would win)."""
    entry = b'"stem.bias":{"dtype":"F32","shape":[1],"data_offsets":[%d,%d]}'
    return _with_header(b"{" + entry % (0, 4) + b"," + entry % (4, 8) + b"}", np.arange(2, dtype=np.float32).tobytes())


# ---- the one header decoder (edgepfl/wire.py)


@pytest.mark.parametrize("decode", [decode_metadata, decode_tensors])
def test_a_deeply_nested_header_is_a_wire_error(decode) -> None:
    with pytest.raises(WireError, match="nested"):
        decode(nested_header_payload())


@pytest.mark.parametrize("decode", [decode_metadata, decode_tensors])
def test_duplicate_tensor_names_are_refused_naming_the_name(decode) -> None:
    with pytest.raises(WireError, match="'stem.bias'"):
        decode(duplicate_name_payload())


def test_a_header_over_the_size_limit_is_refused_before_it_is_parsed() -> None:
    payload = _with_header(b'{"__metadata__":{"pad":"' + b"x" * (17 * 1024 * 1024) + b'"}}')
    with pytest.raises(WireError, match="header"):
        decode_metadata(payload)


def test_valid_payloads_still_decode() -> None:
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(0, dtype=np.int64)}
    payload = encode_tensors(tensors, {"k": "v", "nested": json.dumps({"x": [[1, 2], {"y": []}]})})
    assert decode_metadata(payload)["k"] == "v"
    decoded = decode_tensors(payload)
    assert sorted(decoded) == ["a", "b"] and np.array_equal(decoded["a"], tensors["a"])


# ---- the HTTP app in-process, on the engine's fake clock


@pytest.fixture
def round_app(tmp_path: Path) -> dict[str, Any]:
    """An in-process app (no round loop) with round 1 open for d0 and d1; `tick()` closes rounds."""
    manifest = make_bundle(tmp_path / "bundle")
    config = ServerConfig(bundle=tmp_path / "bundle", state=tmp_path / "state", min_clients=2, round_timeout=100)
    tokens = enroll(config.state, "d0", "d1")
    clock = Clock()
    engine = create_engine(config, clock)
    _open(engine, clock, "d0", "d1")
    http = TestClient(create_app(engine), raise_server_exceptions=False)
    base = decode_tensors(engine.base_for("d0", 1)[0])
    return {
        "engine": engine,
        "clock": clock,
        "http": http,
        "tokens": tokens,
        "manifest": manifest,
        "body": upload_body({name: value + 1 for name, value in base.items()}, manifest),
    }


def post_update(ctx: dict[str, Any], device: str, body: bytes, round_id: int = 1) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ctx['tokens'][device]}", "Content-Type": "application/octet-stream"}
    return ctx["http"].post(f"/v1/rounds/{round_id}/update", content=body, headers=headers)


def refused(reply: httpx.Response, status: int, error: str) -> dict[str, str]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error", "detail", "fix"} and body["error"] == error and body["detail"] and body["fix"], body
    return body


def test_a_nested_header_is_400_with_no_log_line_on_an_open_a_retried_and_a_closed_round(round_app, caplog) -> None:
    ctx = round_app
    caplog.set_level(logging.INFO, logger="edgepfl")
    assert "nested" in refused(post_update(ctx, "d0", nested_header_payload()), 400, "malformed")["detail"]
    assert post_update(ctx, "d0", ctx["body"]).status_code == 200
    refused(post_update(ctx, "d0", nested_header_payload()), 400, "malformed")  # the retry path parses first
    assert post_update(ctx, "d1", ctx["body"]).status_code == 200
    ctx["engine"].tick()
    assert ctx["engine"].store.round(1).state == "closed"
    for _ in range(3):  # repeatably
        refused(post_update(ctx, "d1", nested_header_payload()), 400, "malformed")
    assert [record for record in caplog.records if record.levelno >= logging.WARNING] == []


def test_an_upload_naming_a_tensor_twice_is_400_naming_it(round_app) -> None:
    body = refused(post_update(round_app, "d0", duplicate_name_payload()), 400, "malformed")
    assert "'stem.bias'" in body["detail"]
    assert round_app["engine"].store.updates(1) == []


def test_an_upload_after_the_deadline_is_409_and_a_short_round_is_abandoned(round_app) -> None:
    ctx = round_app
    http, engine, clock = ctx["http"], ctx["engine"], ctx["clock"]
    headers = {name: {"Authorization": f"Bearer {token}"} for name, token in ctx["tokens"].items()}
    first_etag = http.get("/v1/rounds/1/base", headers=headers["d0"]).headers["etag"]
    assert post_update(ctx, "d0", ctx["body"]).status_code == 200
    assert http.get("/v1/task", headers=headers["d0"]).json()["action"] == "wait"  # d0 has uploaded
    deadline = http.get("/v1/task", headers=headers["d1"]).json()["deadline"]
    clock.now = deadline + 0.1
    refused(post_update(ctx, "d1", ctx["body"]), 409, "deadline_passed")
    engine.tick()
    status = http.get("/v1/status", headers=headers["d0"]).json()
    assert status["rounds"][0]["state"] == "abandoned" and status["rounds_completed"] == 0
    _open(engine, clock, "d0", "d1")
    assert http.get("/v1/task", headers=headers["d0"]).json()["round"] == 2
    assert http.get("/v1/rounds/2/base", headers=headers["d0"]).headers["etag"] == first_etag  # never aggregated


# ---- storage failures: say what failed, leave no temp file, lose nothing stored


def _files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize(
    ("call", "errno_code", "status", "error"),
    [("fsync", errno.ENOSPC, 507, "insufficient_storage"), ("replace", errno.EROFS, 503, "storage_failed")],
)
def test_a_failed_blob_write_is_507_or_503_and_leaves_no_temp_file(
    round_app, monkeypatch, call: str, errno_code: int, status: int, error: str
) -> None:
    ctx = round_app
    engine = ctx["engine"]
    assert post_update(ctx, "d0", ctx["body"]).status_code == 200
    blobs_before = _files(engine.store.blob_dir)
    updates_before = engine.store.updates(1)

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(errno_code, os.strerror(errno_code))

    monkeypatch.setattr(os, call, fail)
    other = upload_body(
        {name: value * 2 for name, value in decode_tensors(engine.base_for("d1", 1)[0]).items()}, ctx["manifest"]
    )
    body = refused(post_update(ctx, "d1", other), status, error)
    assert os.strerror(errno_code).lower() in body["detail"].lower() and "--state" in body["fix"]
    monkeypatch.undo()
    assert _files(engine.store.blob_dir) == blobs_before  # no temp file left, no stored blob touched
    assert engine.store.updates(1) == updates_before
    assert post_update(ctx, "d1", other).status_code == 200  # once the disk is back, the same upload goes through


def test_a_full_database_is_507_and_keeps_what_it_holds(round_app) -> None:
    ctx = round_app
    store = ctx["engine"].store
    assert post_update(ctx, "d0", ctx["body"]).status_code == 200
    updates_before = store.updates(1)
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # the database cannot grow: SQLite's SQLITE_FULL
    filler = iter(range(1 << 30))
    for size in (1024, 64, 1):  # and the updates table has no room left in its pages (rows of a round 0)
        with contextlib.suppress(sqlite3.OperationalError):
            while True:
                device = f"{next(filler):08d}".ljust(size, "x")
                store._db.execute(
                    "INSERT INTO updates (round_id, device, blob_sha, nbytes, num_samples, received, status) "
                    "VALUES (0, ?, '', 0, 0, 0, 'filler')",
                    (device,),
                )
    other = upload_body(
        {name: value * 2 for name, value in decode_tensors(ctx["engine"].base_for("d1", 1)[0]).items()},
        ctx["manifest"],
    )
    try:
        body = refused(post_update(ctx, "d1", other), 507, "insufficient_storage")
    finally:
        store._db.execute("DELETE FROM updates WHERE round_id = 0")
        store._db.execute("PRAGMA max_page_count = 1073741823")
    assert "database" in body["detail"] and "--state" in body["fix"]
    assert store.updates(1) == updates_before  # the accepted upload is still there, nothing half-written
    assert post_update(ctx, "d1", other).status_code == 200  # room again: the same upload goes through


def test_temp_files_left_by_a_crash_are_removed_at_start(round_app) -> None:
    engine = round_app["engine"]
    stale = engine.store.blob_dir / "ab" / f".{'ab' * 32}.safetensors.4242.tmp"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"x" * 1000)
    create_engine(engine.config, round_app["clock"])
    assert not stale.exists()


# ---- enrollment: others' failures never lock out an honest device


SECRET = "shared-secret-of-the-fleet-0123456789"


def enroll_app(tmp_path: Path, **config: Any) -> tuple[Any, Any]:
    make_bundle(tmp_path / "bundle")
    settings = ServerConfig(bundle=tmp_path / "bundle", state=tmp_path / "state", enroll_secret=SECRET, **config)
    engine = create_engine(settings)
    return engine, create_app(engine)  # no lifespan: enrollment needs no round loop


def post_enroll(app: Any, address: str, name: str, secret: str) -> httpx.Response:
    http = TestClient(app, client=(address, 50000))
    return http.post("/v1/enroll", json={"device": name}, headers={"Authorization": f"Bearer {secret}"})


def test_failures_from_ten_thousand_addresses_do_not_block_an_honest_newcomer(tmp_path: Path) -> None:
    engine, app = enroll_app(tmp_path)
    for host in range(10_000 + 2 * engine.config.enroll_max_failures):  # the table overflows
        engine.enrollment.limiter.record_failure(f"10.{host // 65536}.{host // 256 % 256}.{host % 256}")
    for attempt in range(engine.config.enroll_max_failures):
        refused(post_enroll(app, f"203.0.113.{attempt}", "intruder", "wrong-secret-0123456789"), 401, "unauthorized")
    reply = post_enroll(app, "198.51.100.9", "phone-1", SECRET)
    assert reply.status_code == 200, reply.text


def test_an_ipv6_host_cannot_rotate_addresses_within_its_64(tmp_path: Path) -> None:
    engine, app = enroll_app(tmp_path, enroll_max_failures=3)
    for host in range(1, 4):
        refused(post_enroll(app, f"2001:db8:1:2::{host:x}", "intruder", "wrong-secret-0123456789"), 401, "unauthorized")
    refused(post_enroll(app, "2001:db8:1:2:ffff::1", "intruder", "wrong-secret-0123456789"), 429, "too_many_attempts")
    assert post_enroll(app, "2001:db8:1:3::1", "phone-1", SECRET).status_code == 200  # the next /64 is not blocked


# ---- a real server on loopback: slow senders and forwarded headers


def _open_live_round(tmp_path: Path, *options: str) -> dict[str, Any]:
    manifest = make_bundle(tmp_path / "bundle")
    tokens = enroll(tmp_path / "state", "a", "b")
    server = LiveServer(
        tmp_path / "bundle", tmp_path / "state", "--min-clients", "2", "--poll-interval", "0.2", *options
    )
    server.start()
    devices = {name: DeviceClient(server.url, tokens[name]) for name in tokens}
    for device in devices.values():
        device.task()
    round_id = devices["a"].wait_for_train()["round"]
    base = devices["a"].base(round_id)
    bodies = {
        name: upload_body({k: v + shift for k, v in base.items()}, manifest) for name, shift in (("a", 1), ("b", 2))
    }
    return {"server": server, "tokens": tokens, "devices": devices, "round": round_id, "bodies": bodies}


def _raw_request_head(ctx: dict[str, Any], device: str, length: int) -> bytes:
    return (
        f"POST /v1/rounds/{ctx['round']}/update HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {ctx['tokens'][device]}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _read_reply(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """An HTTP reply read whole: its head, then the body Content-Length announces, or what came before the server
    closed. One recv can end between the head and the body (it did once in CI: the body was not yet there)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        head, separator, rest = data.partition(b"\r\n\r\n")
        if separator:
            lengths = [
                line.split(b":", 1)[1]
                for line in head.split(b"\r\n")[1:]
                if line.lower().startswith(b"content-length:")
            ]
            if lengths and len(rest) >= int(lengths[0]):
                return data
        try:
            chunk = sock.recv(65536)
        except OSError:
            return data
        if not chunk:
            return data
        data += chunk


@pytest.mark.slow
def test_a_trickling_upload_loses_its_slot_and_the_others_upload(tmp_path: Path) -> None:
    ctx = _open_live_round(tmp_path, "--upload-slots", "1", "--read-timeout", "1", "--min-upload-rate", "1")
    try:
        body = ctx["bodies"]["a"]
        slow = socket.create_connection(("127.0.0.1", ctx["server"].port), timeout=10)
        slow.sendall(_raw_request_head(ctx, "a", len(body)))
        started = time.monotonic()
        reply, sent = b"", 0
        result: dict[str, Any] = {}

        def upload_b() -> None:
            begun = time.monotonic()
            result["reply"] = ctx["devices"]["b"].upload(ctx["round"], ctx["bodies"]["b"])
            result["seconds"] = time.monotonic() - begun

        other = threading.Thread(target=upload_b)
        for step in range(200):  # at most 10 s of 10 bytes/s: the server must cut it off well before
            if step == 5:
                other.start()  # a's trickle holds the only slot by now
            try:
                slow.sendall(body[sent : sent + 1])
            except OSError:
                reply = _read_reply(slow)  # the server closed the connection, its reply may be waiting
                break
            sent += 1
            readable, _, _ = select.select([slow], [], [], 0.1)
            if readable:
                reply = _read_reply(slow)
                break
        slow.close()
        other.join(timeout=30)
        assert time.monotonic() - started < 8, "the trickle was never cut off"
        assert b" 408 " in reply.split(b"\r\n", 1)[0], reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"] == "too_slow"
        head = reply.split(b"\r\n\r\n", 1)[0].lower()
        assert b"x-content-type-options: nosniff" in head and b"content-security-policy: default-src 'none'" in head
        assert result["reply"].status_code == 200, result["reply"].text
        assert result["seconds"] < 5, result  # b waited for the trickle's cut-off, not for its end
    finally:
        ctx["server"].kill()


@pytest.mark.slow
def test_headers_that_never_end_are_cut_off(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundle")
    with LiveServer(tmp_path / "bundle", tmp_path / "state", "--read-timeout", "1") as server:
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        slow.sendall(b"GET /v1/task HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started = time.monotonic()
        closed = False
        for _ in range(100):  # at most 10 s
            try:
                slow.sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed = True
                break
            readable, _, _ = select.select([slow], [], [], 0.1)
            if readable and slow.recv(65536) == b"":
                closed = True
                break
        slow.close()
        assert closed and time.monotonic() - started < 5
        assert httpx.get(f"{server.url}/openapi.json").status_code == 200  # and others are served


def _wrong_enrollments_from(server: LiveServer, forwarded_for: list[str]) -> list[int]:
    replies = []
    for address in forwarded_for:
        headers = {"Authorization": "Bearer wrong-secret-0123456789", "X-Forwarded-For": address}
        replies.append(httpx.post(f"{server.url}/v1/enroll", json={"device": "x"}, headers=headers).status_code)
    return replies


@pytest.mark.slow
def test_forwarded_for_is_believed_only_from_named_proxies(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundle")
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    options = ("--enroll-secret-file", str(secret), "--enroll-max-failures", "2")
    spoofed = [f"203.0.113.{host}" for host in range(1, 5)]
    with LiveServer(tmp_path / "bundle", tmp_path / "state", *options) as server:
        assert _wrong_enrollments_from(server, spoofed) == [401, 401, 429, 429]  # all from 127.0.0.1
    with LiveServer(
        tmp_path / "bundle", tmp_path / "proxied", *options, "--forwarded-allow-ips", "127.0.0.1"
    ) as server:
        assert _wrong_enrollments_from(server, spoofed) == [401] * 4  # the named proxy's word is taken
    refused_option = CliRunner().invoke(
        cli_app,
        [
            "serve",
            "--bundle",
            str(tmp_path / "bundle"),
            "--state",
            str(tmp_path / "x"),
            "--forwarded-allow-ips",
            "proxy.example",
        ],
    )
    assert refused_option.exit_code == 2 and refused_option.output.startswith("error: --forwarded-allow-ips")


@pytest.mark.parametrize("option", ["--read-timeout", "--min-upload-rate"])
def test_serve_refuses_a_non_positive_read_limit_in_one_line(tmp_path: Path, option: str) -> None:
    args = ["serve", "--bundle", str(tmp_path / "bundle"), "--state", str(tmp_path / "state"), option, "0"]
    refused_option = CliRunner().invoke(cli_app, args)
    assert refused_option.exit_code == 2 and refused_option.output.count("\n") == 1, refused_option.output
    assert refused_option.output.startswith(f"error: {option} 0.0: input should be greater than 0"), refused_option
