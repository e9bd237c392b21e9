"""Property-based fuzz of the ASGI app with schemathesis, driven by its own /openapi.json: no input makes it answer 5xx.

Upload bodies come from a safetensors-aware strategy (random tensors and metadata, a valid upload
with bytes flipped or cut); every other part of a request comes from the spec.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import schemathesis
from fastapi.testclient import TestClient
from fuzz_budget import examples, fuzz_settings, reported, seeded
from hypothesis import given
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from server_helpers import enroll, make_bundle, upload_body
from test_server_engine import Clock, _open

from edgepfl.server.app import create_app
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import create_engine
from edgepfl.wire import decode_tensors, encode_tensors

UPLOAD_CASES = 150  # bodies are where bad input hides
OTHER_CASES = 150  # over every other operation
DTYPES = ("float32", "float64", "float16", "int64", "int8", "uint8", "bool")
TOKENS = ("a",) * 5 + ("outsider", "forged", None)  # mostly past authentication

_target: dict[str, Any] = {}  # the open round the fixture made, for the body strategy and the tokens


@st.composite
def tensor_bodies(draw, names: list[str], valid_body: bytes, layout_hash: str) -> bytes:
    """Safetensors-shaped bodies: random tensors and metadata, or a valid upload with bytes flipped or cut."""
    how = draw(st.sampled_from(["random bytes", "mutated", "cut", "tensors", "metadata", "hostile header"]))
    if how == "random bytes":
        return draw(st.binary(max_size=512))
    if how == "hostile header":  # nested deep (Python's json recurses), or a name given twice
        depth = draw(st.integers(1, 5000))
        header = draw(st.sampled_from([b'{"__metadata__":' + b"[" * depth + b"]" * depth + b"}", duplicate_names()]))
        return len(header).to_bytes(8, "little") + header + b"\0" * 8
    if how in ("mutated", "cut"):
        body = bytearray(valid_body)
        if how == "cut":
            return bytes(body[: draw(st.integers(0, len(body)))])
        for _ in range(draw(st.integers(1, 8))):
            body[draw(st.integers(0, len(body) - 1))] = draw(st.integers(0, 255))
        return bytes(body)
    tensors = {}
    for name in draw(st.lists(st.sampled_from(names) | st.text(min_size=1, max_size=12), max_size=6, unique=True)):
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        fill = draw(st.floats(allow_nan=True, allow_infinity=True, width=16))
        if np.dtype(dtype).kind != "f":
            fill = 0 if not math.isfinite(fill) else int(fill) % 2
        tensors[name] = np.full(shape, fill, dtype=dtype)
    metadata = {"base_layout_hash": layout_hash, "num_samples": "5"}
    metadata.update(draw(st.dictionaries(st.sampled_from([*metadata, "train_loss", "val_accuracy"]), st.text())))
    if how == "metadata":
        metadata.update(draw(st.dictionaries(st.text(max_size=12), st.text(max_size=40), max_size=4)))
    return encode_tensors(tensors, metadata)


def duplicate_names() -> bytes:
    """A header naming one tensor twice."""
    entry = b'"stem.bias":{"dtype":"F32","shape":[1],"data_offsets":[%d,%d]}'
    return b"{" + entry % (0, 4) + b"," + entry % (4, 8) + b"}"


schemathesis.openapi.media_type(
    "application/octet-stream",
    st.deferred(  # registered for every schema in the process: random bytes where no fixture made the target
        lambda: (
            tensor_bodies(_target["names"], _target["valid"], _target["layout_hash"])
            if _target
            else st.binary(max_size=512)
        )
    ),
)


@pytest.fixture
def fuzzed_app(tmp_path: Path) -> Any:
    """The app with round 1 open for "a" and "b" (the outsider never polls, so is never sampled)."""
    manifest = make_bundle(tmp_path / "bundle")
    config = ServerConfig(
        bundle=tmp_path / "bundle", state=tmp_path / "state", min_clients=2, rounds=1, max_upload_mb=0.01
    )
    tokens = enroll(config.state, "a", "b", "outsider")
    clock = Clock()
    engine = create_engine(config, clock)
    _open(engine, clock, "a", "b")
    base = decode_tensors(engine.base_for("a", 1)[0])
    _target.update(
        names=sorted(base) + ["head.weight"],
        valid=upload_body({k: v + np.float32(1) for k, v in base.items()}, manifest),
        layout_hash=manifest.base_layout_hash,
        tokens={**tokens, "forged": "forged"},
    )
    return create_app(engine)


def _call(case: Any) -> None:
    """Send the case, mostly for the open round and with a valid token (picked from its content, so
    deterministically), and check that the reply is no 5xx and every refusal is {error, detail, fix}."""
    pick = zlib.crc32(repr((case.path_parameters, case.body)).encode())
    if case.path_parameters and "round_id" in case.path_parameters and pick % 3:
        case.path_parameters["round_id"] = 1  # the spec's range alone would rarely reach past 404
    token = TOKENS[pick % len(TOKENS)]
    headers = {"Authorization": f"Bearer {_target['tokens'][token]}"} if token is not None else {}
    response = case.call(headers=headers)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error", "detail", "fix"} and body["detail"], body


def _fuzz(strategy: st.SearchStrategy, count: int, name: str) -> None:
    """`count` cases (scaled and seeded by scripts/fuzz.sh, tests/fuzz_budget.py)."""

    @seeded
    @given(case=strategy)
    @fuzz_settings(count)
    def run(case: Any) -> None:
        _call(case)

    with reported(name, {"examples": examples(count)}):
        run()


def test_no_upload_makes_the_app_answer_5xx(fuzzed_app: Any) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app)
    _fuzz(schema["/v1/rounds/{round_id}/update"]["POST"].as_strategy(), UPLOAD_CASES, "schemathesis uploads")


def test_no_other_request_makes_the_app_answer_5xx(fuzzed_app: Any) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app).exclude(path_regex="/update$")
    _fuzz(schema.as_strategy(), OTHER_CASES, "schemathesis other operations")


def test_the_valid_upload_of_the_fuzz_is_accepted(fuzzed_app: Any) -> None:
    """The body the mutations start from is a real upload, so the fuzz reaches past the header checks."""
    http = TestClient(fuzzed_app)
    headers = {"Authorization": f"Bearer {_target['tokens']['a']}", "Content-Type": "application/octet-stream"}
    reply = http.post("/v1/rounds/1/update", content=_target["valid"], headers=headers)
    assert reply.status_code == 200, reply.text
