"""What the server shows: the status summary of every round and the history of retained global models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgepfl.protocol import API_PREFIX
from edgepfl.server.records import RoundRecord
from edgepfl.server.store import Store

if TYPE_CHECKING:
    from edgepfl.server.engine import RoundEngine


def history(store: Store, retention: int) -> dict[str, Any]:
    """JSON: the closed rounds whose global model can still be fetched, oldest first, and the retention."""
    rounds = store.rounds()
    released = store.released_through()
    return {
        "retention": retention,
        "released_through": released,
        "rounds": [
            {
                "round": record.round_id,
                "sha256": record.result_sha,
                "closed": record.closed,
                "url": f"{API_PREFIX}/rounds/{record.round_id}/result",
            }
            for record in rounds
            if record.state == "closed" and record.result_sha is not None
        ],
    }


def server_status(engine: RoundEngine, rounds: list[RoundRecord], available: int, state: str) -> dict[str, Any]:
    """JSON summary of the server and every round (no device names, no tensors), from the engine's snapshot."""
    rows = [round_summary(engine.store, record) for record in rounds]
    return {
        "state": state,
        "strategy": engine.strategy.name,
        "base_layout_hash": engine.manifest.base_layout_hash,
        "class_names": list(engine.manifest.class_names),
        "share_buffers": engine.config.share_buffers,
        "rounds_target": engine.config.rounds,
        "rounds_completed": sum(1 for r in rounds if r.state == "closed"),
        "min_clients": engine.config.min_clients,
        "fraction": engine.config.fraction,
        "round_timeout": engine.config.round_timeout,
        "devices_enrolled": engine.store.count_devices(),
        "devices_available": available,
        "upload_encoding": engine.config.strategy_options.settings.upload_encoding,
        "download_encoding": engine.config.strategy_options.settings.download_encoding,
        "privacy": privacy_status(engine, rounds),
        "stopped": engine.stopped,
        "open_round": next((row for row in rows if row["state"] == "open"), None),
        "rounds": rows,
    }


def privacy_status(engine: RoundEngine, rounds: list[RoundRecord]) -> dict[str, Any] | None:
    """DP-FedAvg's settings and the budget spent (epsilon at delta after the last closed round); None without DP."""
    if engine.budget is None:
        return None
    spent = [record.epsilon for record in rounds if record.state == "closed" and record.epsilon is not None]
    return engine.budget.status(spent[-1] if spent else 0.0)


def round_summary(store: Store, record: RoundRecord) -> dict[str, Any]:
    """One round's row of the status: counts, times, shas and metric summaries (no device names)."""
    updates = store.updates(record.round_id)
    evals = store.eval_metrics(record.round_id)
    return {
        "round": record.round_id,
        "state": record.state,
        "sampled": len(record.sampled),
        "uploads": len(updates),
        "opened": record.opened,
        "deadline": record.deadline,
        "closed": record.closed,
        "aggregate_seconds": record.aggregate_seconds,
        "upload_bytes": sum(u.nbytes for u in updates),
        "note": record.note,
        "epsilon": record.epsilon,
        "base_sha256": record.base_sha,
        "result_sha256": record.result_sha,
        "train_loss": _summary([u.train_loss for u in updates]),
        # issue 18's protocol: the held model (the round's base with each device's own part, as the round began)
        # and the trained one (after the round's local training), both on the devices' held-out data
        "start_val_accuracy": _summary([u.start_val_accuracy for u in updates]),
        "val_accuracy": _summary([u.val_accuracy for u in updates]),
        "eval_accuracy": _summary([e.accuracy for e in evals]),
    }


def _summary(values: list[float | None]) -> dict[str, float] | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"mean": sum(present) / len(present), "min": min(present), "max": max(present), "count": len(present)}
