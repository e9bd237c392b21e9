"""A device's side of one secure-aggregation round: a pure, I/O-free state machine with JSON state.

    client = ClientSession.start(device, context)      -> client.advert()       (KeyAdvert, to the server)
    client.receive_book(book)                          -> ShareBundle
    client.receive_inbox(inbox, ring_vector)           -> MaskedInput
    client.receive_unmask(request)                     -> UnmaskShares

Save `client.to_json()` (it holds private keys: keep it private) *before* sending what a step returns: after a
kill -9, `ClientSession.from_json` resumes, and repeating a step with the same message returns the same answer
(the same ciphertexts; the same masked vector for the same input), while a different message for a step
already answered is refused, so a device never reveals both shares of one peer nor masks two inputs.
Every refused message is one SecAggError line and leaves the session as it was.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np

from edgepfl.errors import SecAggError
from edgepfl.secagg import keys, shamir
from edgepfl.secagg.config import check_plan
from edgepfl.secagg.messages import (
    KeyAdvert,
    KeyBook,
    MaskedInput,
    ShareBundle,
    ShareInbox,
    UnmaskRequest,
    UnmaskShares,
    b64,
    check_name,
    session_json,
    session_state,
    unb64,
)
from edgepfl.secagg.ring import mask_vector, modulus_mask, pack

PHASES = ("advertised", "shared", "masked", "revealed")
SHARE_PAIR_BYTES = 2 * shamir.SHARE_BYTES  # a sealed message: seed share || mask-key share
SEALED_BYTES = keys.NONCE_BYTES + SHARE_PAIR_BYTES + keys.TAG_BYTES


class ClientSession:
    """One device in one round (module docstring)."""

    def __init__(self, state: dict[str, Any]):
        self._state = state
        self._book: KeyBook | None = None  # parsed once: the graph and indices are derived from it

    @classmethod
    def start(
        cls, device: str, context: str, random_bytes: Callable[[int], bytes] = secrets.token_bytes
    ) -> ClientSession:
        """Fresh key pairs for `device` in the round `context` (e.g. "run-id/round-7")."""
        check_name(device, "device id")
        check_name(context, "round context")
        return cls(
            {
                "device": device,
                "context": context,
                "phase": "advertised",
                "cipher_private": b64(keys.new_private_key(random_bytes)),
                "mask_private": b64(keys.new_private_key(random_bytes)),
            }
        )

    @property
    def device(self) -> str:
        return self._state["device"]

    @property
    def phase(self) -> str:
        """advertised, shared, masked or revealed."""
        return self._state["phase"]

    @property
    def book(self) -> KeyBook:
        """The round's key book (after `receive_book`)."""
        self._need("shared", "masked", "revealed")
        if self._book is None:
            self._book = KeyBook.from_dict(self._state["book"])
        return self._book

    @property
    def partners(self) -> tuple[str, ...]:
        """The neighbours whose shares arrived: the devices this one masks with (after `receive_inbox`)."""
        self._need("masked", "revealed")
        return tuple(sorted(self._state["received"]))

    def advert(self) -> KeyAdvert:
        """This device's public keys."""
        return KeyAdvert(
            self.device, keys.public_key(self._secret("cipher_private")), keys.public_key(self._secret("mask_private"))
        )

    def receive_book(self, book: KeyBook, random_bytes: Callable[[int], bytes] = secrets.token_bytes) -> ShareBundle:
        """Check the key book, draw the self-mask seed, share it and the mask key with the group: sealed shares."""
        if self.phase != "advertised":
            if self._state.get("book") != book.to_dict():
                raise SecAggError(
                    f"device {self.device!r} already has another key book this round",
                    "the server must send one key book per round",
                )
            return ShareBundle(self.device, {d: unb64(s, "sealed share") for d, s in self._state["bundle"].items()})
        self._check_book(book)
        me, plan = self.device, book.plan
        group = (me, *book.neighbours[me])
        holders = [book.indices[d] for d in group]
        self_seed = bytes(random_bytes(shamir.SECRET_BYTES))
        seed_shares = shamir.split(self_seed, holders, plan.threshold, random_bytes)
        key_shares = shamir.split(self._secret("mask_private"), holders, plan.threshold, random_bytes)
        sealed = {}
        for peer in book.neighbours[me]:
            index = book.indices[peer]
            key = self._share_key(book, peer, me, peer)
            sealed[peer] = keys.encrypt(
                key, seed_shares[index] + key_shares[index], keys.info("share", book.context, me, peer), random_bytes
            )
        own = book.indices[me]
        self._state.update(
            phase="shared",
            book=book.to_dict(),
            self_seed=b64(self_seed),
            own_shares={"seed": b64(seed_shares[own]), "key": b64(key_shares[own])},
            bundle={peer: b64(s) for peer, s in sealed.items()},
        )
        return ShareBundle(me, sealed)

    def receive_inbox(self, inbox: ShareInbox, vector: np.ndarray) -> MaskedInput:
        """Open the partners' shares and mask `vector` (ring elements, the key book's length): the upload."""
        self._need("shared", "masked", "revealed")
        book, me = self.book, self.device
        inbox_digest = inbox_digest_of(inbox)
        if self.phase != "shared" and self._state["inbox_digest"] != inbox_digest:
            raise SecAggError(
                f"device {me!r} already masked with other partners this round",
                "the server must send one share inbox per device per round",
            )
        received = self._open_inbox(book, inbox)
        masked = MaskedInput(me, pack(self._mask(book, received, vector), book.plan.bits))
        if self.phase != "shared":
            if masked.digest != self._state["masked_digest"]:
                raise SecAggError(
                    f"device {me!r} already uploaded a different masked vector this round",
                    "upload the same quantized delta again (seed the rounding by the round)",
                )
            return masked
        self._state.update(
            phase="masked",
            inbox_digest=inbox_digest,
            masked_digest=masked.digest,
            received={peer: {"seed": b64(s), "key": b64(k)} for peer, (s, k) in received.items()},
        )
        return masked

    def receive_unmask(self, request: UnmaskRequest) -> UnmaskShares:
        """Reveal each partner's seed share if it survived, its mask-key share if it dropped; never both."""
        self._need("masked", "revealed")
        book, me = self.book, self.device
        if self.phase == "revealed":
            if self._state["request"] != request.to_dict():
                raise SecAggError(
                    f"the server asked device {me!r} again with other survivors; it would learn both "
                    "shares of a device",
                    "the server must send one unmask request per round",
                )
            stored = self._state["reveal"]
            return UnmaskShares(me, *({d: unb64(s, "share") for d, s in stored[k].items()} for k in ("seed", "key")))
        survivors, dropped = set(request.survivors), set(request.dropped)
        asked_both = sorted(survivors & dropped)
        problems = [
            (len(survivors) != len(request.survivors) or len(dropped) != len(request.dropped), "names a device twice"),
            (bool(asked_both), f"asks for both shares of device {asked_both[0]!r}" if asked_both else ""),
            (not (survivors | dropped) <= set(book.devices), "names devices outside the key book"),
            (me not in survivors, f"does not list device {me!r} among the survivors"),
            (
                len(survivors) < book.plan.min_survivors,
                f"lists {len(survivors)} survivors, fewer than the {book.plan.min_survivors} the round needs",
            ),
            (not set(self.partners) <= survivors | dropped, "leaves out a partner that sent its shares"),
        ]
        for bad, problem in problems:
            if bad:
                raise SecAggError(
                    f"the unmask request to device {me!r} {problem}",
                    "the server must list each device that sent shares once: survivor or dropped",
                )
        received = self._state["received"]
        seed_shares = {peer: unb64(received[peer]["seed"], "share") for peer in self.partners if peer in survivors}
        seed_shares[me] = unb64(self._state["own_shares"]["seed"], "share")
        key_shares = {peer: unb64(received[peer]["key"], "share") for peer in self.partners if peer in dropped}
        self._state.update(
            phase="revealed",
            request=request.to_dict(),
            reveal={
                "seed": {d: b64(s) for d, s in seed_shares.items()},
                "key": {d: b64(s) for d, s in key_shares.items()},
            },
        )
        return UnmaskShares(me, seed_shares, key_shares)

    def to_json(self) -> str:
        """The whole state as JSON (private keys and shares included)."""
        return session_json("ClientSession", self._state)

    @classmethod
    def from_json(cls, text: str | bytes) -> ClientSession:
        """Resume from `to_json` text; anything else is one SecAggError line."""
        try:
            state = session_state(text, "ClientSession", PHASES)
            check_name(state["device"], "device id")
            session = cls(state)
            session.advert()
            if session.phase != "advertised":
                session.book.check()
        except (ValueError, KeyError, TypeError, AttributeError, SecAggError):
            raise SecAggError(
                "the saved secure-aggregation state of this device cannot be read",
                "drop this round's state; the device rejoins the next round",
            ) from None
        return session

    def _check_book(self, book: KeyBook) -> None:
        me = self.device
        if book.context != self._state["context"]:
            raise SecAggError(
                f"the key book is for round {book.context!r}, device {me!r} is in {self._state['context']!r}",
                "send the key book of this round",
            )
        book.check()
        check_plan(book.plan, book.config)
        if book.keys.get(me) != self.advert():
            raise SecAggError(
                f"the key book does not carry device {me!r}'s advertised keys",
                "the server must send every advert unchanged",
            )

    def _open_inbox(self, book: KeyBook, inbox: ShareInbox) -> dict[str, tuple[bytes, bytes]]:
        me = self.device
        if inbox.device != me:
            raise SecAggError(
                f"device {me!r} got the share inbox of {inbox.device!r}", "route each inbox to its device"
            )
        strangers = sorted(set(inbox.sealed) - set(book.neighbours[me]))
        if strangers:
            raise SecAggError(
                f"device {me!r} got shares from {strangers[0]!r}, which is not its neighbour",
                "route only shares between neighbours",
            )
        if len(inbox.sealed) + 1 < book.plan.threshold:
            raise SecAggError(
                f"only {len(inbox.sealed)} neighbours of device {me!r} sent shares; its group cannot "
                f"reach the threshold {book.plan.threshold}",
                "this device sits this round out",
            )
        received = {}
        for peer, sealed in inbox.sealed.items():
            what = f"the shares from {peer!r} to {me!r}"
            associated = keys.info("share", book.context, peer, me)
            plain = keys.decrypt(self._share_key(book, peer, peer, me), sealed, associated, what)
            if len(plain) != SHARE_PAIR_BYTES:
                raise SecAggError(f"{what} have {len(plain)} bytes, not {SHARE_PAIR_BYTES}", "seal two 33-byte shares")
            shamir.read_share(plain[: shamir.SHARE_BYTES], what)
            shamir.read_share(plain[shamir.SHARE_BYTES :], what)
            received[peer] = (plain[: shamir.SHARE_BYTES], plain[shamir.SHARE_BYTES :])
        return received

    def _mask(self, book: KeyBook, partners: dict[str, Any], vector: np.ndarray) -> np.ndarray:
        bits, length, me = book.plan.bits, book.vector_length, self.device
        values = np.asarray(vector)
        if (
            values.shape != (length,)
            or values.dtype.kind not in "ui"
            or (values.size and (values.min() < 0 or values.max() > int(modulus_mask(bits))))
        ):
            raise SecAggError(
                f"device {me!r}'s ring vector is not {length} integers in [0, 2^{bits})",
                "quantize with edgepfl.secagg.quantize_delta for this key book",
            )
        masked = values.astype(np.uint32) + mask_vector(unb64(self._state["self_seed"], "seed"), length, bits)
        for peer in sorted(partners):
            seed = pairwise_seed(book, self._secret("mask_private"), me, peer)
            if book.indices[me] < book.indices[peer]:
                masked += mask_vector(seed, length, bits)
            else:
                masked -= mask_vector(seed, length, bits)
        return masked & modulus_mask(bits)

    def _share_key(self, book: KeyBook, peer: str, sender: str, recipient: str) -> bytes:
        secret = keys.agree(self._secret("cipher_private"), book.keys[peer].cipher_key, peer)
        return keys.derive(secret, "share", book.context, sender, recipient)

    def _secret(self, name: str) -> bytes:
        return unb64(self._state[name], name)

    def _need(self, *phases: str) -> None:
        if self.phase not in phases:
            raise SecAggError(
                f"device {self.device!r} is at step {self.phase!r} of secure aggregation, this message "
                f"belongs to step {' or '.join(phases)}",
                "send the messages in protocol order",
            )


def pairwise_seed(book: KeyBook, mask_private: bytes, device: str, peer: str) -> bytes:
    """The mask seed `device` shares with `peer`: HKDF of their X25519 secret, the two ids in index order."""
    low, high = sorted((device, peer), key=book.indices.__getitem__)
    return keys.derive(keys.agree(mask_private, book.keys[peer].mask_key, peer), "mask", book.context, low, high)


def inbox_digest_of(inbox: ShareInbox) -> str:
    """Hex SHA-256 of the inbox's device and (sender, sealed) pairs in sender order, each 2-byte length-prefixed."""
    digest = hashlib.sha256()
    parts = [inbox.device.encode()]
    for peer in sorted(inbox.sealed):
        parts += [peer.encode(), inbox.sealed[peer]]
    for part in parts:
        digest.update(len(part).to_bytes(2, "big") + part)
    return digest.hexdigest()
