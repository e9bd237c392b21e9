"""Join links: a phone enrolls by opening `/device/#enroll=SECRET`; a link made here expires, has a device cap, or
both, so a leaked QR code does not enroll devices for ever.

Each link has its own random secret (256 bits, made by the server, so guessing it is hopeless); the state keeps only
its sha256, when it expires, how many devices it may enroll and how many it did, in SQLite (`join_links`), so a
running server sees a new link at once and after a restart. The secret travels in the URL fragment, which
browsers never send to a server. The fleet-wide secret of `--enroll-secret-file` keeps working beside the links.
"""

from __future__ import annotations

import math
import re
import secrets
import sqlite3
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

from pydantic import BaseModel, Field, field_validator, model_validator

from edgepfl.errors import StateError, UsageError
from edgepfl.options import FLAG, Composed, titled
from edgepfl.server.errors import Refused
from edgepfl.server.store import AlreadyEnrolled, Store, insert_device
from edgepfl.server.tokens import hash_token

DEVICE_PATH = "/device/"
SECRET_BYTES = 32
BASE_URL_KEY = "join_base_url"  # meta: the address `serve` last announced, the default base of a new link
NEW_LINK_FIX = "ask the operator for a new join link (from the server's /join page or `edgepfl serve join-link`)"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")


def parse_duration(text: str) -> float | None:
    """Seconds in `30m`, `1h`, `2d`, `1w`, `90` (seconds), or None for `never`; ValueError otherwise."""
    text = text.strip().lower()
    if text == "never":
        return None
    match = _DURATION.fullmatch(text)
    if match is None or float(match[1]) <= 0 or not math.isfinite(float(match[1])):
        raise ValueError(f"{text!r} is not a duration: write e.g. 30m, 1h, 2d, 1w or never")
    return float(match[1]) * _UNITS[match[2] or "s"]


class JoinLinkOptions(BaseModel):
    """What a new join link may do: how long it enrolls devices, and how many."""

    model_config = titled("What the link may do")

    expires: Annotated[
        str, Field(description="how long the link enrolls devices (30m, 1h, 2d, 1w) or never", examples=["1h"])
    ] = "24h"
    max_devices: Annotated[int | None, Field(ge=1, description="devices the link may enroll (default: no cap)")] = None
    single_use: Annotated[
        bool,
        Field(description="the link enrolls one device (--max-devices 1)", json_schema_extra={FLAG: "--single-use"}),
    ] = False

    @field_validator("expires")
    @classmethod
    def _duration(cls, value: str) -> str:
        parse_duration(value)
        return value

    @model_validator(mode="after")
    def _one_cap(self) -> JoinLinkOptions:
        if self.single_use and self.max_devices not in (None, 1):
            raise UsageError(
                f"--single-use and --max-devices {self.max_devices} disagree", "pass one of them, not both"
            )
        return self

    @property
    def seconds(self) -> float | None:
        """The link's lifetime in seconds (None: never expires)."""
        return parse_duration(self.expires)

    @property
    def cap(self) -> int | None:
        """How many devices the link may enroll (None: no cap)."""
        return 1 if self.single_use else self.max_devices


class JoinLinkCommand(Composed):
    """`edgepfl serve join-link`: a new join link of a server's state folder."""

    model_config = titled("Join link")

    state: Annotated[Path | None, Field(description="the server's state folder")] = None
    link: JoinLinkOptions = Field(default_factory=JoinLinkOptions)
    base_url: Annotated[
        str | None,
        Field(description="the server as phones reach it, e.g. https://host:8080 (default: what `serve` printed)"),
    ] = None
    qr: Annotated[bool | None, Field(description="print the QR code (default: when stdout is a terminal)")] = None


@dataclass(frozen=True)
class JoinLink:
    """A join link as stored: only the sha256 of its secret, when it stops, how many devices it may and did enroll."""

    link_id: int
    secret_hash: str
    created: float
    expires: float | None  # None: never
    max_devices: int | None  # None: no cap
    used: int  # devices enrolled through it (a retried enrollment counts once)
    revoked: float | None = None

    def open_at(self, now: float) -> bool:
        """Whether the link may enroll one more device at `now`."""
        return (
            self.revoked is None
            and (self.expires is None or now < self.expires)
            and (self.max_devices is None or self.used < self.max_devices)
        )

    def terms(self) -> str:
        """What the link was made to do: `expires 2026-11-27 14:05 UTC, at most 20 devices`."""
        until = f"expires {utc(self.expires)}" if self.expires is not None else "never expires"
        if self.max_devices is None:
            return f"{until}, any number of devices"
        return f"{until}, {'one device' if self.max_devices == 1 else f'at most {self.max_devices} devices'}"

    def describe(self, now: float) -> str:
        """One line for `join-link list`: id, state, terms, devices enrolled."""
        if self.revoked is not None:
            state = f"revoked {utc(self.revoked)}"
        elif self.expires is not None and now >= self.expires:
            state = "expired"
        elif not self.open_at(now):
            state = "used up"
        else:
            state = "open" + (f" (for {_span(self.expires - now)})" if self.expires is not None else "")
        return f"{self.link_id}\t{state}\t{self.terms()}\t{self.used} enrolled"


class JoinLinkClosed(StateError):
    """A join link that is revoked, expired or used up (`link` as the refusing transaction read it)."""

    def __init__(self, link: JoinLink):
        super().__init__(f"join link {link.link_id} is closed", NEW_LINK_FIX)
        self.link = link


class JoinLinks:
    """The join links of one state folder (table `join_links`, made by the store's migration 4)."""

    def __init__(self, store: Store):
        self.store = store

    def make(self, options: JoinLinkOptions, now: float) -> tuple[JoinLink, str]:
        """A new link and its secret (shown once: only its sha256 is stored)."""
        secret = secrets.token_urlsafe(SECRET_BYTES)
        seconds = options.seconds
        expires = now + seconds if seconds is not None else None
        with self.store.transaction() as db:
            link_id = db.execute(
                "INSERT INTO join_links (secret_hash, created, expires, max_devices) VALUES (?, ?, ?, ?)",
                (hash_token(secret), now, expires, options.cap),
            ).lastrowid
            return _read(db, "link_id = ?", (link_id,))[0], secret

    def find(self, secret: str) -> JoinLink | None:
        """The link whose secret this is, open or closed, or None."""
        with self.store.transaction() as db:
            found = _read(db, "secret_hash = ?", (hash_token(secret),))
        return found[0] if found else None

    def all(self) -> list[JoinLink]:
        """Every link made, oldest first."""
        with self.store.transaction() as db:
            return _read(db)

    def exist(self) -> bool:
        """Whether any link was ever made (POST /v1/enroll is then open without a fleet secret)."""
        with self.store.transaction() as db:
            return bool(db.execute("SELECT EXISTS (SELECT 1 FROM join_links)").fetchone()[0])

    def revoke(self, link_id: int, now: float) -> JoinLink:
        """Close a link for good (UsageError if there is none by that id)."""
        with self.store.transaction() as db:
            db.execute("UPDATE join_links SET revoked = ? WHERE link_id = ? AND revoked IS NULL", (now, link_id))
            found = _read(db, "link_id = ?", (link_id,))
        if not found:
            raise UsageError(f"there is no join link {link_id}", "see `edgepfl serve join-link list --state S`")
        return found[0]

    def enroll(self, link_id: int, name: str, token_hash: str, created: float, enroll_key_hash: str | None) -> None:
        """Enroll a device through a link and count it there, in one transaction: of two phones racing for a
        link's last place, one is enrolled and the other gets JoinLinkClosed.

        The link must be open at `created`. A retried enrollment (the name enrolled with this same key) needs it
        only unrevoked and is not counted again, so a phone whose reply was lost gets its token even from a
        single-use link. Otherwise the rule of Store.add_device holds (AlreadyEnrolled).
        """
        with self.store.transaction() as db:
            link = _read(db, "link_id = ?", (link_id,))[0]
            try:
                retry = insert_device(db, name, token_hash, created, False, enroll_key_hash)
            except AlreadyEnrolled:
                if not link.open_at(created):
                    raise JoinLinkClosed(link) from None
                raise
            if link.revoked is not None or not (retry or link.open_at(created)):
                raise JoinLinkClosed(link)  # the transaction rolls the device back
            if not retry:
                db.execute("UPDATE join_links SET used = used + 1 WHERE link_id = ?", (link_id,))


def closed_refusal(link: JoinLink, now: float) -> Refused:
    """The one-line refusal of a closed link, saying why and what to do (HTTP 410)."""
    if link.revoked is not None:
        return Refused("join_link_revoked", "this join link was revoked by the server's operator", NEW_LINK_FIX)
    if link.expires is not None and now >= link.expires:
        return Refused("join_link_expired", f"this join link expired at {utc(link.expires)}", NEW_LINK_FIX)
    if link.max_devices == 1:
        return Refused("join_link_used_up", "this single-use join link was used already", NEW_LINK_FIX)
    return Refused(
        "join_link_used_up", f"this join link has enrolled the {link.max_devices} devices it was made for", NEW_LINK_FIX
    )


def join_url(base_url: str, secret: str) -> str:
    """The link a phone opens: the device page with the enrollment secret in the fragment (never sent to a server)."""
    return f"{base_url.rstrip('/')}{DEVICE_PATH}#enroll={quote(secret, safe='')}"


def utc(seconds: float) -> str:
    """A time as `2026-11-27 14:05 UTC` (a phone and the server may be in different time zones)."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))


def _span(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(seconds, 1):.0f} s"


_COLUMNS = ", ".join(field.name for field in fields(JoinLink))


def _read(db: sqlite3.Connection, where: str = "1", args: tuple = ()) -> list[JoinLink]:
    rows = db.execute(f"SELECT {_COLUMNS} FROM join_links WHERE {where} ORDER BY link_id", args).fetchall()
    return [JoinLink(*row) for row in rows]
