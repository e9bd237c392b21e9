"""Security headers on every reply of the server: its API, status page, device page and errors alike.

A route that needs another Content-Security-Policy (the status page, the device page, the join page) sets its
own; the rest get the API's, which lets a browser load nothing. The motion sensors are the device page's alone: its
Permissions-Policy lets it (and no page it embeds) read the accelerometer and gyroscope; every other reply's denies
them. `Strict-Transport-Security` goes with every
reply over https (uvicorn's TLS, or a proxy named by --forwarded-allow-ips that says so), never over http,
where browsers ignore it.
"""

from __future__ import annotations

import base64
import hashlib

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

API_POLICY = "default-src 'none'; frame-ancestors 'none'"
HSTS = "max-age=31536000"  # a year; no includeSubDomains: the server may share its name with other services
# the powerful features the device page may use, for its own origin only (a sensor bundle records the phone's
# motion: device_runtime/web/src/motion.js); none for any other reply, nor for a frame any page could embed
NO_FEATURES = "accelerometer=(), gyroscope=(), magnetometer=(), geolocation=(), microphone=()"
DEVICE_FEATURES = "accelerometer=(self), gyroscope=(self), magnetometer=(), geolocation=(), microphone=()"
SECURITY_HEADERS = {
    "Content-Security-Policy": API_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Permissions-Policy": NO_FEATURES,
}


def security_headers(https: bool) -> dict[str, str]:
    """The headers every reply carries unless its route set its own (with HSTS over https)."""
    return {**SECURITY_HEADERS, "Strict-Transport-Security": HSTS} if https else dict(SECURITY_HEADERS)


def page_policy(style: str, form_action: str = "'none'") -> str:
    """The CSP of a server-rendered page: its one inline `<style>` (by hash), data: images, no script at all,
    forms sent to `form_action` only."""
    digest = base64.b64encode(hashlib.sha256(style.encode("utf-8")).digest()).decode("ascii")
    return (
        f"default-src 'none'; style-src 'sha256-{digest}'; img-src data:; base-uri 'none'; "
        f"form-action {form_action}; frame-ancestors 'none'"
    )


class SecurityHeaders:
    """ASGI middleware: adds `security_headers` that a reply does not carry yet to its response start."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        wanted = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in security_headers(scope.get("scheme") == "https").items()
        ]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                message["headers"] = headers + [(name, value) for name, value in wanted if name not in present]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class SecuredApp(FastAPI):
    """FastAPI whose every reply carries the security headers, the 500 of its outermost error handler included
    (middleware added with `add_middleware` sits inside that handler)."""

    def build_middleware_stack(self) -> ASGIApp:
        """The usual stack, wrapped in SecurityHeaders."""
        return SecurityHeaders(super().build_middleware_stack())
