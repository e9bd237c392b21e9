"""Who a device is: bearer tokens, enrollment with the shared secret and its per-address limit."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

from edgepfl.server.config import ServerConfig
from edgepfl.server.errors import Refused
from edgepfl.server.ratelimit import FailureLimiter
from edgepfl.server.store import AlreadyEnrolled, Store
from edgepfl.server.tokens import DeviceNameError, EnrollKeyError, hash_token, issue_token

log = logging.getLogger("edgepfl.server")


class Enrollment:
    """Authenticates devices and enrolls new ones (POST /v1/enroll) for one state folder."""

    def __init__(self, config: ServerConfig, store: Store, clock: Callable[[], float]):
        self.config = config
        self.store = store
        self.clock = clock
        self.limiter = FailureLimiter(config.enroll_max_failures, config.enroll_window)

    def authenticate(self, authorization: str | None) -> str:
        """The device name a bearer token belongs to; 401 otherwise."""
        scheme, _, token = (authorization or "").partition(" ")
        device = self.store.device_for_token(hash_token(token.strip())) if scheme.lower() == "bearer" else None
        if device is None:
            raise Refused(
                "unauthorized",
                "missing or invalid device token",
                "send `Authorization: Bearer <token>` with a token from `edgepfl serve tokens add NAME`",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return device

    def enroll(self, secret: str | None, name: str, address: str, key: str | None = None) -> str:
        """Enroll `name` if `secret` is the shared enrollment secret, and return its new token (403/429/401/422/409).

        An enrolled name gets a new token (the old one stops working) only when `key` is the enrollment
        key it was enrolled with: the device retries after a lost reply.
        """
        self.check_enroll_secret(secret, address)
        try:
            token = issue_token(self.store, name, self.clock(), enroll_key=key)
        except DeviceNameError as error:
            raise Refused("invalid_device_name", error.problem, error.fix) from None
        except EnrollKeyError as error:
            raise Refused("invalid_enroll_key", error.problem, error.fix) from None
        except AlreadyEnrolled as error:
            raise Refused(
                "already_enrolled",
                error.problem,
                "pick another name, or ask the operator to run `edgepfl serve tokens add NAME --replace`",
            ) from None
        log.info("device %r enrolled with the shared secret", name)
        return token

    def check_enroll_secret(self, secret: str | None, address: str) -> None:
        """403 if self-enrollment is closed, 429 while `address` is blocked, 401 unless `secret` is the shared secret.

        Each 401 counts against `address`; a blocked address is refused before its secret is compared,
        so guessing stops there even with the right secret.
        """
        if self.config.enroll_secret is None:
            raise Refused(
                "enrollment_closed",
                "this server takes no self-enrollment (it was started without --enroll-secret-file)",
                "ask the operator for a token (`edgepfl serve tokens add NAME`)",
            )
        retry_after = self.limiter.retry_after(address)
        if retry_after is not None:
            raise Refused(
                "too_many_attempts",
                f"too many wrong enrollment secrets from {address} (the limit is "
                f"{self.config.enroll_max_failures} per {self.config.enroll_window} s)",
                f"wait {retry_after} s, then enroll with the secret of the server's --enroll-secret-file",
                headers={"Retry-After": str(retry_after)},
            )
        if secret is None or not hmac.compare_digest(secret.encode(), self.config.enroll_secret.encode()):
            self.limiter.record_failure(address)
            raise Refused(
                "unauthorized",
                "missing or wrong enrollment secret",
                "send `Authorization: Bearer <secret>` with the secret of the server's --enroll-secret-file",
                headers={"WWW-Authenticate": "Bearer"},
            )
