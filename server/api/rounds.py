"""A device's round over HTTP: what it should do now, the base it trains from and the result a round produced, the
rounds it can still fetch; its update (one at a time, in a bounded number of slots), its refusal of a base and its
evaluation. Thin: the engine decides."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool

from edgepfl.protocol import API_PREFIX, EvalMetrics
from edgepfl.server.api.auth import Device
from edgepfl.server.api.replies import ERRORS, MAX_JSON_BYTES, SAFETENSORS, RoundId, error_replies
from edgepfl.server.bodies import check_declared_length, read_capped
from edgepfl.server.config import HttpLimits
from edgepfl.server.engine import RoundEngine
from edgepfl.server.errors import ApiError

_EVAL_METRICS = TypeAdapter(EvalMetrics)
_REFUSAL = {"type": "object", "properties": {"reason": {"type": "string", "maxLength": 200}}, "required": ["reason"]}


def rounds_router(engine: RoundEngine, limits: HttpLimits) -> APIRouter:
    """The round routes of one engine's app (its upload slots are the app's)."""
    router = APIRouter()
    upload_slots = asyncio.Semaphore(engine.config.upload_slots)
    uploading: set[str] = set()  # devices with an upload in progress: one slot per device at most

    @router.get(
        f"{API_PREFIX}/task",
        responses={401: ERRORS[401], **error_replies({409: "the strategy has no place for this device (pfedla)"})},
    )
    def get_task(name: Device) -> JSONResponse:
        """What this device should do now: train in a round, wait (retry_after), or stop (done)."""
        task = engine.task(name)
        headers = {"Retry-After": str(max(1, round(task.retry_after)))} if task.retry_after is not None else None
        return JSONResponse(task.to_json(), headers=headers)

    @router.get(
        f"{API_PREFIX}/rounds/{{round_id}}/base",
        response_class=Response,
        responses={
            200: {"content": {SAFETENSORS: {}}},
            304: {"description": "not modified"},
            **{code: ERRORS[code] for code in (401, 403, 404, 410, 422)},
        },
    )
    def get_base(round_id: RoundId, name: Device, request: Request) -> Response:
        """The base tensors this device trains from in round `round_id` (safetensors; ETag = sha256)."""
        payload, sha = engine.base_for(name, round_id)
        return _tensor_response(payload, sha, request)

    @router.get(
        f"{API_PREFIX}/rounds/{{round_id}}/result",
        response_class=Response,
        responses={
            200: {"content": {SAFETENSORS: {}}},
            **{code: ERRORS[code] for code in (401, 404, 409, 410, 422)},
        },
    )
    def get_result(round_id: RoundId, name: Device, request: Request) -> Response:
        """The aggregated base (global model) a closed round produced (safetensors; ETag = sha256)."""
        payload, sha = engine.result_of(round_id)
        return _tensor_response(payload, sha, request)

    @router.get(f"{API_PREFIX}/history", responses={401: ERRORS[401]})
    def get_history(name: Device) -> dict[str, Any]:
        """Closed rounds whose global model can be fetched (oldest first, with sha256 and URL), and the retention."""
        return engine.history()

    @router.post(
        f"{API_PREFIX}/rounds/{{round_id}}/update",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}},
            }
        },
        responses=ERRORS,
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

    @router.post(
        f"{API_PREFIX}/rounds/{{round_id}}/refusal",
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _REFUSAL}}}},
        responses={code: ERRORS[code] for code in (401, 403, 404, 408, 413, 422)},
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

    @router.post(
        f"{API_PREFIX}/rounds/{{round_id}}/metrics",
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": _EVAL_METRICS.json_schema()}}}
        },
        responses={code: ERRORS[code] for code in (401, 403, 404, 408, 409, 413, 422)},
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

    return router


def _tensor_response(payload: bytes, sha: str, request: Request) -> Response:
    etag = f'"{sha}"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    return Response(payload, media_type=SAFETENSORS, headers={"ETag": etag})
