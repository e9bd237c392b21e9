"""The server side of secure_runner.test.mjs: `edgepfl serve`'s round engine over a state folder in DIR, with three
Python devices, one call per message of the page's device ("web-phone"). Each call opens the engine again from the
folder (its secure round's snapshot and log), so every step also resumes as after a server restart.

Usage: python secure_peer.py DIR STEP < ARGUMENT_JSON; prints JSON.
  open {"bundle"}               -> {"task": the page's task, "base": its base (base64)}
  send {"kind", "text"|"bytes"} -> the engine's receipt; the Python devices then send theirs, and the engine ticks
  fetch {"what"}                -> {"text": the book, inbox or unmask request, or null while its step is open}
  check {"delta", "weight"}     -> the round's state and counts, and how far its global base is from the weighted
                                   mean of the four devices' clipped deltas, next to what the rounding may add
"""

from __future__ import annotations

import base64
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from edgepfl.privacy import clip_delta  # noqa: E402
from edgepfl.secagg import ClientSession, quantize_delta, to_json  # noqa: E402
from edgepfl.secagg.config import levels, padded_size  # noqa: E402
from edgepfl.server.config import ServerConfig  # noqa: E402
from edgepfl.server.engine import create_engine  # noqa: E402
from edgepfl.server.secure.steps import steps_of  # noqa: E402
from edgepfl.server.tokens import issue_token  # noqa: E402
from edgepfl.wire import decode_tensors  # noqa: E402

PAGE = "web-phone"
PYTHON_DEVICES = {"py-a": 10, "py-b": 11, "py-c": 12}  # and their sample counts
CLIP, MAX_WEIGHT, NOW = 5.0, 30, 1_000_000.0


def main(folder: Path, step: str, argument: dict) -> dict:
    settings = json.loads((folder / "bundle.json").read_text()) if step != "open" else argument
    config = ServerConfig(
        bundle=settings["bundle"],
        state=folder / "state",
        min_clients=3,
        round_timeout=3600,
        secure={"secure_aggregation": True, "secagg_clip": CLIP, "secagg_max_weight": MAX_WEIGHT},
        web=False,
    )
    engine = create_engine(config, lambda: NOW)
    try:
        if step == "open":
            (folder / "bundle.json").write_text(json.dumps(argument))
            for name in (PAGE, *PYTHON_DEVICES):
                issue_token(engine.store, name, NOW)
            tasks = {name: engine.task(name) for name in (PAGE, *PYTHON_DEVICES)}
            tasks = {name: engine.task(name) for name in tasks}  # the round opened once all had polled
            for name in PYTHON_DEVICES:
                secure = tasks[name].secure_aggregation
                session = ClientSession.start(secure.device, secure.context)
                (folder / f"{name}.json").write_text(session.to_json())
            payload, _ = engine.base_for(PAGE, 1)
            return {"task": tasks[PAGE].to_json(), "base": base64.b64encode(payload).decode()}
        if step == "fetch":
            steps = steps_of(engine)
            message = {"book": steps.book, "inbox": steps.inbox, "unmask": steps.request}[argument["what"]](PAGE, 1)
            return {"text": None if message is None else to_json(message)}
        if step == "send":
            body = base64.b64decode(argument["bytes"]) if "bytes" in argument else argument["text"].encode()
            receipt = steps_of(engine).message(PAGE, 1, argument["kind"], body)
            for name in PYTHON_DEVICES:
                python_device(engine, folder, name, argument["kind"])
            engine.tick()
            return receipt
        return check(engine, folder, argument)
    finally:
        engine.close()


def python_device(engine, folder: Path, name: str, kind: str) -> None:
    """A Python device's message of the step the page just took (its session saved in FOLDER between calls)."""
    session = ClientSession.from_json((folder / f"{name}.json").read_text())
    if kind == "advert":
        body = to_json(session.advert()).encode()
    elif kind == "shares":
        body = to_json(session.receive_book(steps_of(engine).book(name, 1))).encode()
    elif kind == "masked":
        vector = quantize_delta(delta_of(engine, name), PYTHON_DEVICES[name], session.book, np.random.default_rng(1))
        body = session.receive_inbox(steps_of(engine).inbox(name, 1), vector).to_bytes()
    else:
        body = to_json(session.receive_unmask(steps_of(engine).request(name, 1))).encode()
    steps_of(engine).message(name, 1, kind, body)
    (folder / f"{name}.json").write_text(session.to_json())


def delta_of(engine, name: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sorted(PYTHON_DEVICES).index(name))
    return {spec.name: rng.normal(0, 0.01, spec.shape).astype(np.float32) for spec in engine.specs}


def check(engine, folder: Path, argument: dict) -> dict:
    """The round's state and counts; the distance of its base from the four devices' weighted mean, and the bound."""
    record = engine.store.round(1)
    base = decode_tensors(engine.store.blobs.read(record.base_sha))
    page = {
        name: np.asarray(values, np.float32).reshape(base[name].shape) for name, values in argument["delta"].items()
    }
    deltas = {**{name: delta_of(engine, name) for name in PYTHON_DEVICES}, PAGE: page}
    weights = {**PYTHON_DEVICES, PAGE: min(argument["weight"], MAX_WEIGHT)}
    total = sum(weights.values())
    clipped = {name: clip_delta(delta, CLIP) for name, delta in deltas.items()}
    result = engine.global_base()
    error = math.sqrt(
        sum(
            float(
                np.sum(
                    (result[t] - base[t] - sum(weights[d] * clipped[d][t].astype(np.float64) for d in deltas) / total)
                    ** 2
                )
            )
            for t in base
        )
    )
    size = padded_size(sum(value.size for value in base.values()))
    summary = steps_of(engine).summary(1)
    step = 4 * CLIP / math.sqrt(size) / levels(summary["devices"], summary["bits"])
    bound = len(deltas) * step * math.sqrt(size) * MAX_WEIGHT / total
    return {
        "state": record.state,
        "masked": summary["masked"],
        "dropped": summary["dropped"],
        "error": error,
        "bound": bound,
        "uploads": len(engine.store.updates(1)),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2], json.loads(sys.stdin.read()))))
