"""Who a device is: bearer tokens, enrollment with the shared secret or a join link, and the per-address limit."""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import Callable

from edgepfl.server.config import ServerConfig
from edgepfl.server.errors import Refused
from edgepfl.server.joinlinks import NEW_LINK_FIX, JoinLink, JoinLinkClosed, JoinLinks, closed_refusal
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
        self.join_links = JoinLinks(store)

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
        """Enroll `name` if `secret` is the shared enrollment secret or an open join link's, and return its new
        token (403/429/401/410/422/409).

        An enrolled name gets a new token (the old one stops working) only when `key` is the enrollment
        key it was enrolled with: the device retries after a lost reply.
        """
        link = self.check_enroll_secret(secret, address)
        add_device = functools.partial(self.join_links.enroll, link.link_id) if link is not None else None
        try:
            token = issue_token(self.store, name, self.clock(), enroll_key=key, add_device=add_device)
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
        except JoinLinkClosed as error:
            raise closed_refusal(error.link, self.clock()) from None
        log.info("device %r enrolled with %s", name, f"join link {link.link_id}" if link else "the shared secret")
        return token

    def check_enroll_secret(self, secret: str | None, address: str, join_links: bool = True) -> JoinLink | None:
        """Which secret `secret` is: the shared one (None) or a join link's (with `join_links`); else refused.

        A right secret always passes, even from an address that sent too many wrong ones: phones behind one
        NAT share an address. A revoked join link is 410 (an expired or used-up one is refused by `enroll`,
        which lets a retried enrollment through); neither counts as a guess. Without a shared secret and with
        no join link ever made, enrollment is closed (403). Only a wrong or missing secret counts against
        `address`: 401, or 429 with Retry-After once it has `--enroll-max-failures` within `--enroll-window`.
        """
        shared = self.config.enroll_secret
        if secret is not None and shared is not None and hmac.compare_digest(secret.encode(), shared.encode()):
            return None
        link = self.join_links.find(secret) if join_links and secret is not None else None
        if link is not None:
            if link.revoked is not None:
                raise closed_refusal(link, self.clock())
            return link
        if shared is None and not (join_links and self.join_links.exist()):
            raise Refused(
                "enrollment_closed",
                "this server takes no self-enrollment (it was started without --enroll-secret-file "
                "and has no join link)",
                "ask the operator for a join link (`edgepfl serve join-link`) or a token "
                "(`edgepfl serve tokens add NAME`)",
            )
        retry_after = self.limiter.retry_after(address)
        self.limiter.record_failure(address)  # a guesser that goes on stays locked out
        if retry_after is not None:
            raise Refused(
                "too_many_attempts",
                f"too many wrong enrollment secrets from {address} (the limit is "
                f"{self.config.enroll_max_failures} per {self.config.enroll_window} s)",
                f"wait {retry_after} s, then use a current join link or the secret of the server's "
                "--enroll-secret-file",
                headers={"Retry-After": str(retry_after)},
            )
        raise Refused(
            "unauthorized",
            "missing or wrong enrollment secret",
            f"{NEW_LINK_FIX}; a device enrolling with `edgepfl device enroll` sends "
            "`Authorization: Bearer <secret>` with the secret of the server's --enroll-secret-file",
            headers={"WWW-Authenticate": "Bearer"},
        )
