"""HTTP-facing errors: each carries its status code and a stable machine-readable name."""

from __future__ import annotations

from typing import Any

from edgepfl.errors import EdgePFLError


class ApiError(EdgePFLError):
    """A request the server refuses; rendered once, by the app, as JSON `{error, detail, fix}`."""

    def __init__(self, status: int, error: str, detail: str, fix: str = "", headers: dict[str, str] | None = None):
        super().__init__(detail, fix)
        self.status = status
        self.error = error
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body of the error reply."""
        return {"error": self.error, "detail": self.problem, "fix": self.fix}
