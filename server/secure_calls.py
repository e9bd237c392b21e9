"""The secure round's device calls on the round engine (a mixin of `RoundEngine`): what the HTTP routes
(`secure_routes.py`) and the in-process drivers (simulate, Flower) call for each protocol step.

Each call first checks the round and the device as an upload is checked (a known round, a device given it), then
hands the step to `secure.SecureRounds`; each accepted message wakes the engine's tick, which closes the steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgepfl.protocol import API_PREFIX, SecureTask
from edgepfl.secagg import KeyBook, ShareInbox, UnmaskRequest
from edgepfl.server.errors import Refused
from edgepfl.server.secure import SecureRounds

if TYPE_CHECKING:
    from edgepfl.server.engine import RoundEngine


class SecureCalls:
    """A device's calls in a secure round (module docstring)."""

    def secure_task(self: RoundEngine, device: str, round_id: int) -> SecureTask | None:
        """Where a device takes a round's secure steps (None: the round is not secure)."""
        if self.secure is None or not self.secure.holds(round_id):
            return None
        return SecureTask(f"{API_PREFIX}/rounds/{round_id}/secagg", self.secure.alias(device),
                          self.secure.context(round_id))

    def secure_summary(self: RoundEngine, round_id: int) -> dict[str, Any] | None:
        """A secure round's counts (devices masked, dropped, recovered; its step), or None."""
        return self.secure.summaries().get(round_id) if self.secure is not None else None

    def secure_message(self: RoundEngine, device: str, round_id: int, kind: str, body: bytes) -> dict[str, Any]:
        """Take a device's advert, shares, masked vector or reveal (kind); its receipt (duplicate for a repeat)."""
        with self._lock:
            secure = self._secure_round(device, round_id)
            receipt = secure.receive(round_id, device, kind, body)
        self._wake.set()
        return receipt

    def secure_book(self: RoundEngine, device: str, round_id: int) -> KeyBook | None:
        """The round's key book (None: the keys step is open)."""
        with self._lock:
            return self._secure_round(device, round_id).book(round_id, device)

    def secure_inbox(self: RoundEngine, device: str, round_id: int) -> ShareInbox | None:
        """The device's share inbox (None: the shares step is open)."""
        with self._lock:
            return self._secure_round(device, round_id).inbox(round_id, device)

    def secure_request(self: RoundEngine, device: str, round_id: int) -> UnmaskRequest | None:
        """The round's unmask request (None: the inputs step is open)."""
        with self._lock:
            return self._secure_round(device, round_id).request(round_id, device)

    def _secure_mode_of_open_round(self: RoundEngine) -> None:
        """An open round started with secure aggregation on and resumed with it off (or the reverse) is abandoned:
        its devices were told another protocol."""
        current = self.store.open_round()
        secure = SecureRounds.is_secure(self.store, current.round_id) if current is not None else False
        if current is not None and secure != (self.secure is not None):
            mode = "with" if secure else "without"
            self._abandon(current, self.clock(), f"it opened {mode} --secure-aggregation and the server restarted "
                          f"{'without' if secure else 'with'} it")
        SecureRounds.forget_ended(self.store, None if current is None or not secure else current.round_id)

    def _secure_round(self: RoundEngine, device: str, round_id: int) -> SecureRounds:
        record = self._round_or_404(round_id)
        if self.secure is None or not self.secure.holds(round_id):
            raise Refused("not_secure", f"round {round_id} is not aggregated securely",
                          "upload the update (POST /v1/rounds/{r}/update) as the task says")
        if self.store.assignment(round_id, device) is None:
            raise Refused("not_sampled", f"device {device!r} was not sampled in round {round_id}",
                          "poll /v1/task and train only when told to")
        if record.state == "abandoned":
            raise Refused("round_closed", f"round {round_id} was abandoned: {record.note}",
                          "the device rejoins the next round")
        return self.secure
