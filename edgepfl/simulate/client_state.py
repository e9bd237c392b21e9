"""A simulated run's client state: every client's tensors after the last trained round, and that round's training
numbers (for its record), in one safetensors file under --out, so an interrupted run resumes where it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgepfl.atomic import write_bytes_atomic
from edgepfl.errors import StateError
from edgepfl.wire import decode_metadata, decode_tensors, encode_tensors

if TYPE_CHECKING:
    from edgepfl.simulate.loop import Client


def save_state(path: Path, round_id: int, clients: list[Client], pending: dict[str, Any]) -> None:
    """Every client's tensors after training `round_id`, and the round's training numbers (for its record)."""
    tensors = {f"{client.name}/{name}": value for client in clients for name, value in client.tensors.items()}
    metadata = {"round": str(round_id), "pending": json.dumps(pending)}
    write_bytes_atomic(path, encode_tensors(tensors, metadata=metadata))


def load_state(path: Path, clients: list[Client]) -> tuple[int, dict[str, Any] | None]:
    """The round the saved client tensors were trained through (loaded into `clients`) and its training numbers."""
    payload = path.read_bytes()
    metadata = decode_metadata(payload)
    try:
        done = int(metadata["round"])
        pending = json.loads(metadata["pending"]) if "pending" in metadata else None
    except (KeyError, ValueError):
        raise StateError(f"{path} does not say which round it holds", "delete the run folder and start again") from None
    tensors = decode_tensors(payload)
    try:
        for client in clients:
            client.tensors = {name: tensors[f"{client.name}/{name}"] for name in client.tensors}
    except KeyError as missing:
        raise StateError(f"{path} lacks tensor {missing}", "resume with the same options or use a new --out") from None
    return done, pending
