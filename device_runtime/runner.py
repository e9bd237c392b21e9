"""The device's round loop: poll the task, train once per round, save, upload; resume safely after any crash.

One round: poll task -> train for round r > last completed -> fetch base (ETag-checked) -> set base ->
run the client algorithm -> commit state with the upload body saved as pending -> upload -> mark
delivered. After a `kill -9`, a pending upload is sent again (an identical body is idempotent on the
server) or dropped when its round is gone; a round is never trained twice. A base holding NaN/Inf, or a
round whose training diverges, is refused: the last good model stays, nothing is saved or sent, and the
device waits for the next round.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgepfl.data import LocalData, num_batches
from edgepfl.device_runtime.algorithms import (
    ClientResult,
    TrainingDiverged,
    divergence,
    evaluate,
    round_losses,
    round_phases,
    run_client_round,
    upload_specs,
    upload_tensors,
)
from edgepfl.device_runtime.client import RoundGone, ServerClient, ServerError, upload_body
from edgepfl.device_runtime.engine import Engine
from edgepfl.device_runtime.options import DeviceOptions
from edgepfl.device_runtime.persfl import TeacherStore, consider_global_model
from edgepfl.device_runtime.state import StateFolder
from edgepfl.device_runtime.statistics import receive
from edgepfl.encoding import drop_residual
from edgepfl.errors import BundleError, WireError
from edgepfl.manifest import Manifest
from edgepfl.protocol import API_PREFIX, EvalMetrics, RoundSettings, Task
from edgepfl.wire import check_tensors, nonfinite_names

MAX_WAIT = 60.0  # seconds between polls at most, whatever the server says


class DeviceEvents:
    """What the loop reports; the CLI draws it, tests may record it. Every method is a no-op here."""

    def message(self, text: str) -> None:
        """A one-line status message."""

    def round_started(self, round_id: int, settings: RoundSettings, total_steps: int) -> None:
        """Training of a round begins."""

    def step(self, phase: str, done: int, total: int, loss: float) -> None:
        """One training step finished."""

    def round_finished(self, round_id: int, result: ClientResult, upload: str) -> None:
        """A round's training is saved; `upload` is delivered, dropped or none."""


@dataclass(frozen=True)
class RunSummary:
    """What one `device run` did."""

    rounds_trained: int
    finished: bool  # the server said done
    final_accuracy: float | None
    bytes_sent: int
    bytes_received: int


def restore(engine: Engine, state: StateFolder) -> bool:
    """Load the saved tensors into the engine; False when the state is fresh (bundle's initial tensors)."""
    saved = state.load_tensors()
    if saved is None:
        return False
    engine.set_tensors(saved)
    return True


def run_device(
    engine: Engine,
    data: LocalData,
    state: StateFolder,
    client: ServerClient,
    options: DeviceOptions,
    events: DeviceEvents | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> RunSummary:
    """Take part in rounds until the server says done (or `options.max_rounds` rounds are trained)."""
    events = events or DeviceEvents()
    manifest = engine.manifest
    restore(engine, state)
    if state.state.pending_upload is not None:
        _deliver_pending(state, client, events)
    trained = 0
    told_waiting = False
    refused: set[int] = set()  # rounds whose base or result this device refused: it waits for the next one
    while options.max_rounds is None or trained < options.max_rounds:
        task = client.task()
        if task.base_layout_hash != manifest.base_layout_hash:
            raise BundleError(
                f"the server trains a base with layout {task.base_layout_hash[:12]}…, "
                f"this bundle has {manifest.base_layout_hash[:12]}…",
                "use the bundle the server was started with",
            )
        if task.action == "done":
            accuracy = _finish(engine, data, state, client, task, options, events)
            return _summary(trained, True, accuracy, client)
        round_id = task.round_id
        last = state.state.last_completed_round
        if task.action == "train" and round_id is not None and (last is None or round_id > last):
            if round_id not in refused:
                try:
                    if _train_round(engine, data, state, client, task, options, events):
                        trained += 1
                        told_waiting = False
                        continue
                except TrainingDiverged as error:
                    refused.add(round_id)
                    events.message(str(error))
                told_waiting = True
        if task.action == "train" and not told_waiting:
            events.message(f"round {round_id} is already trained on this device; waiting for the next round")
        elif not told_waiting:
            events.message("waiting for a round")
        told_waiting = True
        sleep(min(task.retry_after or options.poll_interval, MAX_WAIT))
    return _summary(trained, False, None, client)


def _train_round(
    engine: Engine,
    data: LocalData,
    state: StateFolder,
    client: ServerClient,
    task: Task,
    options: DeviceOptions,
    events: DeviceEvents,
) -> bool:
    """Fetch the base, train (`train_round`) and deliver one round; False when the round was gone before training."""
    round_id = task.round_id
    assert round_id is not None
    settings = task.settings or RoundSettings()
    try:
        base = client.fetch_tensors(task.base_url or f"{API_PREFIX}/rounds/{round_id}/base", settings.download_encoding)
    except RoundGone as gone:
        events.message(f"round {round_id} is gone before training ({gone.error}); rejoining the next round")
        return False
    result, payload, record = train_round(engine, data, state, round_id, settings, base, options, events)
    upload = _deliver_pending(state, client, events) if payload is not None else "none"
    if payload is None:
        _post_metrics(client, round_id, record, events)
    events.round_finished(round_id, result, upload)
    return True


def train_round(
    engine: Engine,
    data: LocalData,
    state: StateFolder,
    round_id: int,
    settings: RoundSettings,
    base: dict[str, Any],
    options: DeviceOptions,
    events: DeviceEvents,
) -> tuple[ClientResult, bytes | None, dict[str, Any]]:
    """Train one round from a received base and commit it, its upload body saved as pending (however it travels).

    Returns the result, the upload body (None when the algorithm uploads nothing) and the round's saved record.
    A base holding NaN/Inf, or a result whose loss or tensors blow up, raises TrainingDiverged with the
    engine back at the last good model and nothing saved or sent.
    """
    manifest = engine.manifest
    try:
        _check_base(base, manifest, settings, f"the base of round {round_id}")
    except TrainingDiverged as error:
        raise _skipped(error.problem, state) from None
    kept = engine.get_tensors()  # the last good model, back in place if this round's result is refused
    # a tensor kept on the device (HeurpFedLA) keeps the value this device trained; BatchNorm statistics are
    # re-estimated under the new base (statistics.py)
    receive(engine, base, data, settings)
    if options.persfl_teacher:
        _consider_teacher(engine, data, state, round_id, events)
    steps = sum(p.epochs for p in round_phases(settings, engine.available_sets()))
    events.round_started(round_id, settings, steps * num_batches(data.num_train, settings.batch_size))
    result = run_client_round(engine, settings, data, options.seed, round_id, progress=events.step)
    tensors = engine.get_tensors()
    why = divergence(round_losses(result), tensors, manifest.num_classes)
    if why is not None:
        engine.set_tensors(kept)
        raise _skipped(f"training diverged in round {round_id} ({why})", state)
    payload = None
    if result.uploads:
        meta = result.upload_meta(manifest.base_layout_hash)
        payload = upload_body(upload_tensors(engine, settings), base, settings, meta, state.residuals, round_id,
                              options.seed)  # fmt: skip
    record = {**result.to_json(), "round": round_id, "engine": engine.name, "upload": "pending" if payload else "none"}
    try:
        state.commit(tensors, record, round_id=round_id, upload_payload=payload)
    except BaseException:
        drop_residual(state.residuals, round_id)  # this round was not saved: its residual must feed no later round
        raise
    return result, payload, record


def _deliver_pending(state: StateFolder, client: ServerClient, events: DeviceEvents) -> str:
    """Upload the saved update of the pending round; returns delivered or dropped."""
    pending = state.state.pending_upload
    assert pending is not None
    payload = state.pending_payload()
    assert payload is not None
    try:
        client.upload(pending.round_id, payload)
    except RoundGone as gone:
        drop_residual(state.residuals, pending.round_id)  # first: a kill in between drops it again on the retry
        state.settle_upload(pending.round_id, delivered=False)
        events.message(
            f"round {pending.round_id} closed before its update arrived ({gone.error}); "
            "the update is dropped, the device rejoins the next round"
        )
        return "dropped"
    state.settle_upload(pending.round_id, delivered=True)
    record = next((r for r in reversed(state.state.history) if r.get("round") == pending.round_id), {})
    _post_metrics(client, pending.round_id, record, events)
    return "delivered"


def _post_metrics(client: ServerClient, round_id: int, record: dict[str, Any], events: DeviceEvents) -> None:
    """Report the personalized model's held-out evaluation; metrics are advisory, so failures only warn."""
    accuracy, samples = record.get("val_accuracy"), record.get("val_samples")
    if accuracy is None or not samples:
        return
    try:
        client.post_metrics(round_id, EvalMetrics(accuracy, int(samples), record.get("val_loss")))
    except ServerError as error:
        events.message(f"metrics of round {round_id} not reported: {error}")


def _finish(
    engine: Engine,
    data: LocalData,
    state: StateFolder,
    client: ServerClient,
    task: Task,
    options: DeviceOptions,
    events: DeviceEvents,
) -> float | None:
    """The run is over: take the final base (if any), evaluate the personalized model, save it.

    Without a final base after some rounds (pFedLA: every device had its own base), the model this device
    trained last is its personalized model.
    """
    if task.round_id is None:
        events.message("the server says the run is over")
        return None
    final_base = client.fetch_tensors(task.base_url) if task.base_url is not None else None
    if final_base is not None and _take_final_base(engine, data, state, final_base, task.settings, events):
        if options.persfl_teacher:
            # the final aggregate is the global model a round after the last one would have started from
            _consider_teacher(engine, data, state, task.round_id + 1, events)
    result = evaluate(engine, data)
    accuracy = result.accuracy if result.count else None
    record = {
        "final": True,
        "round": task.round_id,
        "val_accuracy": accuracy,
        "val_loss": result.loss if result.count else math.nan,
        "val_samples": result.count,
    }
    state.commit(engine.get_tensors(), record)
    shown = f"{accuracy:.3f}" if accuracy is not None else "n/a (no held-out data)"
    events.message(f"the run is over after round {task.round_id}; personalized accuracy {shown}")
    return accuracy


def _take_final_base(
    engine: Engine,
    data: LocalData,
    state: StateFolder,
    final_base: dict[str, Any],
    settings: RoundSettings | None,
    events: DeviceEvents,
) -> bool:
    """Load the final base unless it holds NaN/Inf or its held-out loss explodes (then keep the model as it is)."""
    kept = engine.get_tensors()
    try:
        check_global_model(final_base, engine.manifest, "the final base")
        receive(engine, final_base, data, settings or RoundSettings())
        result = evaluate(engine, data)
        why = divergence([result.loss] if result.count else [], {}, engine.manifest.num_classes)
        if why is not None:
            raise TrainingDiverged(f"the final base gives a held-out {why}", "")
    except TrainingDiverged as error:
        engine.set_tensors(kept)
        events.message(f"{error.problem}: kept {state.kept} as this device's model (ask the operator to check it)")
        return False
    return True


def _skipped(problem: str, state: StateFolder) -> TrainingDiverged:
    """The one line for a round whose base or result the device refuses: what happened, what it kept, the fix."""
    return TrainingDiverged(
        f"{problem}: kept {state.kept} and skipped the round",
        "ask the operator to check the server's model and --lr; the device joins the next round",
    )


def _consider_teacher(engine: Engine, data: LocalData, state: StateFolder, round_id: int, events: DeviceEvents) -> None:
    """PersFL stage 1: score the global model just received; keep it as the teacher if its held-out loss is lowest."""
    store = TeacherStore(state.folder, engine.manifest)
    kept, result = consider_global_model(engine, store, round_id, engine.get_tensors(), data)
    if kept:
        events.message(f"PersFL teacher: the global model of round {round_id} (held-out loss {result.loss:.4f})")


def _check_base(base: dict[str, Any], manifest: Manifest, settings: RoundSettings, what: str) -> None:
    """The server's base must be exactly the tensors this bundle shares, less those the device keeps, all finite."""
    bad = nonfinite_names(base)
    if bad:
        raise TrainingDiverged(f"{what} holds NaN or Inf in {bad[0]!r}", "ask the operator to check the server's model")
    try:
        check_tensors(base, upload_specs(manifest, settings), what=what)
    except WireError as error:
        raise BundleError(str(error), "use the bundle the server was started with") from None


def check_global_model(tensors: dict[str, Any], manifest: Manifest, what: str) -> None:
    """A global model (an aggregate, which carries no round settings) must be the whole shared set of this bundle.

    Whether BatchNorm statistics travel is read off the tensors themselves.
    """
    shares_buffers = any(name in tensors for name in manifest.names("buffer"))
    _check_base(tensors, manifest, RoundSettings(share_buffers=shares_buffers), what)


def _summary(trained: int, finished: bool, accuracy: float | None, client: ServerClient) -> RunSummary:
    return RunSummary(trained, finished, accuracy, client.traffic.sent, client.traffic.received)
