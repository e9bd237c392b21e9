"""A secure round's HTTP routes (`/v1/rounds/{r}/secagg/...`, docs/secure-aggregation.md): thin, over the secure steps
(`steps.py`, which check the round and the device). Every call carries the device's token, and every message
must name the token's device, so no one can advertise keys (or send anything else) in another device's name.

    POST advert  <- KeyAdvert JSON                GET book   -> KeyBook JSON       (202 while the keys step is open)
    POST shares  <- ShareBundle JSON              GET inbox  -> ShareInbox JSON    (202 while the shares step is open)
    POST masked  <- MaskedInput.to_bytes(): binary  GET unmask -> UnmaskRequest JSON (202 while inputs are open)
    POST reveal  <- UnmaskShares JSON

A POST answers `{accepted, round, duplicate}` (a message the round already holds is a duplicate, whatever step it is
at); a 202 answers `{waiting, retry_after}`. Refusals are the engine's codes: `bad_secagg` (422, a malformed or
inconsistent message; nothing changes), `wrong_device` (403), `too_early` (409), `round_closed` (409: the step or
the round is over for this device, which rejoins the next round).
"""

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from edgepfl.secagg import to_json
from edgepfl.server.api.auth import Device
from edgepfl.server.api.replies import RoundId
from edgepfl.server.bodies import check_declared_length, read_capped
from edgepfl.server.config import HttpLimits, ServerConfig
from edgepfl.server.secure.steps import SecureSteps

MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # a JSON message: a share bundle of a classic round of 20,000 devices fits
WAIT_FIRST = 5.0  # seconds a device waits before asking again while others train (the keys step)
WAIT_STEP = 1.0  # ... while the later steps collect their messages, each within seconds

POSTS = ("advert", "shares", "masked", "reveal")


def secure_router(steps: SecureSteps, config: ServerConfig, limits: HttpLimits) -> APIRouter:
    """The secure round's routes over `steps`."""
    router = APIRouter()
    prefix = "/v1/rounds/{round_id}/secagg"

    def post(kind: str) -> None:
        async def receive(round_id: RoundId, name: Device, request: Request) -> JSONResponse:
            cap = config.max_upload_bytes if kind == "masked" else MAX_MESSAGE_BYTES
            check_declared_length(request, cap)
            body = await read_capped(request, cap, f"{cap} bytes", limits)
            return JSONResponse(await run_in_threadpool(steps.message, name, round_id, kind, body))

        receive.__doc__ = f"This device's {kind} message of the round's secure aggregation."
        router.post(f"{prefix}/{kind}", name=f"secagg_{kind}")(receive)

    def get(what: str, call: Callable[[str, int], Any], first: bool = False) -> None:
        def answer(round_id: RoundId, name: Device) -> Response:
            message = call(name, round_id)
            if message is None:
                wait = min(WAIT_FIRST if first else WAIT_STEP, config.poll_interval)
                return JSONResponse({"waiting": what, "retry_after": wait}, 202, headers={"Retry-After": str(wait)})
            return Response(to_json(message), media_type="application/json")

        answer.__doc__ = f"The round's {what} for this device (202 while its step is not reached)."
        router.get(f"{prefix}/{what}", name=f"secagg_{what}")(answer)

    for kind in POSTS:
        post(kind)
    get("book", steps.book, first=True)
    get("inbox", steps.inbox)
    get("unmask", steps.request)
    return router
