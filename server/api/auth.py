"""Who calls: the HTTP API's token dependencies. A device presents its token (`Authorization: Bearer`); the status
names devices to the operator's token alone; enrolment presents the shared secret."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from edgepfl.server.errors import Refused
from edgepfl.server.tokens import is_operator_token

if TYPE_CHECKING:
    from edgepfl.server.engine import RoundEngine

_BEARER = HTTPBearer(auto_error=False, description="per-device token from `edgepfl serve tokens add NAME`")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)]
_ENROLL_SECRET = HTTPBearer(
    auto_error=False, scheme_name="EnrollSecret", description="the shared secret of `--enroll-secret-file`"
)
EnrollSecret = Annotated[HTTPAuthorizationCredentials | None, Security(_ENROLL_SECRET)]


def device(request: Request, credentials: Credentials) -> str:
    """The calling device's name, from its token (401 without a valid one)."""
    engine: RoundEngine = request.app.state.engine
    return engine.enrollment.authenticate(f"Bearer {credentials.credentials}" if credentials else None)


def viewer(request: Request, credentials: Credentials) -> bool:
    """Whether the status may name devices: only for the operator's token (`edgepfl serve tokens operator`); a
    device's token, or anyone with --public-status, sees counts and timings; else 401."""
    engine: RoundEngine = request.app.state.engine
    if credentials is not None and is_operator_token(engine.store, credentials.credentials):
        return True
    if not engine.config.public_status:
        device(request, credentials)
    return False


def page_viewer(request: Request, credentials: Credentials) -> bool:
    """As viewer, with a fix a person in a browser (who cannot send a token) can follow."""
    try:
        return viewer(request, credentials)
    except Refused as error:
        raise Refused(
            error.error,
            "the status page needs a device token (a browser cannot send one)",
            "restart `edgepfl serve` with --public-status to open it in a browser, or send "
            "`Authorization: Bearer <token>` with a token from `edgepfl serve tokens add NAME`",
            headers=error.headers,
        ) from None


Device = Annotated[str, Depends(device)]
Viewer = Depends(viewer)
Names = Annotated[bool, Depends(viewer)]
PageNames = Annotated[bool, Depends(page_viewer)]
