"""The server's tensor blobs: content-addressed files (`blobs/ab/<sha256>.safetensors`), written atomically and
checked against their sha256 whenever they are read.

A database row that names a blob is committed only after the blob is on disk (`server/store.py`), so a crash
leaves at worst an unreferenced blob, removed at the next start (`remove_unreferenced`).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from pathlib import Path

from edgepfl.atomic import write_bytes_atomic
from edgepfl.errors import WireError
from edgepfl.server.errors import BlobError, StorageError
from edgepfl.wire import StoredTensors


class BlobStore:
    """A folder of content-addressed, sha256-checked tensor blobs."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._locks = [threading.Lock() for _ in range(64)]  # same-content writers share a temp name

    def put(self, payload: bytes, sha256: str | None = None) -> str:
        """Write a blob atomically (temp file, fsync, rename) unless present; returns its sha256 (StorageError)."""
        digest = sha256 or hashlib.sha256(payload).hexdigest()
        path = self.path(digest)
        with self._locks[int(digest[:2], 16) % len(self._locks)]:
            if not path.is_file() or path.stat().st_size != len(payload):
                try:
                    write_bytes_atomic(path, payload)  # removes its temp file when it fails
                except OSError as exc:
                    raise StorageError.from_os_error(f"blob {digest[:12]}", exc) from None
        return digest

    def read(self, sha256: str) -> bytes:
        """A blob's bytes, checked against its sha256."""
        try:
            payload = self.path(sha256).read_bytes()
        except OSError as exc:
            raise _unreadable(sha256, exc) from None
        if hashlib.sha256(payload).hexdigest() != sha256:
            raise _mismatch(sha256)
        return payload

    def tensors(self, sha256: str) -> StoredTensors:
        """A blob's tensors, read one at a time when used; the file is checked against its sha256 first
        without being held in memory."""
        path = self.path(sha256)
        digest = hashlib.sha256()
        try:
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != sha256:
                raise _mismatch(sha256)
            return StoredTensors(path)
        except OSError as exc:
            raise _unreadable(sha256, exc) from None
        except WireError as error:
            raise BlobError(f"blob {sha256[:12]}: {error.problem}", "restore the --state folder") from None

    def path(self, sha256: str) -> Path:
        """Where a blob lives."""
        return self.folder / sha256[:2] / f"{sha256}.safetensors"

    def delete(self, shas: Iterable[str]) -> int:
        """Delete these blobs (those present); returns how many files were deleted."""
        removed = 0
        for sha in shas:
            path = self.path(sha)
            if path.is_file():
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def remove_unreferenced(self, keep: set[str]) -> int:
        """Delete blobs and temp files not in `keep` (left by a crash, or by a release of history)."""
        removed = 0
        for path in self.folder.glob("*/*"):
            if path.name.startswith(".") or path.name.removesuffix(".safetensors") not in keep:
                path.unlink(missing_ok=True)
                removed += 1
        return removed


def _unreadable(sha256: str, exc: OSError) -> BlobError:
    return BlobError(f"blob {sha256[:12]} cannot be read ({exc.strerror})", "restore the --state folder")


def _mismatch(sha256: str) -> BlobError:
    return BlobError(f"blob {sha256[:12]} does not match its sha256", "restore the --state folder")
