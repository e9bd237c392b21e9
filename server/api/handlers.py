"""Every refusal and failure of the HTTP API as one JSON line `{error, detail, fix}`, with its status code
(`server/http_errors.py`) and headers."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgepfl.errors import EdgePFLError
from edgepfl.server.errors import Refused
from edgepfl.server.http_errors import STATUS, status_of
from edgepfl.server.store import StorageError

log = logging.getLogger("edgepfl.server")

STORAGE_RETRY_AFTER = 60  # seconds a device waits after the server's disk refused its upload


def add_error_handlers(app: FastAPI) -> None:
    """Render refusals, invalid requests, routing errors, server-side and storage failures, and bugs as JSON."""

    @app.exception_handler(Refused)
    async def _refused(_: Request, error: Refused) -> JSONResponse:
        return JSONResponse(error.body(), status_code=status_of(error), headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in error.errors())
        return JSONResponse({"error": "invalid_request", "detail": detail[:500], "fix": "see /openapi.json"}, 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        name = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return JSONResponse(
            {"error": name, "detail": str(error.detail), "fix": "see /openapi.json"},
            error.status_code,
            headers=getattr(error, "headers", None),
        )

    @app.exception_handler(EdgePFLError)
    async def _server_side(_: Request, error: EdgePFLError) -> JSONResponse:
        log.error("request failed on the server side: %s", error)
        return JSONResponse({"error": "server_error", "detail": error.problem, "fix": error.fix}, 500)

    @app.exception_handler(StorageError)
    async def _storage(_: Request, error: StorageError) -> JSONResponse:
        log.error("%s", error)  # one line: the operator has to act, the device only retries
        name = "insufficient_storage" if error.full else "storage_failed"
        fix = f"retry in {STORAGE_RETRY_AFTER} s (the operator must {error.fix})"
        body = {"error": name, "detail": error.problem, "fix": fix}
        return JSONResponse(body, STATUS[name], headers={"Retry-After": str(STORAGE_RETRY_AFTER)})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        # a bug, not bad input: logged with its traceback here, one JSON line for the device
        log.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return JSONResponse(
            {
                "error": "server_error",
                "detail": "the server failed to handle this request",
                "fix": "see the server log",
            },
            500,
        )
