"""Secure-aggregation fixtures for secagg.test.mjs, written by edgepfl.secagg (called by make_fixtures.py).

Writes OUT/secagg.json: X25519 public keys and HKDF outputs, AES-CTR mask vectors, packed vectors, Shamir shares
from given coefficient bytes, an AES-GCM message, quantized vectors (to nearest and stochastic), and the
transcript of a SecAgg+ round of 6 devices (k = 2, one device drops after sharing) with every random byte that
device phone-002 drew, so the JavaScript client can replay it and must send the same bytes.
Usage: python device_runtime/web/test/make_secagg_fixtures.py OUT_DIR (needs only numpy and cryptography).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from edgepfl.secagg import (  # noqa: E402
    ClientSession,
    SecAggConfig,
    ServerSession,
    keys,
    quantize_delta,
    shamir,
    to_json,  # noqa: E402
)
from edgepfl.secagg.messages import b64  # noqa: E402
from edgepfl.secagg.ring import mask_vector, pack  # noqa: E402
from tests.secagg_helpers import SHAPES, sample_delta, seeded_bytes  # noqa: E402

CONTEXT = "run-web/round-2"
PLAYED = "phone-002"  # the device the JavaScript client replays


def main(out: Path) -> None:
    """Write secagg.json into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    fixtures = {"primitives": primitives(), **round_transcript()}
    (out / "secagg.json").write_text(json.dumps(fixtures, indent=1))


def primitives() -> dict:
    """Inputs and Python's outputs of each building block."""
    random = seeded_bytes(11)
    a, b = keys.new_private_key(random), keys.new_private_key(random)
    shared = keys.agree(a, keys.public_key(b), "b")
    seed = bytes(range(32))
    values = np.random.default_rng(3).integers(0, 1 << 12, 29).astype(np.uint32)
    coefficient_bytes = [random(32) for _ in range(2)]
    secret = random(32)
    queue = list(coefficient_bytes)
    shares = shamir.split(secret, [1, 2, 4, 7], 3, lambda n: queue.pop(0))
    nonce = random(12)
    sealed = keys.encrypt(
        keys.derive(shared, "share", CONTEXT, "a", "b"),
        b"two shares",
        keys.info("share", CONTEXT, "a", "b"),
        lambda n: nonce,
    )
    return {
        "private": [b64(a), b64(b)],
        "public": [b64(keys.public_key(a)), b64(keys.public_key(b))],
        "shared": b64(shared),
        "derived": b64(keys.derive(shared, "mask", CONTEXT, "phone-000", "phone-001")),
        "mask_seed": b64(seed),
        "mask_32": mask_vector(seed, 37).tolist(),
        "mask_12": mask_vector(seed, 37, 12).tolist(),
        "pack_values": values.tolist(),
        "packed_12": b64(pack(values, 12)),
        "packed_10": b64(pack(values & 1023, 10)),
        "secret": b64(secret),
        "coefficients": [b64(c) for c in coefficient_bytes],
        "shares": {str(x): b64(s) for x, s in shares.items()},
        "nonce": b64(nonce),
        "sealed": b64(sealed),
        "plaintext": b64(b"two shares"),
    }


def round_transcript() -> dict:
    """A SecAgg+ round in Python; every message to and from PLAYED, and the random bytes it drew."""
    # a measured weight scale (W = 12.5, the weights 10-15 around it): each device's (w / W) delta is clipped to C
    # (0.35: the replayed device's contribution, 0.37, is clipped)
    config = SecAggConfig(clip_norm=0.35, neighbours=2, max_weight=100, weight_scale=12.5)
    devices = [f"phone-{i:03d}" for i in range(6)]
    drawn: list[str] = []

    def recording(seed: int):
        source = seeded_bytes(seed)

        def draw(count: int) -> bytes:
            chunk = source(count)
            drawn.append(b64(chunk))
            return chunk

        return draw

    randomness = {d: recording(i) if d == PLAYED else seeded_bytes(i) for i, d in enumerate(devices)}
    size = sum(int(np.prod(s)) for s in SHAPES.values())
    server = ServerSession.start(CONTEXT, config, size, randomness=bytes(range(100, 132)))
    clients = {d: ClientSession.start(d, CONTEXT, randomness[d]) for d in devices}
    for client in clients.values():
        server.receive_advert(client.advert())
    book = server.close_keys()
    bundles = {d: c.receive_book(book, randomness[d]) for d, c in clients.items()}
    # masks are added towards higher indices and subtracted towards lower ones: the replay must meet both
    assert min(book.neighbours[PLAYED]) < PLAYED < max(book.neighbours[PLAYED]), "pick another PLAYED device"
    dropped = book.neighbours[PLAYED][0]  # a partner of the replayed device: it reveals a mask-key share
    for bundle in bundles.values():
        server.receive_shares(bundle)
    inboxes = server.close_shares()
    deltas = {d: sample_delta(i) for i, d in enumerate(devices)}
    vectors = {d: quantize_delta(deltas[d], 10 + i, book, np.random.default_rng([5, i])) for i, d in enumerate(devices)}
    masked = {d: clients[d].receive_inbox(inboxes[d], vectors[d]) for d in devices if d != dropped}
    for upload in masked.values():
        server.receive_masked(upload)
    request = server.close_inputs()
    reveals = {d: clients[d].receive_unmask(request) for d in request.survivors}
    for reveal in reveals.values():
        server.receive_unmask(reveal)
    total = server.finish()
    played = devices.index(PLAYED)
    return {
        "quantize": {
            "delta": {
                name: {"shape": list(value.shape), "data": value.ravel().tolist()}
                for name, value in deltas[PLAYED].items()
            },
            "weight": 10 + played,
            "entropy": [5, played],
            "stochastic": vectors[PLAYED].tolist(),
            "nearest": quantize_delta(deltas[PLAYED], 10 + played, book, None).tolist(),
        },
        "round": {
            "device": PLAYED,
            "context": CONTEXT,
            "random": drawn,
            "dropped": dropped,
            "graph_seed": b64(book.seed),
            "neighbours": {d: list(n) for d, n in book.neighbours.items()},
            "advert": to_json(clients[PLAYED].advert()),
            "book": to_json(book),
            "bundle": to_json(bundles[PLAYED]),
            "inbox": to_json(inboxes[PLAYED]),
            "masked": to_json(masked[PLAYED]),
            "request": to_json(request),
            "reveal": to_json(reveals[PLAYED]),
            "state": clients[PLAYED].to_json(),
            "sum": total.tolist(),
            "plain_sum": (sum(vectors[d].astype(np.int64) for d in request.survivors) % (1 << book.plan.bits)).tolist(),
        },
    }


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_secagg_fixtures.py OUT_DIR")
    main(Path(sys.argv[1]))
