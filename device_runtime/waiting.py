"""What a device waits for and why: said once when the wait begins, then at growing intervals; kept in the state folder.

A device daemon that retries must not wait in silence (a server answering 500, a refused base, an outage), nor
print a line per poll. `WaitLog` says a reason the first time it is seen, then again only after 1, 2, 4, …
minutes (capped at an hour) while it lasts, and writes the current one to `waiting.json` in the state folder,
where `edgepfl device status` reads it while `device run` holds the folder's lock.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgepfl.atomic import write_text_atomic
from edgepfl.errors import StateError

WAIT_FILE = "waiting.json"
FIRST_REPEAT = 60.0  # seconds before an unchanged wait is said again; doubled each time
MAX_REPEAT = 3600.0


@dataclass(frozen=True)
class Wait:
    """What a device waits for now, why, and since when (unix seconds) it has been waiting."""

    what: str
    why: str
    since: float
    updated: float

    def __str__(self) -> str:
        return f"waiting for {self.what}: {self.why}"

    def to_json(self) -> dict[str, Any]:
        """JSON form of waiting.json."""
        return {"what": self.what, "why": self.why, "since": self.since, "updated": self.updated}


class WaitLog:
    """Says each wait reason once, then sparsely while it lasts; `clear()` when the device makes progress."""

    def __init__(
        self,
        folder: Path | None,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.time,
        first_repeat: float = FIRST_REPEAT,
    ):
        self._folder = folder
        self._say = say
        self._clock = clock
        self._first_repeat = first_repeat
        self._due: dict[str, tuple[float, float]] = {}  # reason -> (when it is said again, the interval after that)
        self.current: Wait | None = None
        if folder is not None:  # a wait an earlier process left behind is not this one's
            (folder / WAIT_FILE).unlink(missing_ok=True)

    def waiting(self, what: str, why: str) -> None:
        """The device waits for `what` because of `why`: said when new or due again, kept as the current wait."""
        now = self._clock()
        since = self.current.since if self.current is not None else now
        wait = Wait(what, why, since, now)
        reason = str(wait)
        due = self._due.get(reason)
        if due is None:
            self._say(reason)
            self._due[reason] = (now + self._first_repeat, min(2 * self._first_repeat, MAX_REPEAT))
        elif now >= due[0]:
            self._say(f"still waiting after {_duration(now - since)} for {what}: {why}")
            self._due[reason] = (now + due[1], min(2 * due[1], MAX_REPEAT))
        if self.current is None or str(self.current) != reason:
            self.current = wait
            self._write()

    def clear(self) -> None:
        """The device made progress: the wait is over, and any reason seen again is said again."""
        self._due.clear()
        if self.current is not None:
            self.current = None
            if self._folder is not None:
                (self._folder / WAIT_FILE).unlink(missing_ok=True)

    def _write(self) -> None:
        if self._folder is not None and self.current is not None:
            write_text_atomic(self._folder / WAIT_FILE, json.dumps(self.current.to_json()) + "\n")


def read_wait(folder: Path) -> Wait | None:
    """The wait a running (or stopped) `device run` recorded in `folder`; None when it was not waiting."""
    try:
        data = json.loads((folder / WAIT_FILE).read_text(encoding="utf-8"))
        return Wait(str(data["what"]), str(data["why"]), float(data["since"]), float(data["updated"]))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise StateError(
            f"{folder / WAIT_FILE} cannot be read ({exc!r})", "remove it: the next `device run` writes it again"
        ) from None


def _duration(seconds: float) -> str:
    """'45 s', '12 min', '3.5 h': how long a wait has lasted, for a person."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
