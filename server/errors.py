"""Refusals: the engine names what it refuses with a stable `error` code; the HTTP layer picks the status."""

from __future__ import annotations

import errno
import sqlite3
from typing import Any

from edgepfl.errors import EdgePFLError, StateError


class Refused(EdgePFLError):
    """A request the server refuses, named by a stable `error` code (its HTTP status: `server/http_errors.py`).

    Rendered once, by the app, as JSON `{error, detail, fix}`; `headers` travel with the reply
    (`Retry-After`, `WWW-Authenticate`).
    """

    def __init__(self, error: str, detail: str, fix: str = "", headers: dict[str, str] | None = None):
        super().__init__(detail, fix)
        self.error = error
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body of the error reply."""
        return {"error": self.error, "detail": self.problem, "fix": self.fix}


def not_sampled(device: str, round_id: int, fix: str) -> Refused:
    """The refusal (403) of a device's call about a round it was not sampled in; `fix` says what it should do."""
    return Refused("not_sampled", f"device {device!r} was not sampled in round {round_id}", fix)


class ApiError(Refused):
    """A refusal of the HTTP layer itself (a body too large, a malformed request), with its status code."""

    def __init__(self, status: int, error: str, detail: str, fix: str = "", headers: dict[str, str] | None = None):
        super().__init__(error, detail, fix, headers)
        self.status = status


class BlobError(StateError):
    """A stored tensor blob is missing or does not match its sha256."""


class StorageError(StateError):
    """The state folder refused a write (full disk, read-only, I/O error); nothing half-written was kept."""

    def __init__(self, problem: str, fix: str, full: bool):
        super().__init__(problem, fix)
        self.full = full  # out of space or quota: the operator frees space, nothing else is wrong

    @classmethod
    def from_os_error(cls, what: str, exc: OSError) -> StorageError:
        """The error for a failed write of `what`, saying which failure it was."""
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        reason = exc.strerror or type(exc).__name__
        fix = "free space on the disk of the server's --state folder" if full else "check the server's --state folder"
        return cls(f"the server could not store {what}: {reason}", fix, full)

    @classmethod
    def from_sqlite_error(cls, exc: sqlite3.Error) -> StorageError:
        """The error for a failed database write: full (507) or otherwise failing (503); nothing was committed."""
        full = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
        fix = "free space on the disk of the server's --state folder" if full else "check the server's --state folder"
        return cls(f"the server could not write its database: {exc}", fix, full)
