"""Device names, enrollment keys and bearer tokens: the rules every enrollment path checks, and what is stored
of a token (its sha256, never the token)."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from edgepfl.errors import UsageError

if TYPE_CHECKING:
    from edgepfl.server.store import Store

OPERATOR_TOKEN_KEY = "operator_token_hash"  # meta: the hash of the operator's token, which sees device names
DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ENROLL_KEY = re.compile(r"[!-~]{16,200}")  # printable ASCII: a device's random key for retrying its enrollment


def hash_token(token: str) -> str:
    """What the store keeps of a device token (or enrollment key): its sha256, never the token."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def check_device_name(name: str) -> None:
    """Refuse a device name outside the one rule every enrollment path follows (raises DeviceNameError)."""
    if not DEVICE_NAME.fullmatch(name):
        raise DeviceNameError(f"device name {name[:80]!r} is not allowed", "use 1-64 letters, digits, '.', '_' or '-'")


def check_enroll_key(key: str) -> None:
    """Refuse an enrollment key outside 16-200 printable ASCII characters (raises EnrollKeyError)."""
    if not ENROLL_KEY.fullmatch(key):
        raise EnrollKeyError(
            "the enrollment key is not 16-200 printable ASCII characters",
            "send a random key, e.g. secrets.token_urlsafe(32), or none",
        )


def issue_token(
    store: Store,
    name: str,
    created: float,
    replace: bool = False,
    enroll_key: str | None = None,
    add_device: Callable[[str, str, float, str | None], None] | None = None,
) -> str:
    """Enroll `name` with a new random bearer token and return it; only its hash is stored.

    With `enroll_key`, its hash is kept too, and enrolling the enrolled name again with the same key
    issues a new token in place of the old one: a device whose reply was lost retries safely.
    `add_device(name, token_hash, created, enroll_key_hash)` stores the device in place of `store.add_device`
    (a join link counts the device in the same transaction).
    """
    check_device_name(name)
    if enroll_key is not None:
        check_enroll_key(enroll_key)
    token = secrets.token_urlsafe(32)
    key_hash = hash_token(enroll_key) if enroll_key is not None else None
    if add_device is not None:
        add_device(name, hash_token(token), created, key_hash)
    else:
        store.add_device(name, hash_token(token), created, replace=replace, enroll_key_hash=key_hash)
    return token


def issue_operator_token(store: Store) -> str:
    """A new operator token (the previous one stops working); only its hash is stored."""
    token = secrets.token_urlsafe(32)
    store.set_meta({OPERATOR_TOKEN_KEY: hash_token(token)})
    return token


def is_operator_token(store: Store, token: str) -> bool:
    """Whether `token` is the operator's (the one credential whose status view names devices)."""
    stored = store.get_meta(OPERATOR_TOKEN_KEY)
    return stored is not None and hmac.compare_digest(stored, hash_token(token))


class DeviceNameError(UsageError):
    """A device name that the enrollment rule refuses."""


class EnrollKeyError(UsageError):
    """An enrollment key that is not a short printable string."""
