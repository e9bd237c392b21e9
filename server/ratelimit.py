"""A per-address count of failed attempts: an address with too many lately is told to wait (429).

Enrollment (server/enrollment.py) counts only wrong secrets and lets a right one through a blocked address,
so phones behind one NAT are not locked out by a neighbour's typos; what makes guessing hopeless is then the
secret's strength (join links: 256 random bits), not this limit.
"""

from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable


class FailureLimiter:
    """Blocks an address once it has `max_failures` failures within the last `window_seconds` (a sliding window);
    the caller decides what a blocked address may still do.

    Only an address's own failures count against it: no failure elsewhere, however many addresses
    send them, ever blocks an address that has not failed, so honest devices cannot be locked out
    from other addresses. An IPv6 address counts as its /64 network, which one host usually has to
    itself, so a host cannot rotate through its 2^64 addresses for more guesses.

    Memory and time are bounded: each address keeps at most `max_failures` timestamps, an address
    whose newest failure left the window is forgotten, and at most `max_addresses` addresses are
    tracked; a new one then evicts the address whose newest failure is oldest. An attacker with more
    addresses than that can so unblock its own oldest ones, which gains it nothing beyond what those
    addresses would have had anyway: its guesses stay `max_failures` per address per window.
    Thread-safe; `clock` must never go back.
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

    def retry_after(self, address: str) -> int | None:
        """Whole seconds until `address` may try again (at least 1), or None while it is not blocked."""
        with self._lock:
            now = self.clock()
            failures = self._counted(limited_key(address), now)
            if failures is None or len(failures) < self.max_failures:
                return None
            return max(1, math.ceil(failures[0] + self.window_seconds - now))

    def record_failure(self, address: str) -> None:
        """Count one failed attempt by `address` now."""
        key = limited_key(address)
        with self._lock:
            now = self.clock()
            failures = self._counted(key, now)
            if failures is None:
                while len(self._failures) >= self.max_addresses:
                    self._failures.popitem(last=False)
                failures = self._failures[key] = deque(maxlen=self.max_failures)
            failures.append(now)
            self._failures.move_to_end(key)

    def __len__(self) -> int:
        """How many addresses the table holds (stale ones leave at the next check)."""
        with self._lock:
            return len(self._failures)

    def _counted(self, key: str, now: float) -> deque[float] | None:
        """The failures counted against `key` within the window (None if it has none on record)."""
        horizon = now - self.window_seconds
        self._forget_stale(horizon)
        failures = self._failures.get(key)
        if failures is None:
            return None
        while failures and failures[0] <= horizon:
            failures.popleft()
        return failures

    def _forget_stale(self, horizon: float) -> None:
        """Drop the addresses whose newest failure is at or before `horizon` (they lead the table's order)."""
        while self._failures and next(iter(self._failures.values()))[-1] <= horizon:
            self._failures.popitem(last=False)


def limited_key(address: str) -> str:
    """What the limit counts for a client address: an IPv6 address's /64 network, an IPv4 address itself."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address  # not an IP (a test client, a unix socket): counted as given
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)
