"""Durable server state: SQLite (WAL) for devices, rounds, assignments, update metadata and settings.

The tensors themselves are blobs (`server/blobs.py`): a row that names a blob is committed only after the
blob is on disk, so a crash leaves at worst an unreferenced blob, removed at the next start.
"""

from __future__ import annotations

import hmac
import json
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import astuple, fields
from pathlib import Path

from edgepfl.errors import StateError
from edgepfl.server.blobs import BlobStore
from edgepfl.server.errors import StorageError
from edgepfl.server.records import Assignment, DeviceRecord, EvalRecord, RoundRecord, UpdateRecord
from edgepfl.server.schema import MIGRATIONS

DB_NAME = "edgepfl-server.sqlite3"


class AlreadyEnrolled(StateError):
    """A device name that is enrolled already (and neither `replace` nor its enrollment key was given)."""


class Store:
    """The server's state folder: one SQLite database in WAL mode, and its folder of blobs (`blobs`)."""

    def __init__(self, state_dir: str | Path):
        self.folder = Path(state_dir)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.blob_dir.mkdir(exist_ok=True)
            self._db = sqlite3.connect(
                self.folder / DB_NAME, isolation_level=None, check_same_thread=False, timeout=10.0
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a commit is on disk before the reply
            self._db.row_factory = sqlite3.Row
            self._lock = threading.RLock()
            self._migrate()
        except (OSError, sqlite3.Error) as exc:
            raise StateError(
                f"cannot open the server state in {self.folder} ({exc})", "pass a writable --state folder"
            ) from None
        self.blobs = BlobStore(self.blob_dir)

    def _migrate(self) -> None:
        """Bring the state folder to this version's schema (`PRAGMA user_version`), one step at a time."""
        with self.transaction() as db:  # two servers opening one old folder must not both migrate it
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > len(MIGRATIONS):
                raise StateError(
                    f"the state folder {self.folder} was written by a newer edgepfl (schema {version})",
                    "run the edgepfl version that made it, or use a new --state folder",
                )
            for number, step in enumerate(MIGRATIONS[version:], start=version + 1):
                step(db)
                db.execute(f"PRAGMA user_version = {number}")

    @property
    def blob_dir(self) -> Path:
        """Folder of content-addressed tensor blobs."""
        return self.folder / "blobs"

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic, durable write transaction."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:  # SQLite may already have rolled back (a full disk does)
                        self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise StorageError.from_sqlite_error(exc) from None

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def read(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        """Rows of one query, for the server's parts that keep tables of their own (server/secure/store.py)."""
        return self._query(sql, args)

    # meta

    def get_meta(self, key: str) -> str | None:
        """A stored setting, or None."""
        rows = self._query("SELECT value FROM meta WHERE key = ?", (key,))
        return rows[0]["value"] if rows else None

    def set_meta(self, values: Mapping[str, str]) -> None:
        """Store settings durably, all or none."""
        with self.transaction() as db:
            _write_meta(db, values)

    # devices

    def add_device(
        self,
        name: str,
        token_hash: str,
        created: float,
        replace: bool = False,
        enroll_key_hash: str | None = None,
    ) -> None:
        """Enroll a device under its token's hash (and its enrollment key's hash, if any).

        An existing name is an error unless `replace`, or unless `enroll_key_hash` equals the hash it
        was enrolled with (a retried enrollment); either way the new token replaces the old one.
        """
        with self.transaction() as db:
            insert_device(db, name, token_hash, created, replace, enroll_key_hash)

    def device_for_token(self, token_hash: str) -> str | None:
        """The device name a token hash belongs to."""
        rows = self._query("SELECT name FROM devices WHERE token_hash = ?", (token_hash,))
        return rows[0]["name"] if rows else None

    def count_devices(self) -> int:
        """Number of enrolled devices."""
        return self._query("SELECT COUNT(*) FROM devices")[0][0]

    def devices(self) -> list[DeviceRecord]:
        """Every enrolled device, by name."""
        return [DeviceRecord(*row) for row in self._query("SELECT name, created FROM devices ORDER BY name")]

    # blobs: which ones the rows name

    def released_through(self) -> int:
        """Highest round whose tensors were released by history retention (0: none)."""
        return int(self.get_meta("history_released_through") or 0)

    def release_rounds(self, through: int) -> set[str]:
        """Record that the tensors of every round up to `through` are released; returns the blobs those rounds named.

        One transaction records the new boundary and clears those rounds' `result_sha`; the caller then deletes
        only the returned blobs that `referenced_blobs` no longer names (server/history.py).
        """
        released = {row[0] for row in self._query(_BLOBS_OF_ROUNDS.replace("{where}", "round_id <= ?"), (through,) * 4)}
        with self.transaction() as db:
            _write_meta(db, {"history_released_through": str(through)})
            db.execute("UPDATE rounds SET result_sha = NULL WHERE round_id <= ?", (through,))
        return released

    def referenced_blobs(self) -> set[str]:
        """Every blob a kept row names: the rounds after the released ones, the global and initial base, the
        strategy state."""
        rows = self._query(_BLOBS_OF_ROUNDS.replace("{where}", "round_id > ?"), (self.released_through(),) * 4)
        meta = self._query(
            "SELECT value FROM meta WHERE key IN ('initial_base_sha', 'global_base_sha', 'strategy_state_sha')"
        )
        return {row[0] for row in rows + meta}

    # rounds

    def rounds(self) -> list[RoundRecord]:
        """Every round, oldest first."""
        return [_round(row) for row in self._query(f"SELECT {_ROUND_COLUMNS} FROM rounds ORDER BY round_id")]

    def round(self, round_id: int) -> RoundRecord | None:
        """One round, or None."""
        rows = self._query(f"SELECT {_ROUND_COLUMNS} FROM rounds WHERE round_id = ?", (round_id,))
        return _round(rows[0]) if rows else None

    def open_round(self) -> RoundRecord | None:
        """The open round, if any (there is at most one)."""
        rows = self._query(f"SELECT {_ROUND_COLUMNS} FROM rounds WHERE state = 'open'")
        return _round(rows[0]) if rows else None

    def last_round_id(self) -> int:
        """Highest round id so far (0 before the first)."""
        return self._query("SELECT COALESCE(MAX(round_id), 0) FROM rounds")[0][0]

    def count_closed(self) -> int:
        """Rounds aggregated so far."""
        return self._query("SELECT COUNT(*) FROM rounds WHERE state = 'closed'")[0][0]

    def create_round(
        self, record: RoundRecord, assignments: list[Assignment], strategy_state_sha: str | None = None
    ) -> None:
        """Open a round and record what each sampled device gets (and the strategy state), in one transaction."""
        with self.transaction() as db:
            if strategy_state_sha is not None:
                _write_meta(db, {"strategy_state_sha": strategy_state_sha})
            _insert_round(db, record)
            db.executemany(
                "INSERT INTO assignments (round_id, device, base_sha, settings) VALUES (?, ?, ?, ?)",
                [(a.round_id, a.device, a.base_sha, a.settings) for a in assignments],
            )

    def add_assignment(self, assignment: Assignment) -> None:
        """Record what a device is given in an open round (fedbuff: each device that takes a task on it)."""
        with self.transaction() as db:
            db.execute(
                "INSERT INTO assignments (round_id, device, base_sha, settings) VALUES (?, ?, ?, ?)",
                (assignment.round_id, assignment.device, assignment.base_sha, assignment.settings),
            )

    def finish_round(
        self,
        round_id: int,
        state: str,
        closed: float,
        global_base_sha: str,
        result_sha: str | None = None,
        aggregate_seconds: float | None = None,
        note: str | None = None,
        strategy_state_sha: str | None = None,
        epsilon: float | None = None,
        meta: Mapping[str, str] | None = None,
        applied: Sequence[tuple[int, str, int]] = (),
        next_round: RoundRecord | None = None,
        rejected: str | None = None,
    ) -> None:
        """Close (aggregated) or abandon the open round and set the global base (and strategy state, the epsilon
        spent and other `meta`, e.g. the privacy ledger), atomically; with fedbuff, the (round, device, staleness)
        of the uploads the step `applied` and the `next_round` it opens; after a rollback, the `rejected` base."""
        with self.transaction() as db:
            changed = db.execute(
                "UPDATE rounds SET state = ?, closed = ?, result_sha = ?, aggregate_seconds = ?, note = ?, "
                "epsilon = ? WHERE round_id = ? AND state = 'open'",
                (state, closed, result_sha, aggregate_seconds, note, epsilon, round_id),
            ).rowcount
            if changed != 1:
                raise StateError(f"round {round_id} is not open", "this is a bug: report it")
            _write_meta(db, {**(meta or {}), "global_base_sha": global_base_sha})
            if strategy_state_sha is not None:
                _write_meta(db, {"strategy_state_sha": strategy_state_sha})
            db.executemany(
                "UPDATE updates SET applied_in = ?, staleness = ? WHERE round_id = ? AND device = ?",
                [(round_id, staleness, upload_round, device) for upload_round, device, staleness in applied],
            )
            if next_round is not None:
                _insert_round(db, next_round)
            if rejected is not None:
                db.execute("INSERT OR IGNORE INTO rejected_bases (sha, round_id) VALUES (?, ?)", (rejected, round_id))

    def buffered_updates(self) -> list[UpdateRecord]:
        """Fedbuff's buffer: the accepted uploads no step has applied yet, in the order they were received."""
        return [
            UpdateRecord(*row)
            for row in self._query(
                f"SELECT {_UPDATE_COLUMNS} FROM updates WHERE status = 'accepted' AND applied_in IS NULL "
                "ORDER BY received, round_id, device"
            )
        ]

    def drop_updates(self, round_ids: Sequence[int]) -> int:
        """Take the not yet applied uploads of these rounds out of fedbuff's buffer (their base was rejected)."""
        with self.transaction() as db:
            return db.executemany(
                "UPDATE updates SET status = 'dropped' WHERE round_id = ? AND applied_in IS NULL",
                [(round_id,) for round_id in round_ids],
            ).rowcount

    def last_updates(self) -> list[UpdateRecord]:
        """Each device's latest upload (status page: its last staleness)."""
        rows = self._query(
            f"SELECT {_UPDATE_COLUMNS} FROM updates WHERE rowid IN (SELECT MAX(rowid) FROM updates GROUP BY device) "
            "ORDER BY device"
        )
        return [UpdateRecord(*row) for row in rows]

    # refusals of a round's base, and rejected bases

    def add_refusal(self, round_id: int, device: str, reason: str, received: float) -> bool:
        """Record a device's refusal of a round's base; False if it had already reported one."""
        with self.transaction() as db:
            return (
                db.execute(
                    "INSERT OR IGNORE INTO refusals (round_id, device, reason, received) VALUES (?, ?, ?, ?)",
                    (round_id, device, reason, received),
                ).rowcount
                == 1
            )

    def refusals(self, round_id: int) -> list[tuple[str, str]]:
        """The (device, reason) refusals of a round's base."""
        rows = self._query("SELECT device, reason FROM refusals WHERE round_id = ? ORDER BY device", (round_id,))
        return [(row["device"], row["reason"]) for row in rows]

    def rejected_bases(self) -> set[str]:
        """The bases devices rejected (a rollback never returns to one)."""
        return {row["sha"] for row in self._query("SELECT sha FROM rejected_bases")}

    def assigned_devices(self, round_id: int) -> list[str]:
        """The devices given a round (sampled, or fedbuff's takers)."""
        rows = self._query("SELECT device FROM assignments WHERE round_id = ? ORDER BY device", (round_id,))
        return [row["device"] for row in rows]

    # assignments, updates, metrics

    def assignment(self, round_id: int, device: str) -> Assignment | None:
        """What a device was given in a round, or None if it was not sampled."""
        rows = self._query(
            "SELECT round_id, device, base_sha, settings FROM assignments WHERE round_id = ? AND device = ?",
            (round_id, device),
        )
        return Assignment(*rows[0]) if rows else None

    def assigned_bases(self, round_id: int) -> set[str]:
        """The distinct base blobs the devices sampled in a round were sent."""
        rows = self._query("SELECT DISTINCT base_sha FROM assignments WHERE round_id = ?", (round_id,))
        return {row["base_sha"] for row in rows}

    def update(self, round_id: int, device: str) -> UpdateRecord | None:
        """A device's upload in a round, or None."""
        rows = self._query(
            f"SELECT {_UPDATE_COLUMNS} FROM updates WHERE round_id = ? AND device = ?", (round_id, device)
        )
        return UpdateRecord(*rows[0]) if rows else None

    def updates(self, round_id: int, status: str | None = "accepted") -> list[UpdateRecord]:
        """A round's uploads (accepted ones by default), by device name."""
        if status is None:
            rows = self._query(f"SELECT {_UPDATE_COLUMNS} FROM updates WHERE round_id = ? ORDER BY device", (round_id,))
        else:
            rows = self._query(
                f"SELECT {_UPDATE_COLUMNS} FROM updates WHERE round_id = ? AND status = ? ORDER BY device",
                (round_id, status),
            )
        return [UpdateRecord(*row) for row in rows]

    def add_update(self, record: UpdateRecord) -> None:
        """Record an accepted upload whose blob is already on disk."""
        with self.transaction() as db:
            db.execute(
                f"INSERT INTO updates ({_UPDATE_COLUMNS}) VALUES ({', '.join('?' * len(fields(UpdateRecord)))})",
                astuple(record),
            )

    def withdraw_updates(self, round_id: int) -> int:
        """Forget every upload of an open round; returns how many. Their blobs become unreferenced."""
        with self.transaction() as db:
            row = db.execute("SELECT state FROM rounds WHERE round_id = ?", (round_id,)).fetchone()
            if row is None or row[0] != "open":
                raise StateError(f"round {round_id} is not open: its uploads stay", "withdraw an open round's only")
            return db.execute("DELETE FROM updates WHERE round_id = ?", (round_id,)).rowcount

    def mark_corrupt(self, round_id: int, device: str) -> None:
        """Exclude an upload whose blob failed its sha256 check."""
        with self.transaction() as db:
            db.execute("UPDATE updates SET status = 'corrupt' WHERE round_id = ? AND device = ?", (round_id, device))

    def eval_metrics(self, round_id: int, device: str | None = None) -> list[EvalRecord]:
        """Evaluation metrics of a round (optionally of one device)."""
        sql = "SELECT round_id, device, accuracy, loss, num_samples, received FROM eval_metrics WHERE round_id = ?"
        args: tuple = (round_id,)
        if device is not None:
            sql, args = sql + " AND device = ?", (round_id, device)
        return [EvalRecord(*row) for row in self._query(sql + " ORDER BY device", args)]

    def add_eval_metrics(self, record: EvalRecord) -> None:
        """Record one device's evaluation metrics."""
        with self.transaction() as db:
            db.execute(
                "INSERT INTO eval_metrics (round_id, device, accuracy, loss, num_samples, received) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (record.round_id, record.device, record.accuracy, record.loss, record.num_samples, record.received),
            )


_BLOBS_OF_ROUNDS = (
    "SELECT base_sha FROM rounds WHERE {where} "
    "UNION SELECT result_sha FROM rounds WHERE result_sha IS NOT NULL AND {where} "
    "UNION SELECT base_sha FROM assignments WHERE {where} UNION SELECT blob_sha FROM updates WHERE {where}"
)
_ROUND_COLUMNS = (
    "round_id, state, base_sha, opened, deadline, sampled, closed, result_sha, aggregate_seconds, note, population, "
    "epsilon, target"
)
# the updates table's columns are UpdateRecord's fields, in order: a row reads back as UpdateRecord(*row)
_UPDATE_COLUMNS = ", ".join(field.name for field in fields(UpdateRecord))


def _insert_round(db: sqlite3.Connection, record: RoundRecord) -> None:
    db.execute(
        "INSERT INTO rounds (round_id, state, base_sha, opened, deadline, sampled, population, target) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            record.round_id,
            record.state,
            record.base_sha,
            record.opened,
            record.deadline,
            json.dumps(list(record.sampled)),
            record.population,
            record.target,
        ),
    )


def _write_meta(db: sqlite3.Connection, values: Mapping[str, str]) -> None:
    """The one way meta is written, inside the caller's transaction."""
    db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", list(values.items()))


def insert_device(
    db: sqlite3.Connection, name: str, token_hash: str, created: float, replace: bool, enroll_key_hash: str | None
) -> bool:
    """Insert or replace a device row inside the caller's transaction, by the rule of Store.add_device; True when
    it replaced a device enrolled with this same key (a retried enrollment)."""
    rows = db.execute("SELECT enroll_key_hash FROM devices WHERE name = ?", (name,)).fetchall()
    retry = bool(rows) and _same_key(rows[0][0], enroll_key_hash)
    if rows and not replace and not retry:
        raise AlreadyEnrolled(f"device {name!r} is already enrolled", "pass --replace to issue a new token")
    db.execute(
        "INSERT OR REPLACE INTO devices (name, token_hash, created, enroll_key_hash) VALUES (?, ?, ?, ?)",
        (name, token_hash, created, enroll_key_hash),
    )
    return retry


def _same_key(stored_hash: str | None, offered_hash: str | None) -> bool:
    """Whether an enrollment key matches the stored one (in constant time; no stored key matches nothing)."""
    if stored_hash is None or offered_hash is None:
        return False
    return hmac.compare_digest(stored_hash.encode(), offered_hash.encode())


def _round(row: sqlite3.Row) -> RoundRecord:
    return RoundRecord(**{**dict(row), "sampled": tuple(json.loads(row["sampled"]))})
