"""Secure aggregation in the round engine: each secure round's protocol session, durable, stepped by the engine's
tick; the strategy then reads its unmasked sum (`strategy.py`). The protocol is docs/secure-aggregation.md's.

A secure round opens as any round (sampling, planning) and its devices train as in any round; then, instead of
uploading their update, they take the protocol's steps (`steps.py`, checked there; over HTTP: `routes.py`):

  keys    each device advertises two public keys; the step closes when every device given the round (less those
          that refused its base) has, when the round's target has (over-selection), or at the round's deadline
  shares  each device of the key book sends its sealed shares; closes when all have, or --secagg-step-timeout
          seconds after the keys closed
  inputs  each device that shared uploads its masked vector; same rule
  unmask  each survivor reveals its shares; the round closes when every survivor has, or at the step timeout when
          the shares that arrived unmask the sum; otherwise it fails
A round whose session fails (too many devices dropped at some step) is abandoned with the session's one line and
the next round starts from the same base.

Durable state (`store.py`): a snapshot of the session when the round opens and at each step's close, and
every accepted message appended to a log in between, each in its own SQLite transaction. A restarted server reads
the snapshot and receives the logged messages again, so a message counts exactly when its log row is committed,
and a device that re-sends it after a crash is told it is a duplicate. The snapshot and log are deleted when the
next round opens; the round's counts (devices masked, dropped, recovered) stay.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from edgepfl.errors import SecAggError
from edgepfl.manifest import TensorSpec
from edgepfl.privacy import delta_norm
from edgepfl.secagg import (
    KeyAdvert,
    KeyBook,
    MaskedInput,
    SecAggConfig,
    SecureSum,
    ServerSession,
    ShareBundle,
    ShareInbox,
    UnmaskRequest,
    UnmaskShares,
    VectorLayout,
    from_json,
)
from edgepfl.secagg.config import Measured, levels
from edgepfl.server.errors import Refused
from edgepfl.server.records import RoundRecord
from edgepfl.server.secure.store import SecureStore
from edgepfl.server.store import Store

STEPS = ("keys", "shares", "inputs", "unmask", "done")
# what a device sends at each step: the message kind (its HTTP route's last part) -> its class and step
KINDS: dict[str, tuple[type, str]] = {
    "advert": (KeyAdvert, "keys"),
    "shares": (ShareBundle, "shares"),
    "masked": (MaskedInput, "inputs"),
    "reveal": (UnmaskShares, "unmask"),
}
RUN_KEY = "secagg_run"  # meta: this state folder's random id, part of every round's context
ALIAS_KEY = "secagg_alias_key"  # meta: the key of the devices' ids in the protocol (`SecureRounds.alias`)
NEXT_KEY = "secagg_next"  # meta: the settings the next secure round measured from the last sum (JSON)


class SecureRounds:
    """The secure rounds of one state folder (module docstring); thread-safe, called under the engine's lock."""

    def __init__(
        self,
        config: SecAggConfig,
        step_timeout: float,
        store: Store,
        specs: Sequence[TensorSpec],
        randomness: Callable[[int], bytes] | None = None,
        measured: Measured | None = None,
    ):
        self.config = config  # round 1's settings; what `measured` names follows each round's sum after that
        self.measured = measured or Measured(clip=False, weight=False)
        self.step_timeout = step_timeout
        self.store = store
        self.db = SecureStore(store)
        self.layout = VectorLayout.of({spec.name: spec.shape for spec in specs})
        self.randomness = randomness  # round id -> the graph's 32 random bytes (None: OS entropy; simulate seeds it)
        self._lock = threading.RLock()
        self._open: tuple[int, ServerSession] | None = None  # the open round's session, as the store holds it
        self._alias_key: bytes | None = None

    def alias(self, device: str) -> str:
        """A device's id in the protocol: a keyed hash of its name (a server secret in the store's settings), stable
        across rounds and restarts. The key book, the inboxes, the unmask request and a failed round's note, which
        the round's other devices and the status see, so name no enrolled device; the caller of every method below
        passes the enrolled name, translated here."""
        with self._lock:
            if self._alias_key is None:
                stored = self.store.get_meta(ALIAS_KEY)
                if stored is None:
                    import secrets

                    stored = secrets.token_hex(32)
                    self.store.set_meta({ALIAS_KEY: stored})
                self._alias_key = stored.encode()
            return "d" + hmac.new(self._alias_key, device.encode(), hashlib.sha256).hexdigest()[:20]

    # the round's life (the engine's lifecycle calls these)

    def holds(self, round_id: int) -> bool:
        """Whether a round is secure (its session was started when it opened)."""
        return self.db.row(round_id) is not None

    @staticmethod
    def is_secure(store: Store, round_id: int) -> bool:
        """Whether a state folder's round is secure, whatever this server's options."""
        return SecureStore(store).row(round_id) is not None

    @staticmethod
    def forget_ended(store: Store, open_round: int | None) -> None:
        """Delete the snapshots and logs of every secure round but the open one (at start: a crash may leave some)."""
        SecureStore(store).forget_others(open_round)

    def takes_keys(self, round_id: int) -> bool:
        """Whether a secure round still takes devices (its keys step is open); True for a round that is not secure."""
        row = self.db.row(round_id)
        return row is None or row.phase == "keys"

    def seeded(self, seed: int) -> None:
        """Draw the graph randomness and the run id from `seed` (a reproducible simulation; serve uses the OS)."""
        self.randomness = lambda round_id: np.random.default_rng([seed, round_id]).bytes(32)
        if self.store.get_meta(RUN_KEY) is None:
            self.store.set_meta({RUN_KEY: f"simulate-{seed}"})
        if self.store.get_meta(ALIAS_KEY) is None:  # the ids order the key book, hence the graph: seeded too
            self.store.set_meta({ALIAS_KEY: f"simulate-{seed}"})
            self._alias_key = None

    def context(self, round_id: int) -> str:
        """The round's context string, which every key and share of it is bound to."""
        run = self.store.get_meta(RUN_KEY)
        if run is None:
            import secrets

            run = f"edgepfl-{secrets.token_hex(8)}"
            self.store.set_meta({RUN_KEY: run})
        return f"{run}/round-{round_id}"

    def opened(self, record: RoundRecord) -> None:
        """Start a newly opened round's session (and forget the ended rounds' snapshots and logs)."""
        with self._lock:
            randomness = self.randomness(record.round_id) if self.randomness is not None else None
            context, config = self.context(record.round_id), self.round_config()
            session = ServerSession.start(context, config, self.layout.size, randomness)
            self.db.forget_others(record.round_id)
            self.db.start(record.round_id, record.opened, session.to_json(), counts(session))
            self._open = (record.round_id, session)

    def tick(
        self, record: RoundRecord, now: float, given: Sequence[str], refused: Sequence[str], min_clients: int
    ) -> tuple[str, str | None] | None:
        """Close the steps that are complete or past their time: ("close", None) when the sum can be unmasked,
        ("abandon", why) when the round failed, None while it goes on."""
        with self._lock:
            given, refused = [self.alias(d) for d in given], [self.alias(d) for d in refused]
            session = self._session(record.round_id)
            row = self.db.row(record.round_id)
            assert row is not None, "a secure round has its row"
            since = row.since
            while True:
                phase = session.phase
                late = now >= since + self.step_timeout
                expected, answered = _step_wait(session, given, refused)
                complete = answered >= expected
                if phase == "keys":
                    if not (complete or len(answered) >= record.needed or now >= record.deadline):
                        return None
                    if len(answered) < min_clients:
                        session.fail(
                            f"{len(answered)} of {len(given)} devices advertised keys by the round's "
                            f"deadline, fewer than --min-clients {min_clients}"
                        )
                    else:
                        self._step(session, session.close_keys)
                elif phase == "shares":
                    if not (complete or late):
                        return None
                    self._step(session, session.close_shares)
                elif phase == "inputs":
                    if not (complete or late):
                        return None
                    self._step(session, session.close_inputs)
                elif phase == "unmask":
                    if complete or (late and session.ready()):
                        return ("close", None)
                    if not late:
                        return None
                    session.fail(
                        f"{session.missing()[0]} by the step's end; more devices dropped than the threshold allows"
                    )
                elif phase == "done":
                    return ("close", None)
                if session.phase == "failed":
                    self._save(record.round_id, session, now)
                    return ("abandon", f"secure aggregation failed: {session.failure}")
                self._save(record.round_id, session, now)
                since = now

    def waiting_for(self, round_id: int, given: Sequence[str], refused: Sequence[str]) -> tuple[str, list[str]]:
        """The open round's step and the devices of `given` it still waits for there (the status page's "waiting
        for"), by name."""
        with self._lock:
            names = {self.alias(device): device for device in given}
            session = self._session(round_id)
            expected, answered = _step_wait(session, list(names), [self.alias(d) for d in refused])
            return session.phase, sorted(names.get(device, device) for device in expected - answered)

    def step_deadline(self, record: RoundRecord) -> float:
        """When the open round's current step ends at the latest: the keys step at the round's deadline, each later
        step --secagg-step-timeout after the one before it closed (the round's deadline no longer applies then)."""
        with self._lock:
            row = self.db.row(record.round_id)
            if row is None or row.phase == "keys":
                return record.deadline
            return row.since + self.step_timeout

    def sum_of(self, round_id: int) -> SecureSum:
        """The round's unmasked sum, read back as the weighted delta sum and the weight sum (SecAggError: failed)."""
        with self._lock:
            session = self._session(round_id)
            row = self.db.row(round_id)
            assert row is not None, "a secure round has its row"
            try:
                total = session.aggregate(self.layout)
            except SecAggError:
                self._save(round_id, session, row.since)
                raise
            self._save(round_id, session, row.since)
            if self.measured.clip or self.measured.weight:
                survivors = len(session.request.survivors)
                norm = delta_norm(total.weighted_mean()) if total.total_weight > 0 else 0.0
                upcoming = self.measured.next_config(session.book.config, norm, total.total_weight, survivors)
                self.store.set_meta({NEXT_KEY: json.dumps(upcoming.to_dict())})
            return total

    def round_config(self) -> SecAggConfig:
        """The settings of the round that opens next: round 1's, then what the last sum measured (`Measured`)."""
        stored = self.store.get_meta(NEXT_KEY)
        if stored is None or not (self.measured.clip or self.measured.weight):
            return self.config
        measured = SecAggConfig.from_dict(json.loads(stored))
        clip = measured.clip_norm if self.measured.clip else self.config.clip_norm
        weight = measured.weight_scale if self.measured.weight else self.config.weight_scale
        return SecAggConfig(**{**self.config.to_dict(), "clip_norm": clip, "weight_scale": weight})

    def sensitivity(self, round_id: int) -> float:
        """How far one device can move the unmasked sum (L2): its clip norm plus what rounding adds, C (1 + s/q)."""
        with self._lock:
            book = self._session(round_id).book
            plan, config = book.plan, book.config
            return config.clip_norm * (1 + config.coordinate_sigmas / levels(plan.devices, plan.bits))

    def summaries(self) -> dict[int, dict[str, Any]]:
        """Every secure round's counts, by round."""
        return self.db.summaries()

    # what devices send and ask for (steps.py checks the round and the device first)

    def receive(self, round_id: int, device: str, kind: str, body: bytes) -> dict[str, Any]:
        """Take one message of `device` (JSON, or a masked vector's binary frame); its receipt."""
        message_class, step = KINDS[kind]
        with self._lock:
            device = self.alias(device)
            session = self._session(round_id)
            message = _parse(kind, body, message_class)
            if message.device != device:
                raise Refused(
                    "wrong_device",
                    f"the {kind} message names device {message.device!r}, and this device's "
                    f"id in the round is {device!r}",
                    "send this device's own messages, under the id of its task's secure_aggregation.device",
                )
            if session.holds(message):
                return {"accepted": True, "round": round_id, "duplicate": True}
            self._check_step(session, round_id, device, step)
            try:
                new = _receiver(session, kind)(message)
            except SecAggError as error:
                raise Refused("bad_secagg", error.problem, error.fix) from None
            if new:
                try:
                    self.db.log(round_id, kind, body)
                except BaseException:
                    self._open = None  # read again from the store: the message did not count
                    raise
            return {"accepted": True, "round": round_id, "duplicate": not new}

    def book(self, round_id: int, device: str) -> KeyBook | None:
        """The round's key book for `device` (None: the keys step is still open)."""
        with self._lock:
            device = self.alias(device)
            session = self._session(round_id)
            if self._waiting(session, round_id, "shares"):
                return None
            if device not in session.book.keys:
                raise _gone(
                    round_id,
                    f"device {device!r} is not in round {round_id}'s key book (its keys came after the step closed)",
                )
            return session.book

    def inbox(self, round_id: int, device: str) -> ShareInbox | None:
        """The shares addressed to `device` (None: the shares step is still open)."""
        with self._lock:
            device = self.alias(device)
            session = self._session(round_id)
            if self._waiting(session, round_id, "inputs"):
                return None
            if device not in session.sharers:
                raise _gone(
                    round_id,
                    f"device {device!r} takes no part in round {round_id}'s masking (its shares "
                    "came after the step closed, or its group is too small)",
                )
            return session.inbox(device)

    def request(self, round_id: int, device: str) -> UnmaskRequest | None:
        """Who survived and who dropped, for `device` to reveal its shares (None: the inputs step is still open)."""
        with self._lock:
            device = self.alias(device)
            session = self._session(round_id)
            if self._waiting(session, round_id, "unmask"):
                return None
            request = session.request
            if device not in request.survivors:
                raise _gone(
                    round_id,
                    f"device {device!r}'s masked vector is not in round {round_id}'s sum (it came "
                    "after the step closed)",
                )
            return request

    # internals

    def _session(self, round_id: int) -> ServerSession:
        """The round's session: cached while it is open, else its snapshot with its log received again."""
        if self._open is not None and self._open[0] == round_id:
            return self._open[1]
        row = self.db.row(round_id)
        if row is None or row.snapshot is None:
            raise _gone(
                round_id, f"round {round_id} is over" if row is not None else f"round {round_id} is not a secure round"
            )
        session = ServerSession.from_json(row.snapshot)
        for kind, body in self.db.messages(round_id):
            _receiver(session, kind)(_parse(kind, body, KINDS[kind][0]))
        self._open = (round_id, session)
        return session

    def _step(self, session: ServerSession, close: Callable[[], Any]) -> None:
        try:
            close()
        except SecAggError:
            pass  # the session is failed, with its line

    def _save(self, round_id: int, session: ServerSession, since: float) -> None:
        try:
            self.db.snapshot(round_id, session.phase, since, session.to_json(), counts(session))
        except BaseException:
            self._open = None
            raise

    def _waiting(self, session: ServerSession, round_id: int, ready_at: str) -> bool:
        """True while the session is before step `ready_at`; a failed session is gone."""
        if session.phase == "failed":
            raise _gone(round_id, f"round {round_id}'s secure aggregation failed: {session.failure}")
        return STEPS.index(session.phase) < STEPS.index(ready_at)

    def _check_step(self, session: ServerSession, round_id: int, device: str, step: str) -> None:
        """A message for a step that is over is gone; one for a step not yet begun must wait (409 too_early)."""
        if session.phase != "failed" and STEPS.index(session.phase) > STEPS.index(step):
            raise _gone(round_id, f"round {round_id}'s {step} step is closed, without device {device!r}")
        if self._waiting(session, round_id, step):
            raise Refused(
                "too_early",
                f"round {round_id} is at the {session.phase} step of secure aggregation, not yet at {step}",
                "ask for the step's data first and send when it is there",
            )


def counts(session: ServerSession) -> dict[str, Any]:
    """A session's counts for the status, results.json and the page: its step, the plan, masked, dropped, recovered."""
    summary: dict[str, Any] = {"phase": session.phase, "advertised": len(session.advertised)}
    if session.failure is not None:
        summary["failure"] = session.failure
    plan, outcome = session.plan, session.outcome
    if plan is not None:
        summary.update(
            devices=plan.devices,
            neighbours=plan.neighbours,
            threshold=plan.threshold,
            bits=plan.bits,
            classic=plan.classic,
        )
    if plan is not None and outcome is not None:
        # masked: in the sum; dropped: advertised keys but not in the sum; recovered: dropped after sharing, whose
        # pairwise masks the server rebuilt and removed from the survivors' sum
        summary.update(
            masked=len(outcome.survivors), dropped=plan.devices - len(outcome.survivors), recovered=len(outcome.dropped)
        )
    return summary


def _step_wait(session: ServerSession, given: Sequence[str], refused: Sequence[str]) -> tuple[set[str], set[str]]:
    """The devices a session's step waits for, and those that answered it: keys from the devices given the round
    (less those that refused its base), shares from the key book's, masked vectors from the sharers, reveals from
    the survivors; nothing once the steps are over."""
    phase = session.phase
    if phase == "keys":
        return set(given) - set(refused), set(session.advertised)
    if phase == "shares":
        return set(session.book.devices), set(session.shared)
    if phase == "inputs":
        return set(session.sharers), set(session.uploaders)
    if phase == "unmask":
        return set(session.request.survivors), set(session.revealed)
    return set(), set()


def _receiver(session: ServerSession, kind: str) -> Callable[[Any], bool]:
    """The session's receive_* of a message kind."""
    return {
        "advert": session.receive_advert,
        "shares": session.receive_shares,
        "masked": session.receive_masked,
        "reveal": session.receive_unmask,
    }[kind]


def _parse(kind: str, body: bytes, message_class: type) -> Any:
    try:
        return MaskedInput.from_bytes(body) if kind == "masked" else from_json(body, message_class)
    except SecAggError as error:
        raise Refused("bad_secagg", error.problem, error.fix) from None


def _gone(round_id: int, problem: str) -> Refused:
    return Refused("round_closed", problem, "the device rejoins the next round")
