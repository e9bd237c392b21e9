"""The messages of one secure-aggregation round, in the order they travel, and their JSON (bytes as base64).

device -> server  KeyAdvert      two X25519 public keys (share encryption, masks)
server -> device  KeyBook        the settings, the plan, the server's randomness and every advertised key
device -> server  ShareBundle    per neighbour: AES-GCM(self-mask seed share || mask-key share)
server -> device  ShareInbox     the bundles' parts addressed to this device, from devices that sent theirs
device -> server  MaskedInput    the masked ring vector (packed; `to_bytes` frames it without base64)
server -> device  UnmaskRequest  who uploaded (survivors) and who shared but did not (dropped)
device -> server  UnmaskShares   seed shares of survivors, mask-key shares of the dropped; never both for one
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from edgepfl.errors import SecAggError
from edgepfl.secagg.config import Plan, SecAggConfig, ring_length
from edgepfl.secagg.graph import graph_seed, neighbour_map

NAME = re.compile(r"[!-~]{1,200}")  # device ids and round contexts: printable ASCII, sorted alike in JS
FRAME = b"EPSA1"  # MaskedInput.to_bytes: magic, 4-byte big-endian header length, JSON header, packed vector


def check_name(name: Any, what: str) -> str:
    """A device id or context: 1-200 printable ASCII characters without spaces."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SecAggError(f"{what} {str(name)[:80]!r} is not 1-200 printable ASCII characters", f"use a plain {what}")
    return name


@dataclass(frozen=True)
class KeyAdvert:
    """A device's public keys for this round: one to encrypt shares to it, one to agree on pairwise masks."""

    device: str
    cipher_key: bytes
    mask_key: bytes

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "cipher_key": b64(self.cipher_key), "mask_key": b64(self.mask_key)}

    @classmethod
    def from_dict(cls, data: Any) -> KeyAdvert:
        data = _fields(data, "key advert", ("device", "cipher_key", "mask_key"))
        device = check_name(data["device"], "device id")
        return cls(
            device,
            unb64(data["cipher_key"], f"{device}'s cipher key", 32),
            unb64(data["mask_key"], f"{device}'s mask key", 32),
        )


@dataclass(frozen=True)
class KeyBook:
    """Everything a device needs to share and mask: settings, plan, randomness, the keys in device order."""

    context: str
    config: SecAggConfig
    randomness: bytes
    adverts: tuple[KeyAdvert, ...]
    plan: Plan
    base_size: int  # d: values of the shared tensors

    @cached_property
    def devices(self) -> tuple[str, ...]:
        """Device ids in sorted order."""
        return tuple(advert.device for advert in self.adverts)

    @cached_property
    def indices(self) -> dict[str, int]:
        """Each device's Shamir index: its position in `devices`, from 1."""
        return {device: i + 1 for i, device in enumerate(self.devices)}

    @cached_property
    def keys(self) -> dict[str, KeyAdvert]:
        """Adverts by device."""
        return {advert.device: advert for advert in self.adverts}

    @cached_property
    def seed(self) -> bytes:
        """The public seed of the graph and the rotation."""
        return graph_seed(self.context, self.randomness, [(a.device, a.cipher_key, a.mask_key) for a in self.adverts])

    @cached_property
    def neighbours(self) -> dict[str, tuple[str, ...]]:
        """Each device's neighbours."""
        return neighbour_map(self.devices, self.seed, self.plan.neighbours)

    @property
    def vector_length(self) -> int:
        """Ring elements of every masked vector."""
        return ring_length(self.base_size, self.plan, self.config)

    def check(self) -> None:
        """Internal consistency: sorted unique devices, n as planned, 2n distinct keys, a positive size."""
        if list(self.devices) != sorted(set(self.devices)) or len(self.devices) != self.plan.devices:
            raise SecAggError(
                "the key book's devices are not sorted, unique and as many as planned",
                "the server must send one advert per device, sorted by device id",
            )
        keys = [key for a in self.adverts for key in (a.cipher_key, a.mask_key)]
        if len(set(keys)) != len(keys):
            raise SecAggError("two advertised public keys in the key book are equal", "every key pair must be fresh")
        if not isinstance(self.base_size, int) or self.base_size < 1 or len(self.randomness) != 32:
            raise SecAggError("the key book's size or randomness is malformed", "send 32 random bytes and d >= 1")

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "config": self.config.to_dict(),
            "randomness": b64(self.randomness),
            "adverts": [a.to_dict() for a in self.adverts],
            "plan": vars(self.plan),
            "base_size": self.base_size,
        }

    @classmethod
    def from_dict(cls, data: Any) -> KeyBook:
        data = _fields(data, "key book", ("context", "config", "randomness", "adverts", "plan", "base_size"))
        if not isinstance(data["adverts"], list) or not isinstance(data["plan"], dict):
            raise SecAggError("the key book is malformed", "send adverts as a list and the plan as an object")
        numbers = [*data["plan"].values(), data["base_size"]]
        try:  # JSON numbers only: not text, not a boolean, not a float json reads as infinity
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers):
                raise TypeError
            plan = Plan(**data["plan"])
        except TypeError:
            raise SecAggError(
                "the key book's plan or base size is malformed",
                "send devices, neighbours, threshold, min_survivors and bits as integers",
            ) from None
        book = cls(
            check_name(data["context"], "round context"),
            SecAggConfig.from_dict(data["config"]),
            unb64(data["randomness"], "the key book's randomness", 32),
            tuple(KeyAdvert.from_dict(a) for a in data["adverts"]),
            plan,
            data["base_size"],
        )
        book.check()
        return book


@dataclass(frozen=True)
class ShareBundle:
    """A device's encrypted shares, one sealed message per neighbour."""

    device: str
    sealed: Mapping[str, bytes]

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "sealed": b64_map(self.sealed)}

    @classmethod
    def from_dict(cls, data: Any) -> ShareBundle:
        data = _fields(data, "share bundle", ("device", "sealed"))
        device = check_name(data["device"], "device id")
        return cls(device, unb64_map(data["sealed"], f"{device}'s share bundle"))


@dataclass(frozen=True)
class ShareInbox:
    """The sealed shares addressed to one device, by sender: its masking partners this round."""

    device: str
    sealed: Mapping[str, bytes]

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "sealed": b64_map(self.sealed)}

    @classmethod
    def from_dict(cls, data: Any) -> ShareInbox:
        data = _fields(data, "share inbox", ("device", "sealed"))
        device = check_name(data["device"], "device id")
        return cls(device, unb64_map(data["sealed"], f"{device}'s share inbox"))


@dataclass(frozen=True)
class MaskedInput:
    """A device's masked ring vector, packed (edgepfl.secagg.ring.pack)."""

    device: str
    masked: bytes

    @property
    def digest(self) -> str:
        """SHA-256 of the packed vector: what the server keeps to recognise a re-sent upload."""
        return hashlib.sha256(self.masked).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "masked": b64(self.masked)}

    @classmethod
    def from_dict(cls, data: Any) -> MaskedInput:
        data = _fields(data, "masked input", ("device", "masked"))
        device = check_name(data["device"], "device id")
        return cls(device, unb64(data["masked"], f"{device}'s masked input"))

    def to_bytes(self) -> bytes:
        """A binary frame: b"EPSA1", 4-byte big-endian header length, JSON {"device"}, the packed vector."""
        header = json.dumps({"device": self.device}).encode()
        return FRAME + len(header).to_bytes(4, "big") + header + self.masked

    @classmethod
    def from_bytes(cls, payload: bytes) -> MaskedInput:
        """Read what `to_bytes` wrote; anything else is one SecAggError line."""
        size = int.from_bytes(payload[len(FRAME) : len(FRAME) + 4], "big") if len(payload) >= len(FRAME) + 4 else -1
        start = len(FRAME) + 4
        if payload[: len(FRAME)] != FRAME or size < 0 or start + size > len(payload):
            raise SecAggError("a masked input frame is malformed", "send MaskedInput.to_bytes()")
        header = _parse(payload[start : start + size], "masked input header")
        device = check_name(_fields(header, "masked input header", ("device",))["device"], "device id")
        return cls(device, bytes(payload[start + size :]))


@dataclass(frozen=True)
class UnmaskRequest:
    """Who uploaded a masked vector (survivors) and who sent shares but no vector (dropped); same for all."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"survivors": list(self.survivors), "dropped": list(self.dropped)}

    @classmethod
    def from_dict(cls, data: Any) -> UnmaskRequest:
        data = _fields(data, "unmask request", ("survivors", "dropped"))
        lists = [data[key] for key in ("survivors", "dropped")]
        if not all(isinstance(items, list) for items in lists):
            raise SecAggError("the unmask request's lists are malformed", "send survivors and dropped as lists")
        return cls(*(tuple(check_name(d, "device id") for d in items) for items in lists))


@dataclass(frozen=True)
class UnmaskShares:
    """A device's revealed shares: of survivors' self-mask seeds, of dropped devices' mask keys."""

    device: str
    seed_shares: Mapping[str, bytes]
    key_shares: Mapping[str, bytes]

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "seed_shares": b64_map(self.seed_shares), "key_shares": b64_map(self.key_shares)}

    @classmethod
    def from_dict(cls, data: Any) -> UnmaskShares:
        data = _fields(data, "unmask shares", ("device", "seed_shares", "key_shares"))
        device = check_name(data["device"], "device id")
        return cls(
            device,
            unb64_map(data["seed_shares"], f"{device}'s seed shares"),
            unb64_map(data["key_shares"], f"{device}'s mask-key shares"),
        )


MESSAGES = {
    cls.__name__: cls for cls in (KeyAdvert, KeyBook, ShareBundle, ShareInbox, MaskedInput, UnmaskRequest, UnmaskShares)
}


def to_json(message: Any) -> str:
    """A message as JSON text, its kind named in `type`."""
    return json.dumps({"type": type(message).__name__, **message.to_dict()})


def from_json(text: str | bytes, kind: type | None = None) -> Any:
    """A message from `to_json` text; the wrong kind, a malformed field or bad base64 is one SecAggError line."""
    data = _parse(text, "message")
    name = data.pop("type", None) if isinstance(data, dict) else None
    found = MESSAGES.get(name) if isinstance(name, str) else None
    if found is None or (kind is not None and found is not kind):
        wanted = kind.__name__ if kind else "a secure-aggregation message"
        raise SecAggError(f"a message is not {wanted}", "send the message the protocol step asks for")
    return found.from_dict(data)


SESSION_VERSION = 1  # the format of a saved ClientSession or ServerSession


def session_json(kind: str, state: dict[str, Any]) -> str:
    """A session's whole state as JSON, under its kind and the format's version."""
    return json.dumps({"type": kind, "version": SESSION_VERSION, **state})


def session_state(text: str | bytes, kind: str, phases: tuple[str, ...]) -> dict[str, Any]:
    """The state `session_json(kind, ...)` wrote, in one of `phases`; anything else raises ValueError, KeyError or
    TypeError, which the session turns into its own SecAggError line (what to do differs on a device and a server)."""
    try:
        state = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep") from None
    if state.pop("type") != kind or state.pop("version") != SESSION_VERSION or state["phase"] not in phases:
        raise ValueError(f"not a saved {kind}")
    return state


def b64(payload: bytes) -> str:
    """Standard base64 text of bytes."""
    return base64.b64encode(payload).decode("ascii")


def unb64(text: Any, what: str, length: int | None = None) -> bytes:
    """Bytes of base64 text; bad base64 or the wrong length is one SecAggError line naming `what`."""
    try:
        payload = base64.b64decode(text.encode("ascii"), validate=True)
    except (AttributeError, UnicodeEncodeError, binascii.Error, ValueError):
        raise SecAggError(f"{what} is not base64 text", "send bytes as standard base64") from None
    if length is not None and len(payload) != length:
        raise SecAggError(f"{what} has {len(payload)} bytes, not {length}", f"send {length} bytes")
    return payload


def b64_map(items: Mapping[str, bytes]) -> dict[str, str]:
    """{device: base64} in device order."""
    return {device: b64(items[device]) for device in sorted(items)}


def unb64_map(data: Any, what: str) -> dict[str, bytes]:
    """{device: bytes} from {device: base64}."""
    if not isinstance(data, dict):
        raise SecAggError(f"{what} is not an object of device -> base64", "send {device: base64}")
    return {check_name(device, "device id"): unb64(text, f"{what} for {device}") for device, text in data.items()}


def _parse(text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        raise SecAggError(f"a {what} is not JSON", "send what to_json writes") from None


def _fields(data: Any, what: str, names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, dict) or set(data) != set(names):
        raise SecAggError(
            f"a {what} does not have exactly the fields {', '.join(names)}",
            f"send a {what} as edgepfl.secagg.messages writes it",
        )
    return data
