"""Enrolment over HTTP: a device presents the shared secret (`--enroll-secret-file`, or a join link's) and a name,
and gets its token once (server/enrollment.py decides)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from edgepfl.protocol import API_PREFIX
from edgepfl.server.api.auth import EnrollSecret
from edgepfl.server.api.replies import MAX_JSON_BYTES, error_replies
from edgepfl.server.bodies import check_declared_length, read_capped
from edgepfl.server.config import HttpLimits
from edgepfl.server.engine import RoundEngine
from edgepfl.server.errors import ApiError

_ENROLL_ERRORS = error_replies(
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


def enroll_router(engine: RoundEngine, limits: HttpLimits) -> APIRouter:
    """The enrolment route of one engine's app."""
    router = APIRouter()

    @router.post(
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

    return router
