"""The device's round loop: poll the task, train once per round, save, upload; resume safely after any crash.

One round: poll task -> train for round r > last completed -> fetch base (ETag-checked) -> the one device round
(`round.train_round`: check, receive, train, refuse a diverged result, commit state with the upload body saved
as pending) -> upload -> mark delivered. After a `kill -9`, a pending upload is sent again (an identical body is
idempotent on the server) or dropped when its round is gone; a round is never trained twice. A base holding
NaN/Inf, or a round whose training diverges, is refused: the last good model stays, nothing is saved or sent,
and the device waits for the next round. In a secure round (the task names its steps) the pending upload is never
sent: the device masks it through the round's steps (`secure_round.py`), resumably as well. A server that answers
5xx or nothing is waited out, never quit: polls and a kept update are retried with growing pauses (the update
until its round's deadline), and what the device waits for, and why, is said once, then sparsely (`waiting.py`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from edgepfl.data import LocalData
from edgepfl.device_runtime import secure_round
from edgepfl.device_runtime.algorithms import ClientResult, TrainingDiverged, divergence, evaluate
from edgepfl.device_runtime.client import RoundGone, ServerClient, ServerError, ServerRefused, ServerUnreachable
from edgepfl.device_runtime.engine import Engine
from edgepfl.device_runtime.options import DeviceOptions
from edgepfl.device_runtime.persfl import TeacherStore, consider_global_model
from edgepfl.device_runtime.round import check_global_model, offer_teacher, train_round
from edgepfl.device_runtime.state import StateFolder
from edgepfl.device_runtime.statistics import receive
from edgepfl.device_runtime.waiting import WaitLog
from edgepfl.encoding import drop_residual
from edgepfl.errors import BundleError, SecAggError, StateError
from edgepfl.protocol import API_PREFIX, EvalMetrics, RoundSettings, Task

MAX_WAIT = 60.0  # seconds between polls at most, whatever the server says
RESEND_FIRST = 1.0  # seconds before a kept update is sent again after an outage outlasted the client's retries; doubled


class DeviceEvents:
    """What the loop reports; the CLI draws it, tests may record it. Every method is a no-op here."""

    def message(self, text: str) -> None:
        """A one-line status message."""

    def waiting(self, text: str) -> None:
        """What the device waits for and why (`waiting.WaitLog` says it once, then sparsely): a message here."""
        self.message(text)

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
    waits: WaitLog | None = None,
    clock: Callable[[], float] = time.time,
) -> RunSummary:
    """Take part in rounds until the server says done (or `options.max_rounds` rounds are trained).

    A server that cannot be used (5xx, no answer) is waited out with growing pauses, never quit; `waits` says what
    the device waits for and why (a client whose `on_retry` feeds the same WaitLog says its retries there too).
    """
    events = events or DeviceEvents()
    waits = waits or WaitLog(state.folder, events.waiting, clock)
    manifest = engine.manifest
    restore(engine, state)
    if state.state.pending_upload is not None:
        _deliver_pending(state, client, events, options.seed, sleep, waits, clock)
    trained = 0
    failures = 0  # polls in a row the server did not answer
    refused: dict[int, str] = {}  # rounds whose base or result this device refused, and why: it waits for the next
    while options.max_rounds is None or trained < options.max_rounds:
        try:
            task = client.task()
            if failures:
                failures = 0
                waits.clear()
                events.message("the server answers again")
            if task.base_layout_hash != manifest.base_layout_hash:
                raise BundleError(
                    f"the server trains a base with layout {task.base_layout_hash[:12]}…, "
                    f"this bundle has {manifest.base_layout_hash[:12]}…",
                    "use the bundle the server was started with",
                )
            if task.action == "done":
                accuracy = _finish(engine, data, state, client, task, options, events)
                waits.clear()
                return _summary(trained, True, accuracy, client)
            round_id = task.round_id
            last = state.state.last_completed_round
            fresh = task.action == "train" and round_id is not None and (last is None or round_id > last)
            if fresh and round_id not in refused:
                try:
                    if _train_round(engine, data, state, client, task, options, events, sleep, waits, clock):
                        trained += 1
                        waits.clear()
                        continue
                except TrainingDiverged as error:
                    refused[round_id] = str(error)
                    _report_refusal(client, round_id, error.problem, events)
        except ServerUnreachable as error:
            failures += 1
            waits.waiting("the server", error.reason)
            sleep(min(options.poll_interval * 2 ** min(failures - 1, 16), MAX_WAIT))
            continue
        if fresh and round_id in refused:
            waits.waiting("the next round", refused[round_id])
        elif task.action == "train" and not fresh:
            waits.waiting("the next round", f"round {round_id} is already trained on this device")
        elif task.action != "train":
            waits.waiting("a round", "the server has no round for this device now")
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
    sleep: Callable[[float], None],
    waits: WaitLog,
    clock: Callable[[], float],
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
    if task.secure_aggregation is not None:  # the update is masked, never sent (secure_round.py): keys first
        secure_round.begin(state.folder, task.secure_aggregation, round_id)
    try:
        outcome = train_round(engine, data, state, round_id, settings, base, options, events)
    except TrainingDiverged:
        secure_round.forget(state.folder, round_id)
        raise
    if outcome.payload is not None and task.deadline is not None:
        state.keep_deadline(round_id, task.deadline)
    upload = "none"
    if outcome.payload is not None:
        upload = _deliver_pending(state, client, events, options.seed, sleep, waits, clock)
    if outcome.payload is None:
        _post_metrics(client, round_id, outcome.record, events)
    events.round_finished(round_id, outcome.result, upload)
    return True


def _deliver_pending(
    state: StateFolder,
    client: ServerClient,
    events: DeviceEvents,
    seed: int,
    sleep: Callable[[float], None],
    waits: WaitLog,
    clock: Callable[[], float],
) -> str:
    """Upload the saved update of the pending round, or take its secure steps (it stays on the device then);
    returns delivered or dropped.

    Through an outage the update is kept and sent again with growing pauses for as long as its round can take it
    (its deadline, as the task gave it), then dropped, as a round the server closed is.
    """
    pending = state.state.pending_upload
    assert pending is not None
    payload = state.pending_payload()
    assert payload is not None
    secure = secure_round.holds(state.folder, pending.round_id)
    what = "its masked update" if secure else "its update"
    failures = 0
    while True:
        try:
            if secure:
                secure_round.deliver(state.folder, pending.round_id, payload, client, seed, sleep)
            else:
                client.upload(pending.round_id, payload)
            break
        except (RoundGone, SecAggError) as gone:
            why = gone.error if isinstance(gone, RoundGone) else f"the device refused the server's message: {gone}"
            return _drop_pending(
                state, pending.round_id, f"round {pending.round_id} closed before {what} arrived ({why})", events
            )
        except ServerUnreachable as error:
            left = math.inf if pending.deadline is None else pending.deadline - clock()
            if left <= 0:
                return _drop_pending(
                    state,
                    pending.round_id,
                    f"round {pending.round_id}'s deadline passed before {what} could be sent ({error.reason})",
                    events,
                )
            deadline = pending.deadline
            until = "the server answers" if deadline is None else f"its deadline, {_clock_time(deadline)}"
            waits.waiting(
                f"the server to take round {pending.round_id}'s update",
                f"{error.reason}; the update is kept and sent again until {until}",
            )
            failures += 1
            sleep(min(RESEND_FIRST * 2 ** min(failures - 1, 16), MAX_WAIT, left))
    state.settle_upload(pending.round_id, delivered=True)
    secure_round.forget(state.folder, pending.round_id)
    if failures:
        waits.clear()
        events.message(f"round {pending.round_id}'s update is delivered after the outage")
    record = next((r for r in reversed(state.state.history) if r.get("round") == pending.round_id), {})
    _post_metrics(client, pending.round_id, record, events)
    return "delivered"


def _drop_pending(state: StateFolder, round_id: int, why: str, events: DeviceEvents) -> str:
    """The pending round can no longer take its update: forget it (and its residual), say so; returns dropped."""
    drop_residual(state.residuals, round_id)  # first: a kill in between drops it again on the retry
    state.settle_upload(round_id, delivered=False)
    secure_round.forget(state.folder, round_id)
    events.message(f"{why}; the update is dropped, the device rejoins the next round")
    return "dropped"


def _clock_time(unix_seconds: float) -> str:
    """A deadline as a person reads it on this device's clock: 19:03:10 (today) or 2026-11-29 19:03:10."""
    moment = datetime.fromtimestamp(unix_seconds)
    today = datetime.now().date()
    return moment.strftime("%H:%M:%S" if moment.date() == today else "%Y-%m-%d %H:%M:%S")


def _report_refusal(client: ServerClient, round_id: int, problem: str, events: DeviceEvents) -> None:
    """Tell the server this device refused the round's base, so a base most devices refuse is rolled back;
    advisory, so failures only warn."""
    try:
        client.report_refusal(round_id, problem)
    except ServerError as error:
        events.message(f"the refusal of round {round_id}'s base was not reported: {error}")


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
            offer_teacher(engine, data, state, task.round_id + 1, events)
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


def _summary(trained: int, finished: bool, accuracy: float | None, client: ServerClient) -> RunSummary:
    return RunSummary(trained, finished, accuracy, client.traffic.sent, client.traffic.received)


def teacher_from_history(
    client: ServerClient, engine: Engine, store: TeacherStore, data: LocalData, on_message: Callable[[str], None]
) -> dict[str, float]:
    """PersFL for a new participant (`device teacher`): score every global model the server keeps, keep the best.

    Each one is scored on the held-out data as `device run --persfl-teacher` scores a round's (`store` keeps the one
    with the lowest loss); a round released meanwhile or a global model holding NaN/Inf is skipped, said through
    `on_message`. Returns the held-out loss of each round scored; StateError when there was none to score.
    """
    entries = client.history()
    if not entries:
        raise StateError("the server keeps no global model yet", "run this after the server closed a round")
    losses: dict[str, float] = {}
    for entry in entries:
        try:
            global_model = client.global_model(entry)
        except ServerRefused as refused:
            if refused.error != "released":
                raise
            on_message(f"round {entry.round_id} was released meanwhile; skipped")
            continue
        try:
            check_global_model(global_model, engine.manifest, f"the global model of round {entry.round_id}")
        except TrainingDiverged as refused:
            on_message(f"{refused.problem}; skipped")
            continue
        # labelled like stage 1 in `device run`: the round that starts from this global model
        kept, result = consider_global_model(engine, store, entry.round_id + 1, global_model, data)
        losses[str(entry.round_id)] = result.loss
        on_message(
            f"global model of round {entry.round_id}: held-out loss {result.loss:.4f}"
            + (" (kept as teacher)" if kept else "")
        )
    if store.record is None:
        raise StateError("no global model could be scored", "check the server's history and --val-fraction")
    return losses
