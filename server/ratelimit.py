"""A per-address limit on failed attempts, so a shared secret cannot be guessed at network speed."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable


class FailureLimiter:
    """Blocks an address once it has `max_failures` failures within the last `window_seconds` (a sliding window).

    Memory is bounded: each address keeps at most `max_failures` timestamps, an address whose newest
    failure left the window is forgotten, and at most `max_addresses` addresses are tracked. When the
    table is full, every address not in it shares one overflow count: many addresses together then get
    `max_failures` more guesses per window, not `max_failures` each, at the price of blocking honest
    newcomers while the table is full. Evicting tracked addresses instead would unblock an attacker's
    blocked addresses whenever it brought enough new ones. Thread-safe; `clock` must never go back.
    """

    def __init__(
        self,
        max_failures: int,
        window_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        max_addresses: int = 10_000,
    ):
        self.max_failures = max_failures
        self.window_seconds = window_seconds
        self.clock = clock
        self.max_addresses = max_addresses
        self._lock = threading.Lock()
        # address -> its failure times, oldest first; the addresses ordered by their newest failure
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._overflow: deque[float] = deque(maxlen=max_failures)

    def retry_after(self, address: str) -> int | None:
        """Whole seconds until `address` may try again (at least 1), or None while it is not blocked."""
        with self._lock:
            now = self.clock()
            failures = self._counted(address, now, track=False)
            if failures is None or len(failures) < self.max_failures:
                return None
            return max(1, math.ceil(failures[0] + self.window_seconds - now))

    def record_failure(self, address: str) -> None:
        """Count one failed attempt by `address` now."""
        with self._lock:
            now = self.clock()
            failures = self._counted(address, now, track=True)
            assert failures is not None, "a tracked address always has a count"
            failures.append(now)
            if address in self._failures:
                self._failures.move_to_end(address)

    def __len__(self) -> int:
        """How many addresses the table holds (not the overflow count; stale ones leave at the next check)."""
        with self._lock:
            return len(self._failures)

    def _counted(self, address: str, now: float, track: bool) -> deque[float] | None:
        """The failures counted against `address` within the window (None if untracked and `track` is False)."""
        horizon = now - self.window_seconds
        self._forget_stale(horizon)
        if address in self._failures:
            failures = self._failures[address]
        elif len(self._failures) >= self.max_addresses:
            failures = self._overflow
        elif track:
            failures = self._failures[address] = deque(maxlen=self.max_failures)
        else:
            return None
        while failures and failures[0] <= horizon:
            failures.popleft()
        return failures

    def _forget_stale(self, horizon: float) -> None:
        """Drop the addresses whose newest failure is at or before `horizon` (they lead the table's order)."""
        while self._failures and next(iter(self._failures.values()))[-1] <= horizon:
            self._failures.popitem(last=False)
