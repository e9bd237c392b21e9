"""Refusals: the engine names what it refuses with a stable `error` code; the HTTP layer picks the status."""

from __future__ import annotations

from typing import Any

from edgepfl.errors import EdgePFLError


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


class ApiError(Refused):
    """A refusal of the HTTP layer itself (a body too large, a malformed request), with its status code."""

    def __init__(self, status: int, error: str, detail: str, fix: str = "", headers: dict[str, str] | None = None):
        super().__init__(error, detail, fix, headers)
        self.status = status
