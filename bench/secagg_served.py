"""Secure aggregation served: the round engine's cost of a secure round next to a plain int8 round of the same base.

For n devices (in one process), on MobileNet x0.25's base at K_P 2 (as bench/secagg.py builds it): one round through
`edgepfl serve`'s RoundEngine (in-process, no HTTP) with --secure-aggregation, every message through the engine's
secure calls (server/engine.py), which check the round and the device, write the session's snapshot at each
step and log every accepted message in SQLite (fsync'd); and one plain round in which each device uploads its int8
delta (accept_update: decode, check, blob) and the engine aggregates. Measured: the engine's seconds in its calls
(the devices' own work is not counted), the seconds of the round's close (unmasking and aggregation, or reading
the uploads back and averaging), the largest size of the state folder's database during the round, and the
bytes each device sent. Deltas are synthetic (norm 0.3-1.0 of C = 1, sample counts 100-1000).

Prints JSON on stdout and a table on stderr.

Usage: python bench/secagg_served.py [--ns 10 50 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgepfl.encoding import Encoding, encode_delta
from edgepfl.kinds import ImageKind, InputSpec
from edgepfl.manifest import Manifest
from edgepfl.protocol import UploadMeta
from edgepfl.secagg import ClientSession, quantize_delta, to_json
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import RoundEngine, create_engine
from edgepfl.server.secure.steps import steps_of
from edgepfl.server.store import DB_NAME
from edgepfl.wire import decode_tensors, save_tensors

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def write_bundle(folder: Path) -> Manifest:
    """MobileNet x0.25 at K_P 2 as a bundle of a manifest and initial tensors (no graphs: the engine needs none)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from uploads import model_specs

    specs, _ = model_specs(0.25, 2)
    blocks = tuple(f"block{i}" for i in range(max(spec.block for spec in specs) + 1))
    manifest = Manifest(
        model={"name": "mobilenet"},
        kind=ImageKind(input=InputSpec(shape=(3, 32, 32))),
        num_classes=10,
        kp=2,
        blocks=blocks,
        tensors=tuple(specs),
    )
    manifest.save(folder)
    rng = np.random.default_rng(0)
    save_tensors(
        folder / "portable" / "initial.safetensors",
        {s.name: rng.normal(0, 0.05, s.shape).astype(s.dtype) for s in specs},
    )
    return manifest


def open_round(folder: Path, bundle: Path, names: list[str], **options) -> tuple[RoundEngine, Clock]:
    config = ServerConfig(bundle=bundle, state=folder, min_clients=3, round_timeout=3600, web=False, **options)
    clock = Clock()
    engine = create_engine(config, clock)
    engine.enroll_devices(names)
    for name in names:
        engine.task(name)
    return engine, clock


def deltas(engine: RoundEngine, names: list[str]) -> dict[str, tuple[dict[str, np.ndarray], int]]:
    rng = np.random.default_rng(1)
    out = {}
    for name in names:
        delta = {spec.name: rng.normal(size=spec.shape) for spec in engine.specs}
        norm = np.sqrt(sum(float(np.sum(v**2)) for v in delta.values()))
        scale = rng.uniform(0.3, 1.0) / norm
        out[name] = ({k: (v * scale).astype(np.float32) for k, v in delta.items()}, int(rng.integers(100, 1001)))
    return out


class Timed:
    """The engine's seconds in the calls made through it (its own, or its secure steps': "steps.book"), and the
    database's largest size."""

    def __init__(self, engine: RoundEngine):
        self.engine, self.seconds, self.db_bytes = engine, 0.0, 0

    def __call__(self, method: str, *args):
        target = steps_of(self.engine) if method.startswith("steps.") else self.engine
        start = time.perf_counter()
        result = getattr(target, method.removeprefix("steps."))(*args)
        self.seconds += time.perf_counter() - start
        folder = self.engine.config.state
        size = sum(path.stat().st_size for path in folder.glob(f"{DB_NAME}*"))
        self.db_bytes = max(self.db_bytes, size)
        return result


def secure_round(folder: Path, bundle: Path, names: list[str]) -> dict:
    options = {"secure": {"secure_aggregation": True, "secagg_clip": 1.0}}
    engine, _ = open_round(folder, bundle, names, **options)
    call, r, sent = Timed(engine), 1, dict.fromkeys(names, 0)

    def send(name: str, kind: str, body: bytes) -> None:
        sent[name] += len(body)
        call("steps.message", name, r, kind, body)

    context = steps_of(engine).task(names[0], r).context
    sessions = {name: ClientSession.start(name, context) for name in names}
    for name in names:
        send(name, "advert", to_json(sessions[name].advert()).encode())
    call("tick")
    for name in names:
        send(name, "shares", to_json(sessions[name].receive_book(call("steps.book", name, r))).encode())
    call("tick")
    for name, (delta, weight) in deltas(engine, names).items():
        vector = quantize_delta(delta, weight, sessions[name].book, np.random.default_rng(2))
        send(name, "masked", sessions[name].receive_inbox(call("steps.inbox", name, r), vector).to_bytes())
    call("tick")
    for name in names:
        send(name, "reveal", to_json(sessions[name].receive_unmask(call("steps.request", name, r))).encode())
    steps = call.seconds
    start = time.perf_counter()
    call("tick")  # the close: unmask, aggregate, commit
    close = time.perf_counter() - start
    summary = steps_of(engine).summary(r)
    assert engine.store.round(r).state == "closed", engine.store.round(r)
    engine.close()
    return {
        "mode": "secure",
        "n": len(names),
        "engine_steps_s": round(steps, 3),
        "close_s": round(close, 3),
        "db_max_bytes": call.db_bytes,
        "device_sent_bytes": round(float(np.mean(list(sent.values())))),
        "neighbours": summary["neighbours"],
        "bits": summary["bits"],
    }


def plain_round(folder: Path, bundle: Path, names: list[str]) -> dict:
    engine, _ = open_round(folder, bundle, names, round={"upload_encoding": "int8"})
    call, r, sent = Timed(engine), 1, []
    layout = engine.manifest.base_layout_hash
    for name, (delta, weight) in deltas(engine, names).items():
        meta = UploadMeta(layout, weight, train_loss=0.5, val_accuracy=0.5, val_loss=0.5)
        payload = encode_delta(delta, Encoding.parse("int8")).to_bytes(meta.to_metadata())
        sent.append(len(payload))
        call("accept_update", name, r, payload)
    steps = call.seconds
    start = time.perf_counter()
    call("tick")
    close = time.perf_counter() - start
    assert engine.store.round(r).state == "closed"
    decode_tensors(engine.store.blobs.read(engine.store.round(r).result_sha))
    engine.close()
    return {
        "mode": "plain int8",
        "n": len(names),
        "engine_steps_s": round(steps, 3),
        "close_s": round(close, 3),
        "db_max_bytes": call.db_bytes,
        "device_sent_bytes": round(float(np.mean(sent))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[10, 50, 200])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgepfl-secagg-served-") as tmp:
        bundle = Path(tmp) / "bundle"
        write_bundle(bundle)
        for n in args.ns:
            names = [f"phone-{i:04d}" for i in range(n)]
            rows.append(plain_round(Path(tmp) / f"plain-{n}", bundle, names))
            rows.append(secure_round(Path(tmp) / f"secure-{n}", bundle, names))
            print(json.dumps(rows[-2:]), file=sys.stderr)
    print(json.dumps({"rows": rows}, indent=1))
    print(f"{'mode':<11} {'n':>4} {'engine s':>9} {'close s':>8} {'db MB':>7} {'sent kB':>8}", file=sys.stderr)
    for row in rows:
        print(
            f"{row['mode']:<11} {row['n']:>4} {row['engine_steps_s']:>9.3f} {row['close_s']:>8.3f} "
            f"{row['db_max_bytes'] / 1e6:>7.2f} {row['device_sent_bytes'] / 1e3:>8.1f}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
