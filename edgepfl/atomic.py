"""Crash-safe file writes: temp file in the same folder, fsync, rename, fsync the folder."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path


def write_bytes_atomic(path: str | os.PathLike, payload: bytes, mode: int | None = None) -> None:
    """Write `payload` to `path` so that a reader sees the old file or the new one, never a part.

    `mode` (e.g. 0o600) is set on the new file before any byte is written; None leaves the umask's choice.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with os.fdopen(descriptor, "wb") as handle:
            if mode is not None:
                os.chmod(tmp, mode)  # a temp file left by a crash keeps its old mode under O_CREAT
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # a failed write (a full disk) must not keep holding the space
        raise
    _fsync_dir(target.parent)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Text variant of `write_bytes_atomic` (UTF-8)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(folder: Path) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
