"""The wire and disk format for tensors: safetensors bytes (no pickle anywhere)."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as _st_load
from safetensors.numpy import save as _st_save

from edgepfl.atomic import write_bytes_atomic
from edgepfl.errors import WireError
from edgepfl.manifest import TensorSpec

MAX_HEADER_BYTES = 16 * 1024 * 1024  # names, dtypes, shapes and offsets: about 100 bytes a tensor
MAX_HEADER_DEPTH = 3  # {"name": {"shape": [...]}} is as deep as a valid header goes


def encode_tensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialise named numpy arrays to safetensors bytes (C-contiguous copies where needed); the same tensors and
    metadata always give the same bytes."""
    contiguous = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    payload = _st_save(contiguous, metadata=dict(metadata) if metadata else None)
    return _sorted_metadata(payload) if metadata and len(metadata) > 1 else payload


def decode_tensors(payload: bytes) -> dict[str, np.ndarray]:
    """Parse safetensors bytes; malformed input raises WireError, never a library traceback."""
    read_header(payload)  # size, nesting and duplicate names: checks the library does not make
    return decode_body(payload)


def decode(payload: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse safetensors bytes into their tensors and their `__metadata__` string map (WireError if malformed)."""
    metadata = header_metadata(read_header(payload))
    return decode_body(payload), metadata


def decode_body(payload: bytes) -> dict[str, np.ndarray]:
    """The tensors of safetensors bytes whose header `read_header` has already checked."""
    try:
        return dict(_st_load(payload))
    except Exception as exc:  # safetensors raises its own error types and ValueError on bad headers
        raise WireError(
            f"the tensor payload is not valid safetensors ({type(exc).__name__}: {str(exc)[:120]})",
            "send the bytes produced by safetensors.numpy.save",
        ) from None


def read_header(payload: bytes) -> dict[str, Any]:
    """The JSON header of safetensors bytes, its size and nesting bounded before it is parsed (WireError).

    Refuses what both `json` and the safetensors library would take or choke on: a header nested
    deeper than a valid one (Python's parser recurses per level), and a tensor named twice (JSON
    parsers keep the last entry, so the bytes would say two things).
    """
    if len(payload) < 8:
        raise WireError("the tensor payload is shorter than a safetensors header", "send safetensors bytes")
    header_len = int.from_bytes(payload[:8], "little")
    if header_len > len(payload) - 8:
        raise WireError("the safetensors header length is out of range", "send safetensors bytes")
    if header_len > MAX_HEADER_BYTES:
        raise WireError(
            f"the safetensors header is {header_len} bytes, over the limit of {MAX_HEADER_BYTES}",
            "send fewer tensors or shorter metadata",
        )
    raw = payload[8 : 8 + header_len]
    depth = _nesting_depth(raw)
    if depth > MAX_HEADER_DEPTH:
        raise WireError(
            f"the safetensors header is nested {depth} levels deep, a valid one at most {MAX_HEADER_DEPTH}",
            "send the bytes produced by safetensors.numpy.save",
        )
    try:
        header = json.loads(raw, object_pairs_hook=_refuse_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WireError("the safetensors header is not JSON", "send safetensors bytes") from None
    if not isinstance(header, dict):
        raise WireError("the safetensors header is not a JSON object", "send safetensors bytes")
    return header


class StoredTensors(Mapping[str, np.ndarray]):
    """The tensors of a safetensors file, each read from disk when asked for (none held in memory).

    For aggregations that need every device's copy of one tensor at once (median, trimmed mean): they
    hold O(devices x largest tensor) instead of O(devices x model). The file must not change while
    this mapping is in use (the server's blobs are content-addressed and written once).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with self._open() as handle:
            self._names = list(handle.keys())

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        with self._open() as handle:
            return handle.get_tensor(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def _open(self):
        from safetensors import safe_open

        try:
            return safe_open(self.path, framework="numpy")
        except Exception as exc:  # safetensors raises its own error types on a bad header
            raise WireError(
                f"{self.path.name} is not valid safetensors ({type(exc).__name__}: {str(exc)[:120]})",
                "send the bytes produced by safetensors.numpy.save",
            ) from None


def decode_metadata(payload: bytes) -> dict[str, str]:
    """The string map in a safetensors header's `__metadata__` (empty when absent)."""
    return header_metadata(read_header(payload))


def header_metadata(header: Mapping[str, Any]) -> dict[str, str]:
    """The string map `__metadata__` of a parsed safetensors header (empty when absent)."""
    metadata = header.get("__metadata__")
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise WireError("safetensors __metadata__ must map strings to strings", "send string metadata")
    return metadata


def save_tensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> str:
    """Write tensors atomically to a .safetensors file; returns the sha256 of the bytes written."""
    payload = encode_tensors(tensors)
    write_bytes_atomic(path, payload)
    return hashlib.sha256(payload).hexdigest()


def load_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a .safetensors file."""
    try:
        payload = Path(path).read_bytes()
    except OSError as exc:
        raise WireError(f"cannot read {path} ({exc.strerror})", "check the path") from None
    return decode_tensors(payload)


def check_tensors(tensors: Mapping[str, np.ndarray], expected: Iterable[TensorSpec], what: str = "upload") -> None:
    """Exact name set, shapes, dtypes and finite values against the manifest's specs."""
    specs = {spec.name: spec for spec in expected}
    missing = sorted(set(specs) - set(tensors))
    extra = sorted(set(tensors) - set(specs))
    if missing:
        raise WireError(f"{what} lacks tensor(s) {_short(missing)}", "send every tensor the manifest lists for it")
    if extra:
        raise WireError(f"{what} has unexpected tensor(s) {_short(extra)}", "send only the tensors the manifest lists")
    for name, spec in specs.items():
        value = tensors[name]
        if tuple(value.shape) != spec.shape:
            raise WireError(
                f"{what} tensor {name!r} has shape {tuple(value.shape)}, expected {spec.shape}",
                "export and train from the same bundle",
            )
        if str(value.dtype) != spec.dtype:
            raise WireError(
                f"{what} tensor {name!r} has dtype {value.dtype}, expected {spec.dtype}",
                "send tensors in the manifest's dtype",
            )
    bad = nonfinite_names({name: tensors[name] for name in specs})
    if bad:
        raise WireError(f"{what} tensor {bad[0]!r} contains NaN or Inf", "lower the learning rate and retrain")


def nonfinite_names(tensors: Mapping[str, np.ndarray]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an Inf, in the mapping's order."""
    return [name for name, value in tensors.items() if value.dtype.kind == "f" and not np.isfinite(value).all()]


def _sorted_metadata(payload: bytes) -> bytes:
    """The header's `__metadata__` in key order: the library writes it in a hash map's random order, so the
    same upload encoded twice (a device or a simulated client retrying a round) would not be the same bytes."""
    length = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + length])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(text) > length:  # never: the same entries, reordered (kept as written if it ever were)
        return payload
    return payload[:8] + text.ljust(length) + payload[8 + length :]


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({name for name, _ in pairs}) != len(pairs):
        twice = sorted(name for name, count in Counter(name for name, _ in pairs).items() if count > 1)
        raise WireError(
            f"the safetensors header names {_short(twice)} more than once",
            "send each tensor (and metadata key) once",
        )
    return dict(pairs)


def _nesting_depth(header: bytes) -> int:
    """How deep `{` and `[` nest in JSON bytes, outside strings; vectorised, so a huge header costs O(n)."""
    codes = np.frombuffer(header, dtype=np.uint8)
    if codes.size == 0:
        return 0
    backslash = codes == ord("\\")
    index = np.arange(codes.size)
    last_other = np.maximum.accumulate(np.where(backslash, -1, index))  # the last non-backslash at or before i
    run_before = np.concatenate(([0], index[:-1] - last_other[:-1]))  # backslashes right before i
    quote = (codes == ord('"')) & (run_before % 2 == 0)  # an escaped quote does not end a string
    in_string = np.cumsum(quote) % 2 == 1
    opens = ((codes == ord("{")) | (codes == ord("["))) & ~in_string
    closes = ((codes == ord("}")) | (codes == ord("]"))) & ~in_string
    return int(np.cumsum(opens.astype(np.int64) - closes).max(initial=0))


def _short(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
