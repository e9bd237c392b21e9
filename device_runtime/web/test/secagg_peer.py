"""The Python side of secagg.test.mjs's live round: edgepfl's ServerSession and three Python devices, one step per
call, their states saved as JSON in DIR between calls (so every step also resumes from saved state).

Usage: python secagg_peer.py DIR STEP MESSAGE_JSON; prints JSON:
  keys ADVERT -> the key book;  shares BUNDLE -> the JavaScript device's inbox;
  masked {"upload": MaskedInput, "vector": [its plain ring vector]} -> the unmask request;
  unmask REVEAL -> {"exact": the sum equals the plain sum of the four vectors, "total_weight", "devices"}.
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
    KeyAdvert,
    KeyBook,
    MaskedInput,
    SecAggConfig,
    ServerSession,
    ShareBundle,
    UnmaskShares,
    VectorLayout,
    from_json,
    quantize_delta,
    to_json,
)
from tests.secagg_helpers import SHAPES, sample_delta  # noqa: E402

CONTEXT = "run-live/round-1"
PYTHON_DEVICES = ("py-a", "py-b", "py-c")


def main(folder: Path, step: str, message: str) -> dict:
    """Run one step; return what the JavaScript device gets next."""
    if step == "keys":
        server = ServerSession.start(
            CONTEXT, SecAggConfig(clip_norm=1.0, neighbours="all", max_weight=100), VectorLayout.of(SHAPES).size
        )
        clients = {d: ClientSession.start(d, CONTEXT) for d in PYTHON_DEVICES}
        for client in clients.values():
            server.receive_advert(client.advert())
        server.receive_advert(from_json(message, KeyAdvert))
        reply = to_json(server.close_keys())
    else:
        server = ServerSession.from_json((folder / "server.json").read_text())
        clients = {d: ClientSession.from_json((folder / f"{d}.json").read_text()) for d in PYTHON_DEVICES}
        book: KeyBook = server.book
    if step == "shares":
        for client in clients.values():
            server.receive_shares(client.receive_book(book))
        server.receive_shares(from_json(message, ShareBundle))
        inboxes = server.close_shares()
        reply = to_json(inboxes[next(d for d in inboxes if d not in PYTHON_DEVICES)])
    if step == "masked":
        data = json.loads(message)
        vectors = {
            d: quantize_delta(sample_delta(i), 20 + i, book, np.random.default_rng(i))
            for i, d in enumerate(PYTHON_DEVICES)
        }
        for device, client in clients.items():
            server.receive_masked(client.receive_inbox(server.inbox(device), vectors[device]))
        server.receive_masked(from_json(json.dumps(data["upload"]), MaskedInput))
        vectors[data["upload"]["device"]] = np.array(data["vector"], np.uint32)
        np.save(folder / "plain_sum.npy", sum(v.astype(np.int64) for v in vectors.values()) % (1 << book.plan.bits))
        reply = to_json(server.close_inputs())
    if step == "unmask":
        request = server.request
        for client in clients.values():
            server.receive_unmask(client.receive_unmask(request))
        reveal = from_json(message, UnmaskShares)
        server.receive_unmask(reveal)
        total = server.finish()
        summed = server.aggregate(VectorLayout.of(SHAPES))
        return {
            "exact": bool(np.array_equal(total, np.load(folder / "plain_sum.npy"))),
            "total_weight": summed.total_weight,
            "devices": len(request.survivors),
        }
    (folder / "server.json").write_text(server.to_json())
    for device, client in clients.items():
        (folder / f"{device}.json").write_text(client.to_json())
    return json.loads(reply)


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")))
