"""The device's state folder: its tensors, the last completed round, and an update not yet delivered.

`state.json` is the single commit point. Tensor files are written first under new names
(`tensors-<n>.safetensors`, `upload-r<round>.safetensors`), each atomically, and only then does
an atomic rewrite of `state.json` name them; files it no longer names are removed afterwards.
A `kill -9` at any moment therefore leaves either the previous state or the new one.

Optimizer state: the engines train with plain SGD, which has none. An ORT bundle exported with
AdamW keeps its moments in the ORT checkpoint only while the process runs; they are not persisted
here and restart from zero after a restart (recorded in `state.json` as `optimizer_state`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np

from edgepfl.atomic import sha256_file, write_bytes_atomic, write_text_atomic
from edgepfl.encoding import drop_residuals_after
from edgepfl.errors import StateError
from edgepfl.manifest import Manifest
from edgepfl.wire import WireError, check_tensors, decode_tensors, encode_tensors, nonfinite_names

STATE_NAME = "state.json"
STATE_SCHEMA = 1
HISTORY_LIMIT = 1000  # rounds kept in state.json


@dataclass(frozen=True)
class PendingUpload:
    """A trained round whose upload body is saved but not yet acknowledged by the server."""

    round_id: int
    file: str  # name inside the state folder
    sha256: str
    deadline: float | None = None  # unix seconds after which the server refuses it (the task's), when known


@dataclass(frozen=True)
class DeviceState:
    """What `state.json` says; tensors live in the file it names."""

    base_layout_hash: str
    model: dict[str, Any]
    engine: str
    optimizer_state: str
    tensors_file: str | None = None
    tensors_sha256: str | None = None
    generation: int = 0  # bumped on every commit; names the next tensors file
    last_completed_round: int | None = None  # last round trained and saved
    last_uploaded_round: int | None = None  # last round the server acknowledged
    pending_upload: PendingUpload | None = None
    history: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # per-round / per-run metrics

    def to_json(self) -> dict[str, Any]:
        """JSON form of state.json."""
        return {
            "schema_version": STATE_SCHEMA,
            "base_layout_hash": self.base_layout_hash,
            "model": self.model,
            "engine": self.engine,
            "optimizer_state": self.optimizer_state,
            "tensors_file": self.tensors_file,
            "tensors_sha256": self.tensors_sha256,
            "generation": self.generation,
            "last_completed_round": self.last_completed_round,
            "last_uploaded_round": self.last_uploaded_round,
            "pending_upload": None if self.pending_upload is None else vars(self.pending_upload),
            "history": list(self.history),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceState:
        """Parse state.json."""
        pending = data.get("pending_upload")
        return cls(
            base_layout_hash=str(data["base_layout_hash"]),
            model=dict(data.get("model", {})),
            engine=str(data.get("engine", "")),
            optimizer_state=str(data.get("optimizer_state", "")),
            tensors_file=data.get("tensors_file"),
            tensors_sha256=data.get("tensors_sha256"),
            generation=int(data.get("generation", 0)),
            last_completed_round=_optional_int(data.get("last_completed_round")),
            last_uploaded_round=_optional_int(data.get("last_uploaded_round")),
            pending_upload=None
            if pending is None
            else PendingUpload(
                int(pending["round_id"]), str(pending["file"]), str(pending["sha256"]), _optional_float(pending)
            ),
            history=tuple(data.get("history", ())),
        )


class StateFolder:
    """One device's `--state` folder, bound to one bundle's base layout."""

    def __init__(self, folder: str | os.PathLike, manifest: Manifest, engine_name: str):
        self.folder = Path(folder)
        self.manifest = manifest
        if self.folder.exists() and not self.folder.is_dir():
            raise StateError(f"--state {self.folder} is not a folder", "pass a folder for the device state")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock_handle = _lock_folder(self.folder)
        self.state = self._read_or_new(engine_name)
        self._remove_unreferenced()
        # a residual of a round after the last committed one was encoded, then the device died before the commit
        drop_residuals_after(self.residuals, self.state.last_completed_round)

    @property
    def path(self) -> Path:
        """The state.json file."""
        return self.folder / STATE_NAME

    @property
    def residuals(self) -> Path:
        """The folder of error-feedback residuals, one file per round (edgepfl.encoding.encode_round_upload)."""
        return self.folder / "residuals"

    @property
    def kept(self) -> str:
        """How a refusal names the model it keeps: the state of round N, the saved state, or the initial model."""
        if self.state.tensors_file is None:
            return "the bundle's initial model"
        last = self.state.history[-1] if self.state.history else {}
        if last.get("round") is not None and not last.get("final"):
            return f"the state of round {last['round']}"
        return "the saved state"

    def load_tensors(self) -> dict[str, np.ndarray] | None:
        """The saved tensors (every param and buffer), checked against sha256 and the manifest; None when fresh."""
        return _read_tensors(self.folder, self.state, self.manifest)

    def pending_payload(self) -> bytes | None:
        """The saved upload body of the pending round, checked against its sha256."""
        pending = self.state.pending_upload
        if pending is None:
            return None
        path = self.folder / pending.file
        try:
            payload = path.read_bytes()
        except OSError as exc:
            raise StateError(f"cannot read {path} ({exc.strerror})", "remove the --state folder") from None
        if _sha256(payload) != pending.sha256:
            raise StateError(f"{path} does not match its sha256 in {self.path}", "remove the --state folder")
        return payload

    def commit(
        self,
        tensors: Mapping[str, np.ndarray],
        record: dict[str, Any],
        round_id: int | None = None,
        upload_payload: bytes | None = None,
    ) -> None:
        """Save tensors and metrics atomically; with `round_id`, mark the round completed (and its upload pending).

        Tensors holding NaN or Inf are refused (StateError) and nothing changes: a state folder stays usable.
        """
        bad = nonfinite_names(tensors)
        if bad:
            raise StateError(
                f"refused to save a model holding NaN or Inf in {bad[0]!r}: kept {self.kept}",
                "training diverged; lower the learning rate",
            )
        generation = self.state.generation + 1
        tensors_file = f"tensors-{generation:06d}.safetensors"
        tensors_bytes = encode_tensors(tensors)
        write_bytes_atomic(self.folder / tensors_file, tensors_bytes)
        changes: dict[str, Any] = {
            "generation": generation,
            "tensors_file": tensors_file,
            "tensors_sha256": _sha256(tensors_bytes),
            "history": (*self.state.history, _finite(record))[-HISTORY_LIMIT:],
        }
        if round_id is not None:
            changes["last_completed_round"] = round_id
            changes["pending_upload"] = None
            if upload_payload is not None:
                upload_file = f"upload-r{round_id:06d}.safetensors"
                write_bytes_atomic(self.folder / upload_file, upload_payload)
                changes["pending_upload"] = PendingUpload(round_id, upload_file, _sha256(upload_payload))
        self._write(replace(self.state, **changes))

    def settle_upload(self, round_id: int, delivered: bool) -> None:
        """The pending upload of `round_id` was acknowledged (delivered) or its round closed (dropped)."""
        pending = self.state.pending_upload
        if pending is None or pending.round_id != round_id:
            return
        history = tuple(
            {**entry, "upload": "delivered" if delivered else "dropped"} if entry.get("round") == round_id else entry
            for entry in self.state.history
        )
        last_uploaded = round_id if delivered else self.state.last_uploaded_round
        self._write(replace(self.state, pending_upload=None, last_uploaded_round=last_uploaded, history=history))

    def keep_deadline(self, round_id: int, deadline: float) -> None:
        """Record the pending upload's deadline, so that a device that restarts in an outage knows when to give up."""
        pending = self.state.pending_upload
        if pending is not None and pending.round_id == round_id and pending.deadline != deadline:
            self._write(replace(self.state, pending_upload=replace(pending, deadline=deadline)))

    def _write(self, new_state: DeviceState) -> None:
        write_text_atomic(self.path, json.dumps(new_state.to_json(), indent=2) + "\n")
        self.state = new_state
        self._remove_unreferenced()

    def close(self) -> None:
        """Release the folder's lock (also released when the process ends, even by kill -9)."""
        if self._lock_handle is not None:
            self._lock_handle.close()
            self._lock_handle = None

    def _remove_unreferenced(self) -> None:
        """Tensor files state.json no longer names (older generations) and temp files a crash left behind."""
        keep = {self.state.tensors_file, self.state.pending_upload.file if self.state.pending_upload else None}
        for path in self.folder.iterdir():
            stale_tensors = path.suffix == ".safetensors" and path.name not in keep
            stale_temp = path.name.startswith(".") and path.name.endswith(".tmp")
            if stale_tensors or stale_temp:
                path.unlink(missing_ok=True)

    def _read_or_new(self, engine_name: str) -> DeviceState:
        manifest = self.manifest
        if not self.path.is_file():
            return DeviceState(
                base_layout_hash=manifest.base_layout_hash,
                model=manifest.model,
                engine=engine_name,
                optimizer_state=optimizer_state_note(manifest),
            )
        try:
            state = DeviceState.from_json(json.loads(self.path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise StateError(
                f"{self.path} cannot be read ({exc!r})", "remove the --state folder to start over"
            ) from None
        _check_layout(state, manifest, self.folder)
        return replace(state, engine=engine_name, optimizer_state=optimizer_state_note(manifest))


def read_saved_model(
    folder: str | os.PathLike, manifest: Manifest, attempts: int = 3
) -> tuple[DeviceState | None, dict[str, np.ndarray] | None]:
    """What a state folder holds now, read without its lock and without changing anything, so that a running
    `device run` may keep it: (its state, its tensors), or (None, None) where there is no state yet.

    A commit replaces the tensors file after state.json names the new one: a file gone between the two reads is
    read again from the new state.json."""
    for attempt in range(attempts):
        state = read_state(folder)
        if state is None:
            return None, None
        _check_layout(state, manifest, Path(folder))
        try:
            return state, _read_tensors(Path(folder), state, manifest)
        except StateError:
            if attempt == attempts - 1 or (Path(folder) / (state.tensors_file or "")).is_file():
                raise
    raise AssertionError("unreachable")


def read_state(folder: str | os.PathLike) -> DeviceState | None:
    """state.json as it is now, read without the folder's lock or a bundle; None where there is no state yet."""
    path = Path(folder) / STATE_NAME
    if not path.is_file():
        return None
    try:
        return DeviceState.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise StateError(f"{path} cannot be read ({exc!r})", "remove the --state folder to start over") from None


def _read_tensors(folder: Path, state: DeviceState, manifest: Manifest) -> dict[str, np.ndarray] | None:
    """The tensors file `state` names, checked against its sha256 and the manifest; None when it names none."""
    if state.tensors_file is None:
        return None
    path = folder / state.tensors_file
    state_path = folder / STATE_NAME
    try:
        if sha256_file(path) != state.tensors_sha256:
            raise StateError(f"{path} does not match its sha256 in {state_path}", "remove the --state folder")
        tensors = decode_tensors(path.read_bytes())
        check_tensors(tensors, manifest.tensors, what=f"saved state {path.name}")
    except OSError as exc:
        raise StateError(f"cannot read {path} ({exc.strerror})", "remove the --state folder") from None
    except WireError as exc:
        raise StateError(str(exc), "remove the --state folder") from None
    return tensors


def _check_layout(state: DeviceState, manifest: Manifest, folder: Path) -> None:
    """A state folder belongs to one bundle's base layout."""
    if state.base_layout_hash != manifest.base_layout_hash:
        raise StateError(
            f"the state in {folder} belongs to a bundle with base_layout_hash {state.base_layout_hash[:12]}…, "
            f"this bundle has {manifest.base_layout_hash[:12]}…",
            "pass the bundle this state was made with, or a new --state folder",
        )


def optimizer_state_note(manifest: Manifest) -> str:
    """What optimizer state exists and whether it survives a restart."""
    optimizer = str(manifest.engines.get("ort-training", {}).get("optimizer", "sgd")).lower()
    if optimizer == "sgd":
        return "none: plain SGD keeps no optimizer state"
    return f"{optimizer}: moments live in the ORT checkpoint while the process runs; not persisted, reset on restart"


def _lock_folder(folder: Path) -> IO[bytes] | None:
    """An exclusive lock on the folder, so two device processes never share one state."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; one process per folder is the user's job there
        return None
    handle = open(folder / ".lock", "ab")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise StateError(
            f"another edgepfl device process is using the state folder {folder}", "stop it, or pass another --state"
        ) from None
    return handle


def _sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def _finite(record: Mapping[str, Any]) -> dict[str, Any]:
    """JSON has no NaN: floats that are not finite become null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_float(pending: dict[str, Any]) -> float | None:
    """A pending upload's deadline; state.json written before deadlines were kept has none."""
    value = pending.get("deadline")
    return None if value is None else float(value)
