"""A device's secure round (docs/secure-aggregation.md): instead of uploading its update, the device masks it.

`round.train_round` trains the round and commits it as in any round, the round's upload body saved as pending:
with secure aggregation that body is the delta clipped to the round's clip norm (fp32, with the sample count in
its metadata), and it never leaves the device. Then `deliver` takes the protocol's steps against the server
(`ServerClient.secure_send` / `secure_fetch`): advertise keys, get the key book, send the sealed shares, get the
share inbox, quantize the delta with the book (`ring_vector`) and send it masked, get the unmask request, reveal.

Durable: the protocol session (its private keys, the shares it holds for others, what it answered) is
`secagg-r<round>.json` in the state folder, private (0600): made before the round trains (`begin`), so a device
killed before its commit trains again with the same keys, and written after each step, before the step's message
is sent. A device killed at any step reads it and takes the steps again from the first: it answers the same
server message with the same message (the same sealed shares; the same masked vector, the rounding seeded by the
device's seed and the round), and the server acknowledges a message it already holds as a duplicate, so nothing
is counted twice. The file is deleted when the round is over for the device (delivered, or dropped).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgepfl.atomic import write_bytes_atomic
from edgepfl.encoding import Encoding, decode_payload
from edgepfl.errors import SecAggError, StateError
from edgepfl.protocol import SecureTask, UploadMeta
from edgepfl.secagg import ClientSession, KeyBook, ShareInbox, UnmaskRequest, from_json, quantize_delta, to_json
from edgepfl.wire import decode_metadata

SESSION_FILE = "secagg-r{round:06d}.json"
STEPS = ("book", "inbox", "unmask")  # what the device fetches, in order; it answers each (`answer`)


class SecureTransport(Protocol):
    """How the device reaches the server's secure steps (device_runtime.client.ServerClient)."""

    def secure_send(self, url: str, kind: str, body: bytes) -> dict[str, Any]:
        """POST a message."""

    def secure_fetch(self, url: str, what: str) -> tuple[str | None, float]:
        """GET the step's data, or (None, seconds to wait)."""


def begin(folder: Path, task: SecureTask, round_id: int) -> None:
    """Make the round's session (fresh keys) unless it exists, before the round trains; sessions of other rounds (a
    device killed before committing a round that did not come back) go."""
    for path in Path(folder).glob("secagg-r*.json"):
        if path.name != SESSION_FILE.format(round=round_id):
            path.unlink(missing_ok=True)
    if not session_path(folder, round_id).is_file():
        _save(folder, round_id, task.url, ClientSession.start(task.device, task.context))


def holds(folder: Path, round_id: int) -> bool:
    """Whether the device takes a secure round's steps for `round_id` (its pending upload stays on the device)."""
    return session_path(folder, round_id).is_file()


def forget(folder: Path, round_id: int | None = None) -> None:
    """Delete the round's session (every round's with None): its private keys and shares are no longer needed."""
    for path in folder.glob("secagg-r*.json"):
        if round_id is None or path.name == SESSION_FILE.format(round=round_id):
            path.unlink(missing_ok=True)


def deliver(
    folder: Path,
    round_id: int,
    payload: bytes,
    transport: SecureTransport,
    seed: int,
    sleep: Callable[[float], None],
) -> None:
    """Take the round's steps with the pending upload `payload` (module docstring).

    A refusal that ends the round for this device (RoundGone) propagates; so does a server message the device
    refuses (SecAggError: the device then drops out of the round, and the round goes on without it if it can).
    """
    url, _ = _load(folder, round_id)
    transport.secure_send(url, "advert", advert(folder, round_id))
    for step in STEPS:
        kind, body = answer(folder, round_id, step, _wait(transport, url, step, sleep), payload, seed)
        transport.secure_send(url, kind, body)


def advert(folder: Path, round_id: int) -> bytes:
    """The device's KeyAdvert (JSON) for the round."""
    _, session = _load(folder, round_id)
    return to_json(session.advert()).encode()


def answer(folder: Path, round_id: int, step: str, text: str, payload: bytes, seed: int) -> tuple[str, bytes]:
    """The device's answer to the server's message of a step (book, inbox or unmask; JSON `text`): the kind and body
    of what it sends (shares, masked or reveal), its session saved first. The same message gets the same answer."""
    url, session = _load(folder, round_id)
    if step == "book":
        reply = ("shares", to_json(session.receive_book(from_json(text, KeyBook))).encode())
    elif step == "inbox":  # asked again after a crash, the same (seeded) vector is masked alike
        vector = ring_vector(payload, session.book, seed, round_id)
        reply = ("masked", session.receive_inbox(from_json(text, ShareInbox), vector).to_bytes())
    elif step == "unmask":
        reply = ("reveal", to_json(session.receive_unmask(from_json(text, UnmaskRequest))).encode())
    else:
        raise ValueError(f"unknown secure step {step!r}")
    _save(folder, round_id, url, session)
    return reply


def ring_vector(payload: bytes, book: KeyBook, seed: int, round_id: int) -> np.ndarray:
    """The device's clipped delta and sample count (its pending upload body) as the key book's ring vector, rounded
    stochastically from a generator seeded by (seed, round): the same vector whenever it is made again."""
    meta = UploadMeta.from_metadata(decode_metadata(payload))
    delta = decode_payload(payload, Encoding.parse("fp32"), "the saved update")
    return quantize_delta(delta, meta.num_samples, book, np.random.default_rng([seed, round_id]))


def session_path(folder: Path, round_id: int) -> Path:
    """Where the round's session is kept."""
    return Path(folder) / SESSION_FILE.format(round=round_id)


def _wait(transport: SecureTransport, url: str, what: str, sleep: Callable[[float], None]) -> str:
    """The step's data once the server has it (it closes each step by a deadline, so this ends)."""
    while True:
        text, wait = transport.secure_fetch(url, what)
        if text is not None:
            return text
        sleep(wait)


def _save(folder: Path, round_id: int, url: str, session: ClientSession) -> None:
    """Write the session before what its step returned is sent (private: it holds private keys)."""
    document = {"round": round_id, "url": url, "session": session.to_json()}
    write_bytes_atomic(session_path(folder, round_id), json.dumps(document).encode(), mode=0o600)


def _load(folder: Path, round_id: int) -> tuple[str, ClientSession]:
    path = session_path(folder, round_id)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        return str(document["url"]), ClientSession.from_json(document["session"])
    except (OSError, ValueError, KeyError, TypeError, SecAggError):
        raise StateError(f"{path} cannot be read", f"delete {path.name}: the device rejoins the next round") from None
