"""What the server's database keeps of secure rounds (tables `secure_rounds` and `secure_messages`, schema step 6).

Per secure round: its protocol step (`phase`) and when that step began (`since`), a snapshot of the server's
session (`ServerSession.to_json`, written when the round opens and when each step closes), the messages accepted
since that snapshot (the log a restarted server receives again), and the round's counts (`summary`, JSON). The
snapshot and the log are deleted once the round is over; the counts stay. Nothing here is a device's delta: a
masked vector is uniform in the ring, and the snapshot holds sealed shares the server cannot open.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from edgepfl.server.store import Store


@dataclass(frozen=True)
class SecureRow:
    """One secure round as stored."""

    round_id: int
    phase: str
    since: float  # when its current step began
    snapshot: str | None  # the session's JSON (None once the round is over)
    summary: dict[str, Any]


class SecureStore:
    """The secure rounds' rows in a server state folder's database."""

    def __init__(self, store: Store):
        self.store = store

    def start(self, round_id: int, since: float, snapshot: str, summary: dict[str, Any]) -> None:
        """A secure round's first snapshot (its session at the keys step)."""
        with self.store.transaction() as db:
            db.execute(
                "INSERT INTO secure_rounds (round_id, phase, since, snapshot, summary) VALUES (?, 'keys', ?, ?, ?)",
                (round_id, since, snapshot, json.dumps(summary)),
            )

    def row(self, round_id: int) -> SecureRow | None:
        """A secure round, or None (a round that is not secure)."""
        rows = self.store.read(
            "SELECT round_id, phase, since, snapshot, summary FROM secure_rounds WHERE round_id = ?", (round_id,)
        )
        return _row(rows[0]) if rows else None

    def summaries(self) -> dict[int, dict[str, Any]]:
        """Every secure round's counts, by round."""
        rows = self.store.read("SELECT round_id, summary FROM secure_rounds")
        return {row["round_id"]: json.loads(row["summary"]) for row in rows}

    def snapshot(self, round_id: int, phase: str, since: float, snapshot: str, summary: dict[str, Any]) -> None:
        """A new snapshot, which replaces the old one and its log, in one transaction."""
        with self.store.transaction() as db:
            db.execute(
                "UPDATE secure_rounds SET phase = ?, since = ?, snapshot = ?, summary = ? WHERE round_id = ?",
                (phase, since, snapshot, json.dumps(summary), round_id),
            )
            db.execute("DELETE FROM secure_messages WHERE round_id = ?", (round_id,))

    def log(self, round_id: int, kind: str, body: bytes) -> None:
        """Append an accepted message to the round's log (durable when this returns)."""
        with self.store.transaction() as db:
            db.execute(
                "INSERT INTO secure_messages (round_id, seq, kind, body) SELECT ?, COALESCE(MAX(seq), 0) + 1, ?, ? "
                "FROM secure_messages WHERE round_id = ?",
                (round_id, kind, body, round_id),
            )

    def messages(self, round_id: int) -> list[tuple[str, bytes]]:
        """The round's log since its snapshot, in the order the messages were accepted."""
        rows = self.store.read("SELECT kind, body FROM secure_messages WHERE round_id = ? ORDER BY seq", (round_id,))
        return [(row["kind"], bytes(row["body"])) for row in rows]

    def forget_others(self, round_id: int | None) -> None:
        """Delete the snapshot and log of every round but `round_id` (the open one; None: all)."""
        keep = -1 if round_id is None else round_id
        with self.store.transaction() as db:
            db.execute("UPDATE secure_rounds SET snapshot = NULL WHERE round_id != ? AND snapshot IS NOT NULL", (keep,))
            db.execute("DELETE FROM secure_messages WHERE round_id != ?", (keep,))


def _row(row: Any) -> SecureRow:
    return SecureRow(row["round_id"], row["phase"], row["since"], row["snapshot"], json.loads(row["summary"]))
