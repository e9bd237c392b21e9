"""The HTTP API (FastAPI): thin routes over the round engine; every refusal is JSON `{error, detail, fix}`."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Path, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import edgepfl
from edgepfl.errors import EdgePFLError
from edgepfl.protocol import API_PREFIX, EvalMetrics
from edgepfl.server.bodies import check_declared_length, read_capped
from edgepfl.server.config import HttpLimits
from edgepfl.server.engine import RoundEngine
from edgepfl.server.errors import ApiError, Refused
from edgepfl.server.headers import SecuredApp
from edgepfl.server.http_errors import STATUS, status_of
from edgepfl.server.page import STATUS_PAGE_POLICY, DeviceNote, render_page, render_plot
from edgepfl.server.store import StorageError
from edgepfl.server.tokens import is_operator_token

log = logging.getLogger("edgepfl.server")

MAX_JSON_BYTES = 64 * 1024
MAX_ROUND_ID = 2**31 - 1
SAFETENSORS = "application/octet-stream"
STORAGE_RETRY_AFTER = 60  # seconds a device waits after the server's disk refused its upload

RoundId = Annotated[int, Path(ge=1, le=MAX_ROUND_ID, description="round id")]

_EVAL_METRICS = TypeAdapter(EvalMetrics)
_REFUSAL = {"type": "object", "properties": {"reason": {"type": "string", "maxLength": 200}}, "required": ["reason"]}
_ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "string"}, "detail": {"type": "string"}, "fix": {"type": "string"}},
    "required": ["error", "detail", "fix"],
}


def _error_replies(descriptions: dict[int, str]) -> dict[int, dict[str, Any]]:
    """OpenAPI response entries, by status code, for JSON `{error, detail, fix}` refusals."""
    return {
        code: {"description": text, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
        for code, text in descriptions.items()
    }


_ERRORS = _error_replies(
    {
        400: "malformed safetensors",
        401: "missing or invalid token",
        403: "not sampled",
        404: "no such round",
        408: "the body arrived slower than the server's --min-upload-rate allows",
        409: "round closed, deadline passed, duplicate or layout mismatch",
        410: "the round's tensors were released by --history retention",
        413: "body too large",
        422: "invalid round id, metadata, tensors or metrics",
        503: "the server's disk refused the write (read-only, I/O error); Retry-After says when to retry",
        507: "the server's disk is full; Retry-After says when to retry",
    }
)
_ENROLL_ERRORS = _error_replies(
    {
        401: "missing or wrong enrollment secret",
        403: "enrollment closed: the server was started without --enroll-secret-file",
        408: "the body arrived slower than the server's --min-upload-rate allows",
        409: "the device name is already enrolled (and `key` is not the key it was enrolled with)",
        410: "the join link expired, enrolled the devices it was made for, or was revoked: ask for a new one",
        413: "body too large",
        422: "invalid device name, key or body",
        429: "too many wrong secrets from this address lately; Retry-After says when to try again",
    }
)
_ENROLL_REQUEST = {
    "type": "object",
    "properties": {
        "device": {"type": "string", "description": "1-64 letters, digits, '.', '_' or '-'"},
        "key": {
            "type": "string",
            "minLength": 16,
            "maxLength": 200,
            "pattern": "^[!-~]+$",
            "description": "optional: a random key (printable ASCII) the device keeps until it has its token; "
            "enrolling the same name again with the same key issues a new token in place of the old one, "
            "so a retry after a lost reply succeeds. Without it an enrolled name is 409.",
        },
    },
    "required": ["device"],
}
_ENROLL_REPLY = {
    "type": "object",
    "properties": {"device": {"type": "string"}, "token": {"type": "string"}},
    "required": ["device", "token"],
}


_BEARER = HTTPBearer(auto_error=False, description="per-device token from `edgepfl serve tokens add NAME`")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)]
_ENROLL_SECRET = HTTPBearer(
    auto_error=False, scheme_name="EnrollSecret", description="the shared secret of `--enroll-secret-file`"
)
EnrollSecret = Annotated[HTTPAuthorizationCredentials | None, Security(_ENROLL_SECRET)]


def _device(request: Request, credentials: Credentials) -> str:
    engine: RoundEngine = request.app.state.engine
    return engine.enrollment.authenticate(f"Bearer {credentials.credentials}" if credentials else None)


def _viewer(request: Request, credentials: Credentials) -> bool:
    """Whether the status may name devices: only for the operator's token (`edgepfl serve tokens operator`); a
    device's token, or anyone with --public-status, sees counts and timings; else 401."""
    engine: RoundEngine = request.app.state.engine
    if credentials is not None and is_operator_token(engine.store, credentials.credentials):
        return True
    if not engine.config.public_status:
        _device(request, credentials)
    return False


def _page_viewer(request: Request, credentials: Credentials) -> bool:
    """As _viewer, with a fix a person in a browser (who cannot send a token) can follow."""
    try:
        return _viewer(request, credentials)
    except Refused as error:
        raise Refused(
            error.error,
            "the status page needs a device token (a browser cannot send one)",
            "restart `edgepfl serve` with --public-status to open it in a browser, or send "
            "`Authorization: Bearer <token>` with a token from `edgepfl serve tokens add NAME`",
            headers=error.headers,
        ) from None


Device = Annotated[str, Depends(_device)]
Viewer = Depends(_viewer)
Names = Annotated[bool, Depends(_viewer)]


def create_app(engine: RoundEngine, limits: HttpLimits | None = None) -> FastAPI:
    """The ASGI app for one engine; its lifespan runs the engine's round loop in a thread."""
    limits = limits or HttpLimits()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        worker = threading.Thread(target=engine.run, args=(stop,), name="edgepfl-rounds", daemon=True)
        worker.start()
        yield
        stop.set()
        worker.join(timeout=10)

    app = SecuredApp(  # every reply carries the security headers (server/headers.py)
        title="edgepfl server",
        version=edgepfl.__version__,
        description="Aggregates the base tensors of personalized federated learning rounds (FedPer).",
        lifespan=lifespan,
        docs_url=None,  # Swagger UI and ReDoc load their scripts from a CDN; the spec stays at /openapi.json
        redoc_url=None,
    )
    upload_slots = asyncio.Semaphore(engine.config.upload_slots)
    uploading: set[str] = set()  # devices with an upload in progress: one slot per device at most
    app.state.engine = engine

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

    @app.get(
        f"{API_PREFIX}/task",
        responses={401: _ERRORS[401], **_error_replies({409: "the strategy has no place for this device (pfedla)"})},
    )
    def get_task(name: Device) -> JSONResponse:
        """What this device should do now: train in a round, wait (retry_after), or stop (done)."""
        task = engine.task(name)
        headers = {"Retry-After": str(max(1, round(task.retry_after)))} if task.retry_after is not None else None
        return JSONResponse(task.to_json(), headers=headers)

    @app.get(
        f"{API_PREFIX}/rounds/{{round_id}}/base",
        response_class=Response,
        responses={
            200: {"content": {SAFETENSORS: {}}},
            304: {"description": "not modified"},
            **{code: _ERRORS[code] for code in (401, 403, 404, 410, 422)},
        },
    )
    def get_base(round_id: RoundId, name: Device, request: Request) -> Response:
        """The base tensors this device trains from in round `round_id` (safetensors; ETag = sha256)."""
        payload, sha = engine.base_for(name, round_id)
        return _tensor_response(payload, sha, request)

    @app.get(
        f"{API_PREFIX}/rounds/{{round_id}}/result",
        response_class=Response,
        responses={
            200: {"content": {SAFETENSORS: {}}},
            **{code: _ERRORS[code] for code in (401, 404, 409, 410, 422)},
        },
    )
    def get_result(round_id: RoundId, name: Device, request: Request) -> Response:
        """The aggregated base (global model) a closed round produced (safetensors; ETag = sha256)."""
        payload, sha = engine.result_of(round_id)
        return _tensor_response(payload, sha, request)

    @app.get(f"{API_PREFIX}/history", responses={401: _ERRORS[401]})
    def get_history(name: Device) -> dict[str, Any]:
        """Closed rounds whose global model can be fetched (oldest first, with sha256 and URL), and the retention."""
        return engine.history()

    @app.post(
        f"{API_PREFIX}/rounds/{{round_id}}/update",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}},
            }
        },
        responses=_ERRORS,
    )
    async def post_update(round_id: RoundId, name: Device, request: Request) -> JSONResponse:
        """Upload this device's new base tensors; UploadMeta travels in the safetensors `__metadata__`."""
        cap = engine.config.max_upload_bytes
        check_declared_length(request, cap)
        await run_in_threadpool(engine.check_upload_allowed, name, round_id)
        if name in uploading:  # a device that opened several slow uploads would hold every slot
            raise ApiError(
                429,
                "upload_in_progress",
                f"device {name!r} already has an upload in progress",
                "send one upload at a time; retry when the other has finished",
                headers={"Retry-After": "5"},
            )
        uploading.add(name)
        try:
            async with upload_slots:  # bodies wait in the socket, so memory is O(slots x model)
                payload = await read_capped(request, cap, f"--max-upload-mb {engine.config.max_upload_mb:g}", limits)
                receipt = await run_in_threadpool(engine.accept_update, name, round_id, payload)
        finally:
            uploading.discard(name)
        return JSONResponse(receipt)

    @app.post(
        f"{API_PREFIX}/rounds/{{round_id}}/refusal",
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _REFUSAL}}}},
        responses={code: _ERRORS[code] for code in (401, 403, 404, 408, 413, 422)},
    )
    async def post_refusal(round_id: RoundId, name: Device, request: Request) -> JSONResponse:
        """Report that this device refused round `round_id`'s base (NaN or Inf in it, or training diverged)."""
        check_declared_length(request, MAX_JSON_BYTES)
        body = await read_capped(request, MAX_JSON_BYTES, f"{MAX_JSON_BYTES} bytes of JSON", limits)
        try:
            reason = json.loads(body)["reason"]
        except (ValueError, KeyError, TypeError, RecursionError):
            reason = None
        if not isinstance(reason, str) or not reason.strip():
            raise ApiError(422, "invalid_request", "the body is not JSON with a string `reason`", '{"reason": "..."}')
        return JSONResponse(await run_in_threadpool(engine.accept_refusal, name, round_id, reason))

    @app.post(
        f"{API_PREFIX}/rounds/{{round_id}}/metrics",
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": _EVAL_METRICS.json_schema()}}}
        },
        responses={code: _ERRORS[code] for code in (401, 403, 404, 408, 409, 413, 422)},
    )
    async def post_metrics(round_id: RoundId, name: Device, request: Request) -> JSONResponse:
        """Report the evaluation of this device's personalized model after round `round_id`."""
        check_declared_length(request, MAX_JSON_BYTES)
        body = await read_capped(request, MAX_JSON_BYTES, f"{MAX_JSON_BYTES} bytes of JSON", limits)
        try:
            metrics = _EVAL_METRICS.validate_python(json.loads(body))
        except (ValueError, ValidationError, RecursionError) as error:
            raise ApiError(
                422,
                "bad_metrics",
                f"the metrics body is not EvalMetrics JSON ({str(error)[:200]})",
                'send {"accuracy": 0.9, "num_samples": 100, "loss": 0.3}',
            ) from None
        return JSONResponse(await run_in_threadpool(engine.accept_metrics, name, round_id, metrics))

    @app.post(
        f"{API_PREFIX}/enroll",
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _ENROLL_REQUEST}}}},
        responses={200: {"content": {"application/json": {"schema": _ENROLL_REPLY}}}, **_ENROLL_ERRORS},
    )
    async def post_enroll(credentials: EnrollSecret, request: Request) -> JSONResponse:
        """Enroll a device with the shared secret (`Authorization: Bearer <secret>`); the reply shows its token once."""
        secret = credentials.credentials if credentials else None
        address = request.client.host if request.client else "unknown"
        engine.enrollment.check_enroll_secret(secret, address)  # refused before the body is read
        check_declared_length(request, MAX_JSON_BYTES)
        body = await read_capped(request, MAX_JSON_BYTES, f"{MAX_JSON_BYTES} bytes of JSON", limits)
        try:
            fields = json.loads(body)
            name, key = fields["device"], fields.get("key")
        except (ValueError, KeyError, TypeError, RecursionError):
            name = key = None
        if not isinstance(name, str) or not isinstance(key, str | None):
            raise ApiError(
                422,
                "invalid_request",
                "the body is not JSON with a string `device` (and an optional string `key`)",
                'send {"device": "phone-1", "key": "<random key>"}',
            )
        token = await run_in_threadpool(engine.enrollment.enroll, secret, name, address, key)
        return JSONResponse({"device": name, "token": token})

    @app.get(f"{API_PREFIX}/status", responses={401: _ERRORS[401]})
    def get_status(names: Names) -> dict[str, Any]:
        """Rounds so far, their upload counts, accuracies and timings (no tensors; device names only for the
        operator's token)."""
        return engine.status(names)

    engine.mode.add_routes(app, _device, limits)  # e.g. a secure round's steps (server/secure_routes.py)
    app.state.device_note = note = _add_device_page(app, engine)

    @app.get("/", response_class=HTMLResponse, responses={401: _ERRORS[401]})
    def get_page(names: Annotated[bool, Depends(_page_viewer)]) -> HTMLResponse:
        """A small self-contained HTML page: the rounds so far and a plot of device accuracy (device names only for
        the operator's token)."""
        page = render_page(engine.status(names), note.text, note.add_device)
        return HTMLResponse(page, headers={"Content-Security-Policy": STATUS_PAGE_POLICY})

    @app.get(
        "/plot.png",
        response_class=Response,
        dependencies=[Viewer],
        responses={200: {"content": {"image/png": {}}}, 401: _ERRORS[401]},
    )
    def get_plot() -> Response:
        """Mean/min/max device accuracy per round (PNG, rendered on the server)."""
        return Response(render_plot(engine.status()), media_type="image/png")

    return app


def _add_device_page(app: FastAPI, engine: RoundEngine) -> DeviceNote:
    """The browser device's routes (server/web.py) unless --no-web; returns what the status page says of them."""
    if not engine.config.web:
        return DeviceNote("The device page is off (--no-web).")
    from edgepfl.server.web import add_web_routes

    return add_web_routes(app, engine, _device)


def _tensor_response(payload: bytes, sha: str, request: Request) -> Response:
    etag = f'"{sha}"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    return Response(payload, media_type=SAFETENSORS, headers={"ETag": etag})
