"""What the server shows: the status summary of every round."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgepfl.server.modes import MODES
from edgepfl.server.records import RoundRecord
from edgepfl.server.store import Store

if TYPE_CHECKING:
    from edgepfl.server.engine import RoundEngine


def server_status(
    engine: RoundEngine, rounds: list[RoundRecord], available: int, state: str, names: bool = False
) -> dict[str, Any]:
    """JSON summary of the server and every round (no tensors), from the engine's snapshot.

    Device names are the operator's alone (`names`: the operator's token): the open round's missing and refusing
    devices, and (fedbuff) each device's last staleness. Everyone else (a device's token, --public-status) sees
    the same things as counts: names are often personal ("alice-phone"), and a device has no need of others'.
    """
    rows = [round_summary(engine.store, record) for record in rounds]
    engine.mode.annotate(rows)  # e.g. a secure round: its step and how many devices were masked, dropped, recovered
    fleet = engine.config.fleet_rounds
    # each registered mode's section, None but for the mode that runs (e.g. "fedbuff": its buffer and staleness)
    sections = {mode.section: None for mode in MODES.values() if mode.section is not None}
    sections.update(engine.mode.status(rounds, names))
    enrolled = engine.store.count_devices()
    return {
        "state": state,
        "strategy": engine.strategy.name,
        "base_layout_hash": engine.manifest.base_layout_hash,
        "personal": str(engine.manifest.personal_spec),  # which parameters stay on the devices (edgepfl/personal.py)
        "class_names": list(engine.manifest.class_names),
        "share_buffers": engine.config.share_buffers,
        "rounds_target": engine.config.rounds,
        "rounds_completed": sum(1 for r in rounds if r.state == "closed"),
        "min_clients": engine.config.min_clients,
        "fraction": engine.config.fraction,
        "round_timeout": engine.config.round_timeout,
        "devices_enrolled": enrolled,
        "devices_available": available,
        "upload_encoding": engine.config.settings.upload_encoding,
        "download_encoding": engine.config.settings.download_encoding,
        "privacy": privacy_status(engine, rounds),
        **sections,
        "aggregation": fleet.aggregation,
        "over_select": fleet.over_select,
        "fleet_warnings": engine.config.fleet_warnings(enrolled),
        "stopped": engine.stopped,
        "open_round": open_round_status(engine, rounds, rows, names),
        "rounds": rows,
    }


def open_round_status(
    engine: RoundEngine, rounds: list[RoundRecord], rows: list[dict], names: bool = False
) -> dict[str, Any] | None:
    """The open round's row, with how many devices it waits for and refused its base (who, with `names`), and when
    it gives up: its deadline, or a secure round's step deadline once its keys are in (secure/rounds.py)."""
    record = next((record for record in rounds if record.state == "open"), None)
    if record is None:
        return None
    row = next(row for row in rows if row["round"] == record.round_id)
    refused = {device for device, _ in engine.store.refusals(record.round_id)}
    given = engine.store.assigned_devices(record.round_id)
    step, missing, deadline = engine.mode.waiting(record, given, sorted(refused))  # secure: a step, its deadline
    waiting = {"waiting_for": len(missing), "refused_base": len(refused), "secure_step": step, "gives_up_at": deadline}
    return {**row, **waiting, **({"missing": missing, "refused": sorted(refused)} if names else {})}


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
        "target": record.needed,
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
