"""A secure round's device calls: where a device takes the steps, and the messages it sends and asks for. The HTTP
routes (`routes.py`) and the in-process drivers (simulate, Flower) call these alike, so a simulated message is
checked as a served one. They reach the engine core through the `DeviceCalls` it hands the mode (its lock, the tick's
wake-up, a round's record, the sampled check), nothing else.

    steps = steps_of(engine)          # None: the engine's rounds take plain uploads
    steps.task(device, round_id)      # the SecureTask of a device's train task
    steps.message(device, round_id, "advert", body)
    steps.book(device, round_id)      # None while the keys step is open; inbox, request alike
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgepfl.protocol import API_PREFIX, SecureTask
from edgepfl.server.driver import ManualClock
from edgepfl.server.errors import Refused
from edgepfl.server.secure.rounds import SecureRounds

if TYPE_CHECKING:
    from edgepfl.secagg import KeyBook, ShareInbox, UnmaskRequest
    from edgepfl.server.engine import RoundEngine
    from edgepfl.server.modes.base import DeviceCalls


def steps_of(engine: Any) -> SecureSteps | None:
    """The secure steps of an engine whose mode runs secure rounds (None: its rounds take plain uploads, or it is no
    round engine: a local simulation)."""
    steps = getattr(getattr(engine, "mode", None), "steps", None)
    return steps if isinstance(steps, SecureSteps) else None


class SecureSteps:
    """What devices ask of the secure rounds (module docstring); `rounds` are the sessions they go to."""

    def __init__(self, calls: DeviceCalls, rounds: SecureRounds):
        self.calls = calls
        self.rounds = rounds

    def task(self, device: str, round_id: int) -> SecureTask | None:
        """Where a device takes the round's steps (its alias, the session's context); None: the round is not secure."""
        if not self.rounds.holds(round_id):
            return None
        return SecureTask(
            f"{API_PREFIX}/rounds/{round_id}/secagg", self.rounds.alias(device), self.rounds.context(round_id)
        )

    def summary(self, round_id: int) -> dict[str, Any] | None:
        """A secure round's counts (devices masked, dropped, recovered; its step), or None."""
        return self.rounds.summaries().get(round_id)

    def message(self, device: str, round_id: int, kind: str, body: bytes) -> dict[str, Any]:
        """Take a device's advert, shares, masked vector or reveal (kind); its receipt (duplicate for a repeat)."""
        with self.calls.lock:
            receipt = self._session(device, round_id).receive(round_id, device, kind, body)
        self.calls.wake.set()
        return receipt

    def book(self, device: str, round_id: int) -> KeyBook | None:
        """The round's key book (None: the keys step is open)."""
        with self.calls.lock:
            return self._session(device, round_id).book(round_id, device)

    def inbox(self, device: str, round_id: int) -> ShareInbox | None:
        """The device's share inbox (None: the shares step is open)."""
        with self.calls.lock:
            return self._session(device, round_id).inbox(round_id, device)

    def request(self, device: str, round_id: int) -> UnmaskRequest | None:
        """The round's unmask request (None: the inputs step is open)."""
        with self.calls.lock:
            return self._session(device, round_id).request(round_id, device)

    def _session(self, device: str, round_id: int) -> SecureRounds:
        """The sessions, for a device given a round that holds one and was not abandoned (checked as an upload is)."""
        record = self.calls.round_or_404(round_id)
        if not self.rounds.holds(round_id):
            raise Refused(
                "not_secure",
                f"round {round_id} is not aggregated securely",
                "upload the update (POST /v1/rounds/{r}/update) as the task says",
            )
        self.calls.check_sampled(device, round_id, "poll /v1/task and train only when told to")
        if record.state == "abandoned":
            raise Refused(
                "round_closed", f"round {round_id} was abandoned: {record.note}", "the device rejoins the next round"
            )
        return self.rounds


def end_step(engine: RoundEngine, round_id: int) -> None:
    """A secure round's step is over for an in-process driver (Flower): every device that will answer has. The
    engine's tick closes it; when some device did not answer, the clock moves to the step's end first (as a served
    step closes at its time)."""
    steps = steps_of(engine)
    assert steps is not None, "an in-process driver ends the steps of a secure run only"
    summary = steps.summary(round_id)
    engine.tick()
    record = engine.store.round(round_id)
    after = steps.summary(round_id)
    if summary is None or after is None or record is None or record.state != "open":
        return
    if after["phase"] != summary["phase"]:
        return
    if isinstance(engine.clock, ManualClock):
        timeout = engine.config.secure.secagg_step_timeout
        engine.clock.now = max(engine.clock.now + timeout + 1, record.deadline if summary["phase"] == "keys" else 0)
    engine.tick()
