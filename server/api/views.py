"""What the server shows over HTTP: the status JSON, its HTML page and the accuracy plot (device names only for the
operator's token: `auth.py`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from edgepfl.protocol import API_PREFIX
from edgepfl.server.api.auth import Names, PageNames, Viewer
from edgepfl.server.api.replies import ERRORS
from edgepfl.server.engine import RoundEngine
from edgepfl.server.page import STATUS_PAGE_POLICY, DeviceNote, render_page, render_plot


def status_router(engine: RoundEngine) -> APIRouter:
    """The status JSON of one engine's app."""
    router = APIRouter()

    @router.get(f"{API_PREFIX}/status", responses={401: ERRORS[401]})
    def get_status(names: Names) -> dict[str, Any]:
        """Rounds so far, their upload counts, accuracies and timings (no tensors; device names only for the
        operator's token)."""
        return engine.status(names)

    return router


def page_router(engine: RoundEngine, note: DeviceNote) -> APIRouter:
    """The status page and its plot; `note` is what the page says of the device page."""
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse, responses={401: ERRORS[401]})
    def get_page(names: PageNames) -> HTMLResponse:
        """A small self-contained HTML page: the rounds so far and a plot of device accuracy (device names only for
        the operator's token)."""
        page = render_page(engine.status(names), note.text, note.add_device)
        return HTMLResponse(page, headers={"Content-Security-Policy": STATUS_PAGE_POLICY})

    @router.get(
        "/plot.png",
        response_class=Response,
        dependencies=[Viewer],
        responses={200: {"content": {"image/png": {}}}, 401: ERRORS[401]},
    )
    def get_plot() -> Response:
        """Mean/min/max device accuracy per round (PNG, rendered on the server)."""
        return Response(render_plot(engine.status()), media_type="image/png")

    return router
