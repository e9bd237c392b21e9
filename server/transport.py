"""How the server meets the network: deadlines on reading requests, and which proxies it believes."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from edgepfl.server.config import HttpLimits
from edgepfl.server.headers import security_headers


def run_server(
    app: Any, host: str, port: int, limits: HttpLimits, log_level: str, tls: tuple[Path, Path] | None = None
) -> None:
    """Serve `app` with uvicorn under `limits` until interrupted."""
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        workers=1,
        ssl_certfile=str(tls[0]) if tls else None,
        ssl_keyfile=str(tls[1]) if tls else None,
        http=functools.partial(HeaderDeadlineH11, header_timeout=limits.read_timeout),
        # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: anyone on the host could pick
        # the address the enrollment limit counts. Only proxies the operator names are believed.
        proxy_headers=bool(limits.forwarded_allow_ips),
        forwarded_allow_ips=list(limits.forwarded_allow_ips),
    )


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers (uvicorn waits for them forever), whose
    own 400 for a malformed request carries the security headers as the app's replies do."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._start_header_timer()  # the next request's headers get the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # no complete request line and headers in time: nothing to answer

    def send_400_response(self, msg: str) -> None:
        """uvicorn's reply to a request h11 cannot parse, with the security headers; the connection closes."""
        headers = [("content-type", "text/plain; charset=utf-8"), ("connection", "close")]
        headers += list(security_headers(self.scheme == "https").items())
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=msg.encode("ascii")),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()
