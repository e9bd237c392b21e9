"""The server's side of one secure-aggregation round: a pure, I/O-free state machine with JSON state.

    server = ServerSession.start(context, config, base_size)
    server.receive_advert(advert) ...       server.close_keys()   -> KeyBook (to every device)
    server.receive_shares(bundle) ...       server.close_shares() -> {device: ShareInbox}
    server.receive_masked(upload) ...       server.close_inputs() -> UnmaskRequest (to every survivor)
    server.receive_unmask(shares) ...       server.ready(); server.finish() -> the exact sum (ring elements)

`receive_*` returns True for a new message, False for an exact repeat (nothing changes, so a device that
resends after a crash is never counted twice); any other bad message is one SecAggError line naming the device
and leaves the session as it was. A `close_*` the round cannot survive (too few devices left) marks the session
failed, with the same line from then on. Save `to_json()` after every call that changed it; the running sum of
the masked vectors is part of the state (uint32, mod 2^32, which 2^b divides), so an upload is in the sum exactly
when it is in the saved state.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from edgepfl.errors import SecAggError
from edgepfl.secagg import keys, shamir
from edgepfl.secagg.client import SEALED_BYTES, pairwise_seed
from edgepfl.secagg.config import Plan, SecAggConfig, make_plan
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
from edgepfl.secagg.quantize import SecureSum, VectorLayout, dequantize_sum
from edgepfl.secagg.ring import mask_vector, modulus_mask, pack, unpack

PHASES = ("keys", "shares", "inputs", "unmask", "done", "failed")
TOO_MANY_DROPPED = (
    "more devices dropped than the threshold allows: at most n - t may, and in SecAgg+ at most "
    "k + 1 - t of one device's group"
)


class ServerSession:
    """The server in one round (module docstring)."""

    def __init__(self, state: dict[str, Any]):
        self._state = state
        self._book: KeyBook | None = None  # parsed once: the graph and indices are derived from it

    @classmethod
    def start(
        cls, context: str, config: SecAggConfig, base_size: int, randomness: bytes | None = None
    ) -> ServerSession:
        """A round `context` summing deltas of `base_size` values; `randomness`: 32 bytes for the graph."""
        check_name(context, "round context")
        if not isinstance(base_size, int) or base_size < 1:
            raise SecAggError(f"base size {base_size!r} is not a positive integer", "pass the shared tensors' values")
        randomness = secrets.token_bytes(32) if randomness is None else randomness
        if len(randomness) != 32:
            raise SecAggError("the graph randomness must be 32 bytes", "pass secrets.token_bytes(32)")
        return cls(
            {
                "context": context,
                "config": config.to_dict(),
                "base_size": base_size,
                "randomness": b64(randomness),
                "phase": "keys",
                "failure": None,
                "adverts": {},
            }
        )

    @property
    def phase(self) -> str:
        """keys, shares, inputs, unmask, done or failed."""
        return self._state["phase"]

    @property
    def book(self) -> KeyBook:
        """The key book (after `close_keys`)."""
        if self._book is None:
            self._book = KeyBook.from_dict(self._state["book"])
        return self._book

    @property
    def sharers(self) -> tuple[str, ...]:
        """Devices whose shares were routed (after `close_shares`)."""
        return tuple(self._state["sharers"])

    @property
    def uploaders(self) -> tuple[str, ...]:
        """Devices whose masked vectors are in the sum."""
        return tuple(sorted(self._state.get("uploads", {})))

    @property
    def advertised(self) -> tuple[str, ...]:
        """Devices whose keys arrived."""
        return tuple(sorted(self._state["adverts"]))

    @property
    def shared(self) -> tuple[str, ...]:
        """Devices whose sealed shares arrived (before `close_shares` prunes any)."""
        return tuple(sorted(self._state.get("bundles", {})))

    @property
    def revealed(self) -> tuple[str, ...]:
        """Survivors whose shares to unmask arrived."""
        return tuple(sorted(self._state.get("reveals", {})))

    @property
    def plan(self) -> Plan | None:
        """The round's plan once the keys are fixed (None before, or when the round failed at that step)."""
        return self.book.plan if "book" in self._state else None

    @property
    def outcome(self) -> UnmaskRequest | None:
        """Who survived and who dropped, once the inputs step closed (None before), whatever happened since."""
        return UnmaskRequest.from_dict(self._state["request"]) if "request" in self._state else None

    @property
    def failure(self) -> str | None:
        """Why the round failed (None unless failed)."""
        return self._state["failure"] if self.phase == "failed" else None

    def holds(self, message: KeyAdvert | ShareBundle | MaskedInput | UnmaskShares) -> bool:
        """Whether exactly this message is already part of the round, whatever step it is at now (a device that
        re-sends after a crash is told so, not refused)."""
        state, device = self._state, message.device
        if isinstance(message, KeyAdvert):
            return state["adverts"].get(device) == message.to_dict()
        if isinstance(message, ShareBundle):
            data = {peer: b64(sealed) for peer, sealed in sorted(message.sealed.items())}
            return state.get("bundles", {}).get(device) == data
        if isinstance(message, MaskedInput):
            return state.get("uploads", {}).get(device) == message.digest
        return state.get("reveals", {}).get(device) == message.to_dict()

    def receive_advert(self, advert: KeyAdvert) -> bool:
        """Take a device's public keys."""
        self._need("keys")
        held = self._state["adverts"]
        if advert.device in held:
            if held[advert.device] == advert.to_dict():
                return False
            raise SecAggError(
                f"device {advert.device!r} already advertised other keys this round",
                "a device advertises one key pair per round",
            )
        others = {key for data in held.values() for key in (data["cipher_key"], data["mask_key"])}
        mine = {b64(advert.cipher_key), b64(advert.mask_key)}
        if len(mine) < 2 or mine & others:
            raise SecAggError(
                f"device {advert.device!r} advertised a public key that is already in use",
                "generate fresh key pairs for every round",
            )
        held[advert.device] = advert.to_dict()
        return True

    def close_keys(self) -> KeyBook:
        """Fix the round's devices, plan and graph: the key book every advertised device gets."""
        self._need("keys")
        adverts = [KeyAdvert.from_dict(self._state["adverts"][d]) for d in sorted(self._state["adverts"])]
        config = SecAggConfig.from_dict(self._state["config"])
        plan = self._or_fail(lambda: make_plan(len(adverts), config))
        book = KeyBook(
            self._state["context"],
            config,
            unb64(self._state["randomness"], "randomness"),
            tuple(adverts),
            plan,
            self._state["base_size"],
        )
        self._state.update(phase="shares", book=book.to_dict(), bundles={})
        return book

    def receive_shares(self, bundle: ShareBundle) -> bool:
        """Take a device's sealed shares: exactly one per neighbour, of the sealed size."""
        self._need("shares")
        book, device = self.book, bundle.device
        if device not in book.keys:
            raise SecAggError(f"device {device!r} is not in this round's key book", "advertise keys first")
        wanted = set(book.neighbours[device])
        if set(bundle.sealed) != wanted or any(len(s) != SEALED_BYTES for s in bundle.sealed.values()):
            raise SecAggError(
                f"device {device!r} sent shares that are not one {SEALED_BYTES}-byte message for each "
                f"of its {len(wanted)} neighbours",
                "seal one share pair for every neighbour",
            )
        data = {peer: b64(sealed) for peer, sealed in sorted(bundle.sealed.items())}
        return self._keep("bundles", device, data, "shares")

    def close_shares(self) -> dict[str, ShareInbox]:
        """Fix who masks with whom; {device: inbox} for every device that sent its shares."""
        self._need("shares")
        book = self.book
        sharers = set(self._state["bundles"])
        while True:  # a device whose group cannot reach its threshold could never be unmasked
            short = {d for d in sharers if 1 + len(sharers & set(book.neighbours[d])) < book.plan.threshold}
            if not short:
                break
            sharers -= short
        self._or_fail(lambda: self._enough(len(sharers), "sent their shares"))
        self._state.update(
            phase="inputs",
            sharers=sorted(sharers),
            uploads={},
            running_sum=b64(np.zeros(book.vector_length, "<u4").tobytes()),
        )
        return {device: self.inbox(device) for device in sorted(sharers)}

    def inbox(self, device: str) -> ShareInbox:
        """The shares addressed to `device` by its partners (again, for a device that asks twice)."""
        self._need("inputs", "unmask", "done")
        if device not in self._state["sharers"]:
            raise SecAggError(
                f"device {device!r} takes no part in this round's masking (its shares did not arrive "
                "in time, or its group is too small)",
                "the device rejoins the next round",
            )
        bundles = self._state["bundles"]
        sealed = {peer: unb64(bundles[peer][device], "sealed share") for peer in self._partners(device)}
        return ShareInbox(device, sealed)

    def receive_masked(self, upload: MaskedInput) -> bool:
        """Add a device's masked vector to the running sum (once)."""
        self._need("inputs")
        book, device = self.book, upload.device
        if device not in self._state["sharers"]:
            raise SecAggError(
                f"device {device!r} uploaded a masked vector but takes no part in this round's masking",
                "the device rejoins the next round",
            )
        uploads = self._state["uploads"]
        if device in uploads:
            if uploads[device] == upload.digest:
                return False
            raise SecAggError(
                f"device {device!r} already uploaded a different masked vector this round",
                "a device uploads one masked vector per round",
            )
        values = unpack(upload.masked, book.vector_length, book.plan.bits, f"device {device!r}'s masked vector")
        total = self._running_sum(book) + values  # uint32 wraps mod 2^32, a multiple of 2^b
        self._state["running_sum"] = b64(total.astype("<u4").tobytes())
        uploads[device] = upload.digest
        return True

    def close_inputs(self) -> UnmaskRequest:
        """Fix the survivors (who uploaded); the request every survivor answers with its shares."""
        self._need("inputs")
        survivors = set(self._state["uploads"])
        self._or_fail(lambda: self._enough(len(survivors), "uploaded a masked vector"))
        request = UnmaskRequest(tuple(sorted(survivors)), tuple(sorted(set(self._state["sharers"]) - survivors)))
        self._state.update(phase="unmask", request=request.to_dict(), reveals={})
        return request

    @property
    def request(self) -> UnmaskRequest:
        """The unmask request (after `close_inputs`)."""
        self._need("unmask", "done")
        return UnmaskRequest.from_dict(self._state["request"])

    def receive_unmask(self, shares: UnmaskShares) -> bool:
        """Take a survivor's revealed shares: exactly the seed shares of survivors and key shares of the dropped."""
        self._need("unmask")
        request, device = self.request, shares.device
        if device not in request.survivors:
            raise SecAggError(f"device {device!r} is not a survivor of this round", "only survivors reveal shares")
        partners = set(self._partners(device))
        wanted_seeds = (partners | {device}) & set(request.survivors)
        wanted_keys = partners & set(request.dropped)
        both = sorted(set(shares.seed_shares) & set(shares.key_shares))
        if both or set(shares.seed_shares) != wanted_seeds or set(shares.key_shares) != wanted_keys:
            problem = f"both shares of {both[0]!r}" if both else "shares of other devices than the request asks"
            raise SecAggError(
                f"device {device!r} revealed {problem}",
                "reveal seed shares of surviving partners and key shares of dropped partners only",
            )
        for peer, share in (*shares.seed_shares.items(), *shares.key_shares.items()):
            shamir.read_share(share, f"device {peer!r} from {device!r}")
        return self._keep("reveals", device, shares.to_dict(), "shares to unmask")

    def missing(self) -> list[str]:
        """What the unmasking still lacks, one line per device whose secret has too few shares ([] = ready)."""
        self._need("unmask", "done")
        return [
            f"{what} has {len(found)} of the {self.book.plan.threshold} shares it needs"
            for what, found in self._collect().values()
            if len(found) < self.book.plan.threshold
        ]

    def ready(self) -> bool:
        """Whether `finish` can unmask now."""
        return self.phase == "done" or not self.missing()

    def finish(self) -> np.ndarray:
        """The exact sum of the survivors' ring vectors (uint32 ring elements); a round that cannot is failed."""
        self._need("unmask", "done")
        book = self.book
        if self.phase == "done":
            return unpack(unb64(self._state["result"], "result"), book.vector_length, book.plan.bits)
        lacking = self.missing()
        if lacking:
            self._fail(f"cannot unmask the round: {lacking[0]}; {TOO_MANY_DROPPED}")
        total = self._running_sum(book)
        length, threshold, survivors = book.vector_length, book.plan.threshold, set(self.request.survivors)
        for (kind, peer), (what, found) in self._collect().items():
            secret = shamir.reconstruct(found, threshold, what)
            if kind == "seed":
                total -= mask_vector(secret, length)
                continue
            if keys.public_key(secret) != book.keys[peer].mask_key:
                raise SecAggError(
                    f"the mask key rebuilt for {peer!r} does not match its advert",
                    "a device revealed a wrong share; fail the round",
                )
            for survivor in sorted(set(self._partners(peer)) & survivors):
                mask = mask_vector(pairwise_seed(book, secret, peer, survivor), length)
                if book.indices[survivor] < book.indices[peer]:  # the survivor added it; take it out
                    total -= mask
                else:
                    total += mask
        result = total & modulus_mask(book.plan.bits)
        self._state.update(phase="done", result=b64(pack(result, book.plan.bits)))
        return result

    def aggregate(self, layout: VectorLayout) -> SecureSum:
        """The unmasked sum read back as the weighted delta sum and weight sum (quantize.dequantize_sum)."""
        return dequantize_sum(self.finish(), layout, self.book)

    def fail(self, reason: str) -> None:
        """End the round (e.g. at its deadline) with `reason`; every later call says it."""
        if self.phase not in ("done", "failed"):
            self._state.update(phase="failed", failure=reason)

    def to_json(self) -> str:
        """The whole state as JSON."""
        return session_json("ServerSession", self._state)

    @classmethod
    def from_json(cls, text: str | bytes) -> ServerSession:
        """Resume from `to_json` text; anything else is one SecAggError line."""
        try:
            state = session_state(text, "ServerSession", PHASES)
            session = cls(state)
            SecAggConfig.from_dict(state["config"])
            if "book" in state:
                session.book.check()
        except (ValueError, KeyError, TypeError, AttributeError, SecAggError):
            raise SecAggError(
                "the saved secure-aggregation state of this round cannot be read",
                "fail the round; the next one starts fresh",
            ) from None
        return session

    def _collect(self) -> dict[tuple[str, str], tuple[str, dict[int, bytes]]]:
        """(kind, device) -> (what, {holder index: share}) for every secret the unmasking needs."""
        book, request = self.book, self.request
        survivors = set(request.survivors)
        needed = {("seed", d): (f"the self-mask seed of device {d!r}", {}) for d in request.survivors}
        for d in request.dropped:
            if survivors & set(self._partners(d)):
                needed[("key", d)] = (f"the mask key of dropped device {d!r}", {})
        for holder, data in self._state["reveals"].items():
            for kind, field in (("seed", "seed_shares"), ("key", "key_shares")):
                for peer, share in data[field].items():
                    needed[(kind, peer)][1][book.indices[holder]] = unb64(share, "share")
        return needed

    def _partners(self, device: str) -> tuple[str, ...]:
        sharers = set(self._state["sharers"])
        return tuple(peer for peer in self.book.neighbours[device] if peer in sharers)

    def _running_sum(self, book: KeyBook) -> np.ndarray:
        """The masked vectors' sum so far, mod 2^32 (uint32; reduced mod 2^b when unmasked)."""
        return unpack(unb64(self._state["running_sum"], "sum"), book.vector_length, 32)

    def _keep(self, field: str, device: str, data: dict, what: str) -> bool:
        held = self._state[field]
        if device in held:
            if held[device] == data:
                return False
            raise SecAggError(f"device {device!r} already sent other {what} this round", f"send {what} once")
        held[device] = data
        return True

    def _enough(self, count: int, what: str) -> None:
        plan = self.book.plan
        if count < plan.min_survivors:
            raise SecAggError(
                f"only {count} of {plan.devices} devices {what}, the round needs {plan.min_survivors}; "
                f"{TOO_MANY_DROPPED}",
                "the round fails; the next round starts fresh",
            )

    def _or_fail(self, step: Any) -> Any:
        try:
            return step()
        except SecAggError as exc:
            self._fail(exc.problem, exc.fix)

    def _fail(self, problem: str, fix: str = "the round fails; the next round starts fresh") -> None:
        self._state.update(phase="failed", failure=problem, failure_fix=fix)
        raise SecAggError(problem, fix)

    def _need(self, *phases: str) -> None:
        if self.phase == "failed":
            raise SecAggError(self._state["failure"], self._state.get("failure_fix", ""))
        if self.phase not in phases:
            raise SecAggError(
                f"the round is at step {self.phase!r} of secure aggregation, not {' or '.join(phases)}",
                "send the messages in protocol order",
            )
