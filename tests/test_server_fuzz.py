"""Property-based fuzz of a live server, driven by its own /openapi.json: no input makes it answer 5xx."""

from __future__ import annotations

import json
import math
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import DeviceClient, LiveServer, enroll, make_bundle, upload_body, wait_status

from edgepfl.wire import encode_tensors

FUZZ_CASES = 300
DTYPES = ("float32", "float64", "float16", "int64", "int8", "uint8", "bool")


def operations(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (method, path) of the spec with its path parameters' schemas and request body schemas."""
    found = []
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            params = {p["name"]: p["schema"] for p in operation.get("parameters", []) if p["in"] == "path"}
            content = operation.get("requestBody", {}).get("content", {})
            found.append({"method": method.upper(), "path": path, "params": params, "content": content})
    return found


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy:
    """Values that fit a (small) JSON schema, edge cases included: huge numbers, NaN, Inf, empty strings."""
    if "anyOf" in schema:
        return st.one_of([from_schema(option) for option in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum")) | st.integers()
    if kind == "number":
        return st.floats(allow_nan=True, allow_infinity=True) | st.integers()
    if kind == "string":
        return st.text(max_size=30)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {name: from_schema(sub) for name, sub in properties.items() if name in required},
            optional={name: from_schema(sub) for name, sub in properties.items() if name not in required},
        )
    return any_json


any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def tensor_bodies(draw, names: list[str], valid_body: bytes, layout_hash: str) -> bytes:
    """Safetensors-shaped bodies: random tensors and metadata, or a valid upload with bytes flipped or cut."""
    how = draw(st.sampled_from(["random bytes", "mutated", "cut", "tensors", "metadata"]))
    if how == "random bytes":
        return draw(st.binary(max_size=512))
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


def test_fuzz_from_the_openapi_spec_finds_no_5xx(tmp_path: Path) -> None:
    manifest = make_bundle(tmp_path / "bundle")
    tokens = enroll(tmp_path / "state", "a", "b", "outsider")  # the outsider never polls, so is never sampled
    server = LiveServer(
        tmp_path / "bundle",
        tmp_path / "state",
        "--rounds",
        "1",
        "--min-clients",
        "2",
        "--poll-interval",
        "0.2",
        "--max-upload-mb",
        "0.01",
    ).start()
    try:
        a, b = DeviceClient(server.url, tokens["a"]), DeviceClient(server.url, tokens["b"])
        a.task()
        b.task()
        round_id = a.wait_for_train()["round"]
        base = a.base(round_id)
        valid = upload_body({k: v + np.float32(1) for k, v in base.items()}, manifest)
        spec = httpx.get(f"{server.url}/openapi.json").json()
        ops = operations(spec)
        weighted = ops + [op for op in ops if op["content"]] * 4  # bodies are where bad input hides
        assert {op["path"] for op in ops} >= {
            "/v1/task",
            "/v1/rounds/{round_id}/update",
            "/v1/rounds/{round_id}/metrics",
        }
        auth = st.sampled_from([tokens["a"]] * 5 + [tokens["outsider"], "forged", "a b", None])  # mostly past auth
        bodies = {
            "application/octet-stream": tensor_bodies(
                sorted(n for n in base) + ["head.weight"], valid, manifest.base_layout_hash
            ),
        }
        http = httpx.Client(base_url=server.url, timeout=30)
        answered: dict[tuple[int, str], int] = {}

        @settings(
            max_examples=FUZZ_CASES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(data=st.data())
        def request_from_spec(data: st.DataObject) -> None:
            op = data.draw(st.sampled_from(weighted))
            path = op["path"]
            for name, schema in op["params"].items():
                value = data.draw(st.sampled_from([round_id] * 2 + [from_schema(schema), st.text(max_size=12)]))
                value = data.draw(value) if isinstance(value, st.SearchStrategy) else value
                path = path.replace("{" + name + "}", urllib.parse.quote(str(value), safe=""))
            token = data.draw(auth)
            headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
            content = None
            if op["content"]:
                media = data.draw(st.sampled_from(sorted(op["content"])))
                headers["Content-Type"] = media
                if media in bodies:
                    content = data.draw(bodies[media])
                else:
                    value = data.draw(from_schema(op["content"][media]["schema"]) | any_json)
                    content = data.draw(st.just(json.dumps(value).encode()) | st.binary(max_size=64))
            reply = http.request(op["method"], path, headers=headers, content=content)
            assert reply.status_code < 500, (op["method"], path, reply.status_code, reply.text)
            error = ""
            if reply.status_code >= 400:
                body = reply.json()
                assert set(body) == {"error", "detail", "fix"} and body["detail"], body
                error = body["error"]
            answered[(reply.status_code, error)] = answered.get((reply.status_code, error), 0) + 1

        request_from_spec()
        http.close()
        assert server.process is not None and server.process.poll() is None
        assert answered.get((200, ""), 0) > 0 and len(answered) >= 8, answered  # the fuzz reached both sides
        reply = b.upload(round_id, upload_body({k: v - np.float32(1) for k, v in base.items()}, manifest))
        assert reply.status_code == 200, reply.text  # and the server still takes real work afterwards
        if a.task()["action"] == "train":  # the fuzz never got a valid upload of a's through
            assert a.upload(round_id, valid).status_code == 200
        wait_status(server.url, tokens["a"], lambda s: s["rounds_completed"] == 1)
    finally:
        server.kill()
