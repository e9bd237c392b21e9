"""Helpers for the server tests: a tiny bundle (no torch), enrollment, a live uvicorn process, a device client."""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from starlette.routing import Route

from edgepfl.kinds import ImageKind, InputSpec
from edgepfl.manifest import Manifest, TensorSpec
from edgepfl.protocol import UploadMeta
from edgepfl.server.launch import LocalServer, free_port  # noqa: F401 - free_port is for the tests
from edgepfl.server.store import Store
from edgepfl.server.tokens import hash_token
from edgepfl.wire import decode_tensors, encode_tensors, save_tensors

# blocks: 0 "stem" and 1 "mid" are base, 2 "head" is personal (kp=1); stem has BatchNorm statistics
TINY_TENSORS = (
    TensorSpec("stem.weight", (4, 3), "float32", "base", 0),
    TensorSpec("stem.bias", (4,), "float32", "base", 0),
    TensorSpec("mid.weight", (3, 4), "float32", "base", 1),
    TensorSpec("head.weight", (2, 3), "float32", "personal", 2),
    TensorSpec("head.bias", (2,), "float32", "personal", 2),
    TensorSpec("stem_bn.running_mean", (4,), "float32", "buffer", 0),
    TensorSpec("stem_bn.running_var", (4,), "float32", "buffer", 0),
    TensorSpec("head_bn.running_mean", (2,), "float32", "buffer", 2),
)


def make_bundle(folder: Path, kp: int = 1, with_initial: bool = True, seed: int = 0) -> Manifest:
    """Write manifest.json (and portable/initial.safetensors) for a three-block toy model."""
    tensors = TINY_TENSORS
    if kp == 0:
        tensors = tuple(
            TensorSpec(t.name, t.shape, t.dtype, "base" if t.role == "personal" else t.role, t.block) for t in tensors
        )
    manifest = Manifest(
        model={"name": "tiny"},
        kind=ImageKind(input=InputSpec(shape=(3,))),
        num_classes=2,
        kp=kp,
        blocks=("stem", "mid", "head"),
        tensors=tensors,
    )
    folder.mkdir(parents=True, exist_ok=True)
    manifest.save(folder)
    if with_initial:
        save_tensors(folder / "portable" / "initial.safetensors", initial_tensors(manifest, seed))
    return manifest


def initial_tensors(manifest: Manifest, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded initial values for every tensor of the manifest."""
    rng = np.random.default_rng(seed)
    return {t.name: rng.normal(0, 0.1, t.shape).astype(t.dtype) for t in manifest.tensors}


def enroll(state: Path, *names: str) -> dict[str, str]:
    """Tokens for new devices, written straight into the state folder."""
    store = Store(state)
    tokens = {}
    for name in names:
        tokens[name] = f"token-{name}-{os.urandom(8).hex()}"
        store.add_device(name, hash_token(tokens[name]), time.time())
    store.close()
    return tokens


def upload_body(
    base_tensors: Mapping[str, np.ndarray], manifest: Manifest, num_samples: int | str = 10, **meta: Any
) -> bytes:
    """Safetensors bytes of an update, UploadMeta in `__metadata__` (override any field by keyword)."""
    fields = UploadMeta(manifest.base_layout_hash, 1, train_loss=0.5, val_accuracy=0.8).to_metadata()
    fields.update({"num_samples": str(num_samples)}, **{k: str(v) for k, v in meta.items()})
    return encode_tensors(base_tensors, fields)


class LiveServer(LocalServer):
    """`edgepfl serve` in a real uvicorn subprocess on loopback, logged to `<state>-server.log`; kill() is kill -9."""

    def __init__(self, bundle: Path, state: Path, *options: str, tls: tuple[Path, Path] | None = None):
        super().__init__(bundle, state, *options, log=state.parent / f"{state.name}-server.log", tls=tls)


class DeviceClient:
    """The device side of the protocol, as plain HTTP calls."""

    def __init__(self, url: str, token: str, verify: ssl.SSLContext | bool = True):
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0, verify=verify
        )

    def task(self) -> dict[str, Any]:
        """GET /v1/task (asserts 200)."""
        reply = self.http.get("/v1/task")
        assert reply.status_code == 200, reply.text
        return reply.json()

    def wait_for_train(self, timeout: float = 20.0) -> dict[str, Any]:
        """Poll until told to train."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            task = self.task()
            if task["action"] == "train":
                return task
            time.sleep(0.05)
        raise AssertionError(f"never told to train: {task}")

    def base(self, round_id: int) -> dict[str, np.ndarray]:
        """The base tensors of a round."""
        reply = self.http.get(f"/v1/rounds/{round_id}/base")
        assert reply.status_code == 200, reply.text
        return decode_tensors(reply.content)

    def upload(self, round_id: int, body: bytes, **kwargs: Any) -> httpx.Response:
        """POST an update body."""
        return self.http.post(
            f"/v1/rounds/{round_id}/update",
            content=body,
            headers={"Content-Type": "application/octet-stream"},
            **kwargs,
        )

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()


def wait_status(url: str, token: str, predicate, timeout: float = 20.0, verify: ssl.SSLContext | bool = True) -> dict:
    """Poll /v1/status until `predicate(status)` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}, verify=verify).json()
        if predicate(status):
            return status
        time.sleep(0.05)
    raise AssertionError(f"status never matched: {status}")


def weighted_mean(updates: list[tuple[dict[str, np.ndarray], int]]) -> dict[str, np.ndarray]:
    """The reference FedAvg aggregate, computed independently in float64."""
    total = sum(n for _, n in updates)
    names = updates[0][0].keys()
    return {name: sum(t[name].astype(np.float64) * n for t, n in updates) / total for name in names}


def app_routes(app: Any) -> list[Route]:
    """Every path route of an app in matching order, its included routers' too (FastAPI 0.138 keeps an included
    router as one entry of `app.routes`; earlier versions copy its routes there)."""
    found: list[Route] = []

    def walk(routes: list[Any]) -> None:
        for route in routes:
            included = getattr(route, "original_router", None)
            if included is not None:
                walk(included.routes)
            elif isinstance(route, Route):
                found.append(route)

    walk(app.routes)
    return found
