"""The HTTP API (FastAPI): thin routes over the round engine, one router per concern (`server/api/`), the device
page's (`web.py`) and the round mode's own (secure aggregation's steps); every refusal is JSON `{error, detail,
fix}` (`server/api/handlers.py`)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import edgepfl
from edgepfl.server.api.enroll import enroll_router
from edgepfl.server.api.handlers import add_error_handlers
from edgepfl.server.api.rounds import rounds_router
from edgepfl.server.api.views import page_router, status_router
from edgepfl.server.config import HttpLimits
from edgepfl.server.engine import RoundEngine
from edgepfl.server.headers import SecuredApp
from edgepfl.server.page import DeviceNote


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
    app.state.engine = engine  # the token dependencies read it (server/api/auth.py)
    add_error_handlers(app)
    app.include_router(rounds_router(engine, limits))
    app.include_router(enroll_router(engine, limits))
    app.include_router(status_router(engine))
    mode_routes = engine.mode.router(limits)  # e.g. a secure round's steps (server/secure/routes.py)
    if mode_routes is not None:
        app.include_router(mode_routes)
    app.state.device_note = note = _add_device_page(app, engine)
    app.include_router(page_router(engine, note))
    return app


def _add_device_page(app: FastAPI, engine: RoundEngine) -> DeviceNote:
    """The browser device's routes (server/web.py) unless --no-web; returns what the status page says of them."""
    if not engine.config.web:
        return DeviceNote("The device page is off (--no-web).")
    from edgepfl.server.web import web_router

    router, note = web_router(engine)
    app.include_router(router)
    return note
