"""The device's HTTP client for the server protocol (`edgepfl.protocol`): retries what may pass, reports what won't.

Connection errors, timeouts, 5xx, 408 (the server cut a too-slow upload) and 429 are retried with
exponential backoff and jitter (a `Retry-After` header wins). A 4xx is raised once as `ServerRefused`,
carrying the server's `fix` text; the refusals that mean "this round is over for you" are `RoundGone`.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from edgepfl.device_runtime.options import ConnectionOptions
from edgepfl.encoding import decode_download
from edgepfl.errors import EdgePFLError, WireError
from edgepfl.protocol import API_PREFIX, EvalMetrics, Task
from edgepfl.wire import decode_tensors

# server error names that end this device's part in a round: drop the round, poll for the next one
# refusals that end this device's part in a round (the page reads them from contract.json): it drops the round's
# upload and joins the next one (`too_stale`: under fedbuff, the base it trained on is too many steps old)
ROUND_GONE_ERRORS = frozenset({"round_closed", "deadline_passed", "not_sampled", "no_such_round", "too_stale"})
RETRIED_REFUSALS = (408, 429)  # a too-slow upload cut off by the server, too many requests: both may pass later


# An idle connection is dropped before the server's idle timeout (uvicorn: 5 s) can close it under a request
# being sent on it, which fails that request with "server disconnected" (seen at 400 devices, bench/server.py).
KEEPALIVE_SECONDS = 2.0


class ServerError(EdgePFLError):
    """The server could not be used for a request."""


class ServerUnreachable(ServerError):
    """Connection errors or 5xx answers outlasted every retry; `reason` is the last failure, as retries said it."""

    def __init__(self, problem: str, fix: str, reason: str = ""):
        super().__init__(problem, fix)
        self.reason = reason or problem


class ServerRefused(ServerError):
    """A 4xx answer: retrying the same request would not help."""

    def __init__(self, problem: str, fix: str, status: int, error: str):
        super().__init__(problem, fix)
        self.status = status
        self.error = error


class RoundGone(ServerRefused):
    """The round closed, passed its deadline or does not include this device: the device rejoins the next one."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a request is retried."""

    attempts: int = ConnectionOptions.model_fields["retries"].default  # tries in all, the first included
    first_delay: float = 0.5  # seconds before the second try; doubled each time
    max_delay: float = 30.0  # cap on one wait (a server's Retry-After is capped at 10x this)


@dataclass(frozen=True)
class HistoryEntry:
    """One round listed by `GET /v1/history`: its id, its global model's sha256 and where to fetch it."""

    round_id: int
    sha256: str
    url: str


@dataclass
class Traffic:
    """Bytes of request and response bodies, for the round log and the benchmark."""

    sent: int = 0
    received: int = 0


class ServerClient:
    """One device's connection to `edgepfl serve`: task, base, update and metrics calls (and enrollment)."""

    def __init__(
        self,
        server_url: str,
        token: str | None,
        retry: RetryPolicy = RetryPolicy(),
        timeout: float = ConnectionOptions.model_fields["timeout"].default,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        on_retry: Callable[[str], None] | None = None,
    ):
        self.retry = retry
        self.traffic = Traffic()
        self._sleep = sleep
        self._on_retry = on_retry
        self._jitter = random.Random()
        self._http = httpx.Client(
            base_url=server_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"} if token is not None else None,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_SECONDS),
            transport=transport,
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def enroll(self, name: str, secret: str, key: str | None = None) -> str:
        """`POST /v1/enroll` with the shared secret in place of a device token: this device's new token.

        Every retry sends the same `key`, so a retry after a lost reply gets a new token instead of 409.
        """
        body = {"device": name} if key is None else {"device": name, "key": key}
        response = self._request(
            "POST", f"{API_PREFIX}/enroll", json=body, headers={"Authorization": f"Bearer {secret}"}
        )
        token = _json_reply(response).get("token")
        if not isinstance(token, str) or not token:
            raise ServerError("the server's enrollment reply holds no token", "use an `edgepfl serve` with /v1/enroll")
        return token

    def task(self) -> Task:
        """`GET /v1/task`: what to do now."""
        return Task.from_json(_json_reply(self._request("GET", f"{API_PREFIX}/task")))

    def fetch_tensors(self, url: str, encoding: str = "fp32") -> dict[str, np.ndarray]:
        """GET safetensors bytes (a round's base or result), checked against the ETag (sha256), decoded as
        `encoding` (the round's download_encoding; a base in any other encoding is a WireError)."""
        for _ in range(self.retry.attempts):
            response = self._request("GET", url)
            etag = response.headers.get("etag", "").strip('"')
            if not etag or hashlib.sha256(response.content).hexdigest() == etag:
                return _tensors_reply(response, encoding)
            self._notify(f"GET {url}: body does not match its ETag, fetching again")
        raise ServerUnreachable(f"GET {url} kept returning bytes that do not match their ETag", "check the network")

    def history(self) -> list[HistoryEntry]:
        """`GET /v1/history`: the closed rounds whose global model the server still keeps, oldest first."""
        reply = _json_reply(self._request("GET", f"{API_PREFIX}/history"))
        try:
            return [HistoryEntry(int(row["round"]), str(row["sha256"]), str(row["url"])) for row in reply["rounds"]]
        except (ValueError, KeyError, TypeError):
            raise ServerError(
                "the server's history is not the expected JSON", "use an `edgepfl serve` with /v1/history"
            ) from None

    def global_model(self, entry: HistoryEntry) -> dict[str, np.ndarray]:
        """The global model a closed round produced, checked against the sha256 the history listed."""
        for _ in range(self.retry.attempts):
            response = self._request("GET", entry.url)
            if hashlib.sha256(response.content).hexdigest() == entry.sha256:
                return _tensors_reply(response)
            self._notify(f"GET {entry.url}: body does not match the sha256 in the history, fetching again")
        raise ServerUnreachable(
            f"GET {entry.url} kept returning bytes that do not match their sha256", "check the network"
        )

    def upload(self, round_id: int, payload: bytes) -> dict[str, Any]:
        """`POST /v1/rounds/{r}/update` with a body from `round.upload_body`; an identical retry is idempotent."""
        response = self._request(
            "POST",
            f"{API_PREFIX}/rounds/{round_id}/update",
            content=payload,
            headers={"Content-Type": "application/octet-stream"},
        )
        return _json_reply(response)

    def post_metrics(self, round_id: int, metrics: EvalMetrics) -> dict[str, Any]:
        """`POST /v1/rounds/{r}/metrics`: the personalized model's held-out evaluation."""
        response = self._request("POST", f"{API_PREFIX}/rounds/{round_id}/metrics", json=metrics.to_json())
        return _json_reply(response)

    def report_refusal(self, round_id: int, reason: str) -> dict[str, Any]:
        """`POST /v1/rounds/{r}/refusal`: this device refused the round's base (the server may roll it back)."""
        response = self._request("POST", f"{API_PREFIX}/rounds/{round_id}/refusal", json={"reason": reason[:200]})
        return _json_reply(response)

    def secure_send(self, url: str, kind: str, body: bytes) -> dict[str, Any]:
        """POST a secure round's message (`kind`: advert, shares, masked or reveal) to URL/kind; its receipt."""
        content_type = "application/octet-stream" if kind == "masked" else "application/json"
        response = self._request("POST", f"{url}/{kind}", content=body, headers={"Content-Type": content_type})
        return _json_reply(response)

    def secure_fetch(self, url: str, what: str) -> tuple[str | None, float]:
        """GET a secure round's book, inbox or unmask request: (its JSON text, 0), or (None, seconds to wait) while
        the server's step is not there yet (202)."""
        response = self._request("GET", f"{url}/{what}")
        if response.status_code == 202:
            wait = _json_reply(response).get("retry_after")
            return None, float(wait) if isinstance(wait, int | float) and 0 < wait < 3600 else 1.0
        return response.text, 0.0

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """Send with retries; return a 2xx response or raise ServerRefused / ServerUnreachable."""
        self._check_origin(url)
        problem = ""
        for attempt in range(self.retry.attempts):
            retry_after = None
            try:
                response = self._http.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                self.traffic.sent += len(response.request.content)
                self.traffic.received += len(response.content)
                if response.status_code < 400:
                    return response
                if response.status_code < 500 and response.status_code not in RETRIED_REFUSALS:
                    raise _refusal(method, url, response)
                problem = f"HTTP {response.status_code} {_error_body(response).get('detail', '')}".strip()
                retry_after = response.headers.get("retry-after")
            if attempt + 1 < self.retry.attempts:
                # the same words on every retry, so a listener can say a lasting failure once (waiting.WaitLog)
                self._notify(_failed(method, url, problem))
                self._sleep(self._backoff(attempt, retry_after))
        raise ServerUnreachable(
            f"{method} {url} failed {self.retry.attempts} times (last: {problem})",
            "check --server and the network; the device resumes where it stopped when run again",
            _failed(method, url, problem),
        )

    def _check_origin(self, url: str) -> None:
        """The bearer token goes only to --server: a URL a reply names must be a path on it (or the same origin)."""
        server = self._http.base_url
        try:
            target = httpx.URL(url)
        except httpx.InvalidURL:
            raise ServerError(
                f"the server named an invalid URL {url[:200]!r}", "use a matching edgepfl version"
            ) from None
        origin = (target.scheme, target.host, target.port)
        if (target.scheme or target.host) and origin != (server.scheme, server.host, server.port):
            raise ServerError(
                f"the server's reply points the device at {url[:200]}, which is not the configured server {server}; "
                "the device token is sent to --server only",
                "ask the operator to check the server's address (a proxy may rewrite replies); pass the right --server",
            )

    def _backoff(self, attempt: int, retry_after: str | None = None) -> float:
        if retry_after is not None:
            try:
                seconds = float(retry_after)
            except ValueError:
                seconds = math.nan
            if 0.0 <= seconds < math.inf:  # a negative, NaN or Inf Retry-After falls back to the backoff below
                return min(seconds, 10 * self.retry.max_delay)
        delay = min(self.retry.first_delay * 2**attempt, self.retry.max_delay)
        return delay * self._jitter.uniform(0.5, 1.0)

    def _notify(self, message: str) -> None:
        if self._on_retry is not None:
            self._on_retry(message)


def _failed(method: str, url: str, problem: str) -> str:
    """A failed request in words: 'GET /v1/task answered HTTP 500 …', or 'got no answer (ConnectError: …)'."""
    if problem.startswith("HTTP "):
        return f"{method} {url} answered {problem}"
    return f"{method} {url} got no answer ({problem})"


def _refusal(method: str, url: str, response: httpx.Response) -> ServerRefused:
    body = _error_body(response)
    error = str(body.get("error", "http_error"))
    detail = str(body.get("detail") or response.reason_phrase)
    fix = str(body.get("fix") or "")
    kind = RoundGone if error in ROUND_GONE_ERRORS else ServerRefused
    return kind(
        f"server refused {method} {url} ({response.status_code} {error}): {detail}", fix, response.status_code, error
    )


def _json_reply(response: httpx.Response) -> dict[str, Any]:
    """The JSON object of a 2xx reply; anything else (a captive portal's HTML page) is one ServerError line."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise _not_the_server(response, "edgepfl JSON")
    return body


def _tensors_reply(response: httpx.Response, encoding: str = "fp32") -> dict[str, np.ndarray]:
    """The tensors of a 2xx safetensors reply, decoded as `encoding`; anything but safetensors is one ServerError
    line, safetensors in another encoding a WireError."""
    try:
        tensors = decode_tensors(response.content)
    except WireError:
        raise _not_the_server(response, "safetensors") from None
    return tensors if encoding == "fp32" else decode_download(response.content, encoding)


def _not_the_server(response: httpx.Response, expected: str) -> ServerError:
    kind = response.headers.get("content-type", "no content type").split(";")[0]
    return ServerError(
        f"the reply to {response.request.method} {response.request.url.path} is not {expected} "
        f"({response.status_code}, {kind}): a captive portal or proxy may have answered",
        "check the network (log in to the Wi-Fi portal) and --server; the device resumes where it stopped "
        "when run again",
    )


def _error_body(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"detail": response.text[:200]}
    return body if isinstance(body, dict) else {"detail": str(body)[:200]}
