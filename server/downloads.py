"""The bytes a round's base travels in: fp32 as stored, or encoded (fp16) once per base and kept for the round."""

from __future__ import annotations

import hashlib
import threading

from edgepfl.encoding import encode_download
from edgepfl.server.blobs import BlobStore

MAX_ENCODED = 64  # encoded bases kept; per-device bases (pFedLA) beyond this are encoded again when asked for


class Downloads:
    """What devices download: a base blob in the round's download encoding, with its sha256 (the ETag)."""

    def __init__(self, blobs: BlobStore):
        self.blobs = blobs
        self._lock = threading.Lock()
        self._encoded: dict[tuple[str, str], tuple[bytes, str]] = {}  # (base sha, encoding) -> bytes sent, sha

    def base(self, sha: str, encoding: str) -> tuple[bytes, str]:
        """The bytes of base blob `sha` in `encoding` and their sha256."""
        if encoding == "fp32":
            return self.blobs.read(sha), sha
        with self._lock:
            sent = self._encoded.get((sha, encoding))
        if sent is None:
            payload = encode_download(self.blobs.read(sha), encoding)
            sent = (payload, hashlib.sha256(payload).hexdigest())
            with self._lock:
                if len(self._encoded) >= MAX_ENCODED:
                    self._encoded.clear()
                self._encoded[(sha, encoding)] = sent
        return sent

    def clear(self) -> None:
        """Forget the encoded bases (a round closed: the next one sends new ones)."""
        with self._lock:
            self._encoded.clear()
