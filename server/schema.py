"""The server database's schema: the tables, and the steps that bring an older state folder up to date.

`PRAGMA user_version` is the number of steps a folder has had; `Store` runs the missing ones in one transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS devices (
    name TEXT PRIMARY KEY, token_hash TEXT NOT NULL UNIQUE, created REAL NOT NULL, enroll_key_hash TEXT);
CREATE TABLE IF NOT EXISTS rounds (
    round_id INTEGER PRIMARY KEY, state TEXT NOT NULL, base_sha TEXT NOT NULL,
    opened REAL NOT NULL, deadline REAL NOT NULL, closed REAL, sampled TEXT NOT NULL,
    result_sha TEXT, aggregate_seconds REAL, note TEXT);
CREATE TABLE IF NOT EXISTS assignments (
    round_id INTEGER NOT NULL, device TEXT NOT NULL, base_sha TEXT NOT NULL, settings TEXT NOT NULL,
    PRIMARY KEY (round_id, device));
CREATE TABLE IF NOT EXISTS updates (
    round_id INTEGER NOT NULL, device TEXT NOT NULL, blob_sha TEXT NOT NULL, nbytes INTEGER NOT NULL,
    num_samples INTEGER NOT NULL, train_loss REAL, val_accuracy REAL, val_loss REAL,
    received REAL NOT NULL, status TEXT NOT NULL DEFAULT 'accepted', PRIMARY KEY (round_id, device));
CREATE TABLE IF NOT EXISTS eval_metrics (
    round_id INTEGER NOT NULL, device TEXT NOT NULL, accuracy REAL NOT NULL, loss REAL,
    num_samples INTEGER NOT NULL, received REAL NOT NULL, PRIMARY KEY (round_id, device));
"""


def _schema_1(db: sqlite3.Connection) -> None:
    """The tables; a folder from before `user_version` (0) may lack devices.enroll_key_hash: it is added."""
    for statement in filter(str.strip, _SCHEMA.split(";")):
        db.execute(statement)
    columns = {row["name"] for row in db.execute("PRAGMA table_info(devices)")}
    if "enroll_key_hash" not in columns:
        db.execute("ALTER TABLE devices ADD COLUMN enroll_key_hash TEXT")


def _schema_2(db: sqlite3.Connection) -> None:
    """DP: each round's population (devices it sampled from) and the epsilon spent once it closed."""
    db.execute("ALTER TABLE rounds ADD COLUMN population INTEGER")
    db.execute("ALTER TABLE rounds ADD COLUMN epsilon REAL")


def _schema_3(db: sqlite3.Connection) -> None:
    """Issue 18: each upload's held-out accuracy of the model its device held when the round began."""
    db.execute("ALTER TABLE updates ADD COLUMN start_val_accuracy REAL")


def _schema_4(db: sqlite3.Connection) -> None:
    """Issue 32: a round's target (over-selection), FedBuff's applied step and staleness of each upload, the
    devices' refusals of a round's base, and the bases they rejected."""
    db.execute("ALTER TABLE rounds ADD COLUMN target INTEGER")
    db.execute("ALTER TABLE updates ADD COLUMN applied_in INTEGER")
    db.execute("ALTER TABLE updates ADD COLUMN staleness INTEGER")
    db.execute(
        "CREATE TABLE refusals (round_id INTEGER NOT NULL, device TEXT NOT NULL, reason TEXT NOT NULL, "
        "received REAL NOT NULL, PRIMARY KEY (round_id, device))"
    )
    db.execute("CREATE TABLE rejected_bases (sha TEXT PRIMARY KEY, round_id INTEGER NOT NULL)")


def _schema_5(db: sqlite3.Connection) -> None:
    """Issue 33: join links (server/joinlinks.py): each one's secret's sha256, expiry, device cap and use count."""
    db.execute(
        "CREATE TABLE join_links (link_id INTEGER PRIMARY KEY, secret_hash TEXT NOT NULL UNIQUE, "
        "created REAL NOT NULL, expires REAL, max_devices INTEGER, used INTEGER NOT NULL DEFAULT 0, revoked REAL)"
    )


def _schema_6(db: sqlite3.Connection) -> None:
    """Issue 34: secure aggregation (server/secure/): each secure round's protocol state (a snapshot of its session
    at each step, the messages accepted since, its counts), deleted but for the counts once the round is over."""
    db.execute(
        "CREATE TABLE secure_rounds (round_id INTEGER PRIMARY KEY, phase TEXT NOT NULL, since REAL NOT NULL, "
        "snapshot TEXT, summary TEXT NOT NULL)"
    )
    db.execute(
        "CREATE TABLE secure_messages (round_id INTEGER NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, "
        "body BLOB NOT NULL, PRIMARY KEY (round_id, seq))"
    )


# step i brings a folder from user_version i to i + 1; a new schema change is one more step, never an edit
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (
    _schema_1,
    _schema_2,
    _schema_3,
    _schema_4,
    _schema_5,
    _schema_6,
)
