"""The server against hostile devices and networks: bad headers, slow senders, enrollment floods, full disks."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from server_helpers import enroll, make_bundle, upload_body
from test_server_engine import Clock, _open

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


def test_temp_files_left_by_a_crash_are_removed_at_start(round_app) -> None:
    engine = round_app["engine"]
    stale = engine.store.blob_dir / "ab" / f".{'ab' * 32}.safetensors.4242.tmp"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"x" * 1000)
    create_engine(engine.config, round_app["clock"])
    assert not stale.exists()
