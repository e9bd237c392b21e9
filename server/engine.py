"""The round engine: deadlines, opening and closing rounds, and what is stored when.

The other concerns live in files of their own: `sampling.py` (who a round samples), `uploads.py` (what
an upload must be), `bounds.py` (what one device can move), `round_uploads.py` (a round's uploads read back for
aggregation), `enrollment.py` (tokens, the shared secret), `status.py` (status and history), `store.py` (SQLite
and blobs), `http_errors.py` (refusal -> status).

One engine per state folder and per process. Rounds follow one life:

- A round opens when no round is open and at least `min_clients` devices have polled `/v1/task`
  within `available_for` seconds, and either every enrolled device is among them or one
  `poll_interval` has passed since `min_clients` were first available (so every live device has had
  a chance to show up, and round 1 is not just the first `min_clients` to poll). It samples
  max(min_clients, ceil(fraction * available)) of them (capped at the number available) with an
  RNG seeded by (seed, round id), so a restart samples alike.
- It closes when every sampled device has uploaded, or at its deadline if at least `min_clients`
  uploads were accepted: the strategy aggregates the accepted updates and the result becomes the
  global base. Closing is one SQLite transaction, so a round is aggregated once or not at all.
- At its deadline with fewer than `min_clients` uploads, the round is *abandoned*: nothing is
  aggregated, its uploads are kept on disk but never used, and the next round (a new id) starts
  from the same global base.
- After `rounds` closed rounds every device is told "done" and given the final base.

A strategy that learns more than the global base (pFedLA's hypernetworks) hands it over as
`state_bytes()`; it is saved as a blob in the transaction that opens or closes a round, loaded at
start, and reloaded whenever an opening or a close fails, so a restart or a retried close never
applies a round twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgepfl.encoding import encode_download
from edgepfl.errors import BundleError, EdgePFLError, StateError, WireError
from edgepfl.manifest import Manifest, layout_hash, load_manifest
from edgepfl.privacy import PrivacyLedger
from edgepfl.protocol import API_PREFIX, EvalMetrics, RoundSettings, Task
from edgepfl.server.bounds import UpdateBounds, delta_norm
from edgepfl.server.budget import PrivacyBudget
from edgepfl.server.config import ServerConfig
from edgepfl.server.enrollment import Enrollment
from edgepfl.server.errors import Refused
from edgepfl.server.records import Assignment, EvalRecord, RoundRecord, UpdateRecord
from edgepfl.server.round_uploads import RoundUploads
from edgepfl.server.sampling import sample_devices
from edgepfl.server.status import history, server_status
from edgepfl.server.store import Store
from edgepfl.server.strategies import make_strategy
from edgepfl.server.strategy import Strategy
from edgepfl.server.uploads import (
    add_delta,
    check_plan,
    finite_or_none,
    read_upload_delta,
    read_upload_meta,
    read_upload_tensors,
)
from edgepfl.wire import check_tensors, decode_metadata, decode_tensors, encode_tensors, load_tensors

log = logging.getLogger("edgepfl.server")

INITIAL_TENSORS = Path("portable") / "initial.safetensors"


def create_engine(config: ServerConfig, clock: Callable[[], float] = time.time) -> RoundEngine:
    """Load the bundle's manifest, open (or create) the state folder and bind the two together."""
    manifest = load_manifest(config.bundle)
    store = Store(config.state)
    specs = manifest.shared(config.share_buffers)
    strategy = make_strategy(config.strategy, specs, config.strategy_options)
    strategy.check_manifest(manifest)
    engine = RoundEngine(config, manifest, store, strategy, clock)
    engine.bind_state()
    return engine


class RoundEngine:
    """Owns the rounds of one state folder; the HTTP app calls it, a background thread ticks it."""

    def __init__(
        self, config: ServerConfig, manifest: Manifest, store: Store, strategy: Strategy, clock: Callable[[], float]
    ):
        self.config = config
        self.manifest = manifest
        self.store = store
        self.strategy = strategy
        self.clock = clock
        self.specs = strategy.specs
        self._shared_names = {spec.name for spec in self.specs}
        self._personal_names = set(manifest.names("personal"))
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._seen: dict[str, float] = {}  # device -> last /v1/task poll (availability is not durable state)
        self._closing: int | None = None  # round being aggregated outside the lock
        self._quorum_since: float | None = None  # when min_clients devices were first available for the next round
        self.enrollment = Enrollment(config, store, clock)
        bounds = UpdateBounds(config.clip_multiple, config.weight_multiple)
        self.uploads = RoundUploads(store, self.specs, bounds, self.settings_for)
        self._downloads: dict[tuple[str, str], tuple[bytes, str]] = {}  # (base sha, encoding) -> bytes sent, sha
        self.dp = config.privacy.dp_config()  # DP-FedAvg settings (None: off)
        self.budget: PrivacyBudget | None = None  # what a DP run has spent (bind_state loads it)
        # the DP noise is drawn from OS entropy: whoever knows the noise can subtract it (simulate seeds it)
        self.noise_seed: int | None = None
        self.stopped: str | None = None  # why the run ended before --rounds (the DP budget), once known

    # start-up

    def bind_state(self) -> None:
        """Tie the state folder to this bundle and strategy; store the round-1 base on first start."""
        binding = {
            "bundle_base_layout_hash": self.manifest.base_layout_hash,
            "shared_layout_hash": layout_hash(self.specs),
            "strategy": self.strategy.name,
        }
        for key, value in binding.items():
            stored = self.store.get_meta(key)
            if stored is not None and stored != value:
                raise StateError(
                    f"the state folder {self.config.state} was made with a different {key.replace('_', ' ')} "
                    f"({stored[:16]}, now {value[:16]})",
                    "restart with the same --bundle, --strategy and --share-bn-stats, or use a new --state folder",
                )
        if self.store.get_meta("initial_base_sha") is None:
            initial = self._initial_base()
            sha = self.store.put_blob(encode_tensors(initial))
            self.store.set_meta({**binding, "initial_base_sha": sha, "global_base_sha": sha})
        self.budget = PrivacyBudget.bind(self.dp, self.store, self.strategy.name, self.config.state)
        self._load_strategy_state()
        self._apply_history()
        removed = self.store.remove_unreferenced_blobs()
        if removed:
            log.info("removed %d unreferenced blob(s) left by an interrupted write", removed)

    @property
    def ledger(self) -> PrivacyLedger | None:
        """The privacy budget spent so far (None without DP)."""
        return self.budget.ledger if self.budget is not None else None

    def _initial_base(self) -> dict[str, Any]:
        path = self.config.init or Path(self.config.bundle) / INITIAL_TENSORS
        if not Path(path).is_file():
            raise BundleError(
                f"{path} does not exist, and devices start round 1 from the bundle's initial tensors",
                "export the bundle with the portable engine, or pass --init FILE.safetensors with its initial tensors",
            )
        tensors = load_tensors(path)
        shared = {name: value for name, value in tensors.items() if name in self._shared_names}
        check_tensors(shared, self.specs, what=f"initial tensors {path}")
        return shared

    # device calls

    def task(self, device: str) -> Task:
        """What a device should do now; polling also makes it available for sampling."""
        with self._lock:
            try:
                self.strategy.check_device(device)
            except EdgePFLError as error:  # e.g. pfedla's N client places all belong to other devices
                raise Refused("cannot_join", error.problem, error.fix) from None
            now = self.clock()
            self._seen[device] = now
            if self._done():
                return self._done_task(device)
            current = self.store.open_round()
            if current is None and self._closing is None:
                current = self._maybe_open(now)
            if current is not None and current.round_id != self._closing and now < current.deadline:
                assignment = self.store.assignment(current.round_id, device)
                if assignment is not None and self.store.update(current.round_id, device) is None:
                    return Task(
                        action="train",
                        base_layout_hash=self.manifest.base_layout_hash,
                        round_id=current.round_id,
                        settings=self._settings_of(assignment, current.round_id),
                        base_url=f"{API_PREFIX}/rounds/{current.round_id}/base",
                        deadline=current.deadline,
                    )
            return Task(
                action="wait", base_layout_hash=self.manifest.base_layout_hash, retry_after=self.config.poll_interval
            )

    def base_for(self, device: str, round_id: int) -> tuple[bytes, str]:
        """The base tensors a device gets for a round (safetensors bytes) and their sha256."""
        record = self._round_or_404(round_id)
        self._check_retained(record)
        assignment = self.store.assignment(round_id, device)
        if assignment is not None:
            sha = assignment.base_sha
        elif self._shares_base(round_id):
            sha = record.base_sha
        else:
            raise Refused(
                "not_sampled",
                f"device {device!r} was not sampled in round {round_id}",
                "poll /v1/task and fetch the base it names",
            )
        encoding = self._settings_of(assignment, round_id).download_encoding
        if encoding == "fp32":
            return self.store.read_blob(sha), sha
        with self._lock:
            sent = self._downloads.get((sha, encoding))
            if sent is None:
                if len(self._downloads) > 64:  # per-device bases (pFedLA): bounded, encoded again when needed
                    self._downloads.clear()
                payload = encode_download(self.store.read_blob(sha), encoding)
                sent = self._downloads[(sha, encoding)] = (payload, hashlib.sha256(payload).hexdigest())
        return sent

    def result_of(self, round_id: int) -> tuple[bytes, str]:
        """The aggregated base (global model) a closed round produced."""
        record = self._round_or_404(round_id)
        self._check_retained(record)
        if record.result_sha is None:
            raise Refused(
                "no_result",
                f"round {round_id} is {record.state} and has no aggregated base",
                "fetch the result of a closed round (see /v1/status)",
            )
        return self.store.read_blob(record.result_sha), record.result_sha

    def history(self) -> dict[str, Any]:
        """JSON: the closed rounds whose global model can still be fetched, oldest first, and the retention."""
        with self._lock:
            return history(self.store, self.config.history)

    def status(self) -> dict[str, Any]:
        """JSON summary of the server and every round (no device names, no tensors)."""
        with self._lock:
            now = self.clock()
            rounds = self.store.rounds()
            available = sum(1 for seen in self._seen.values() if now - seen <= self.config.available_for)
            training = self.store.open_round() is not None
            state = "done" if self._done() else "closing" if self._closing else "training" if training else "waiting"
        return server_status(self, rounds, available, state)

    def check_upload_allowed(self, device: str, round_id: int) -> None:
        """Refuse an upload before its body is read: unknown round, closed round, not sampled, too late."""
        with self._lock:
            if self.store.update(round_id, device) is not None:
                return  # a retry: decided by comparing the bytes
            self._check_open_for(device, round_id)

    def accept_update(self, device: str, round_id: int, payload: bytes) -> dict[str, Any]:
        """Check an upload against the manifest and store it durably; returns the receipt."""
        self.check_upload_allowed(device, round_id)
        meta = read_upload_meta(payload, self.manifest, self.config.max_samples)
        base_tensors = read_upload_tensors(payload, self.manifest, self._shared_names)
        settings = self._settings_of(self.store.assignment(round_id, device), round_id)
        travelling = settings.travelling(self.specs)
        if settings.uploads_delta:  # decoded as the round asked, then every check below holds on base + delta
            delta = read_upload_delta(base_tensors, decode_metadata(payload), settings, travelling)
            base_tensors = add_delta(self.uploads.base_of(round_id, device), delta, travelling)
        try:
            check_tensors(base_tensors, travelling, what="upload")
        except WireError as error:
            raise Refused("bad_tensors", error.problem, error.fix) from None
        sha = hashlib.sha256(payload).hexdigest()
        previous = self.store.update(round_id, device)
        if previous is not None:
            return self._retry_receipt(previous, sha)
        norm = delta_norm(base_tensors, self.uploads.base_of(round_id, device))
        self.store.put_blob(payload, sha)  # on disk (fsynced) before the row that names it is committed
        with self._lock:
            previous = self.store.update(round_id, device)
            if previous is not None:
                return self._retry_receipt(previous, sha)
            self._check_open_for(device, round_id)
            self.store.put_blob(payload, sha)  # again: a release of history may have deleted identical bytes
            self.store.add_update(
                UpdateRecord(
                    round_id,
                    device,
                    sha,
                    len(payload),
                    meta.num_samples,
                    finite_or_none(meta.train_loss),
                    finite_or_none(meta.val_accuracy),
                    finite_or_none(meta.val_loss),
                    self.clock(),
                    start_val_accuracy=finite_or_none(meta.start_val_accuracy),
                )
            )
            self.uploads.remember_norm(round_id, device, norm)
            uploads = len(self.store.updates(round_id))
            sampled = len(self._round_or_404(round_id).sampled)
        self._wake.set()
        return {
            "accepted": True,
            "round": round_id,
            "sha256": sha,
            "duplicate": False,
            "uploads": uploads,
            "sampled": sampled,
        }

    def withdraw_uploads(self, round_id: int) -> int:
        """Forget an open round's uploads, so that its devices upload again; returns how many were forgotten.

        For in-process drivers only (no HTTP route): a simulated run resumed after an interruption trains the
        round again, and a GPU's training does not repeat its bytes, which the one-upload-per-round rule refuses.
        """
        with self._lock:
            self.uploads.forget(round_id)
            return self.store.withdraw_updates(round_id)

    def accept_metrics(self, device: str, round_id: int, metrics: EvalMetrics) -> dict[str, Any]:
        """Store a device's evaluation of its personalized model after a round."""
        try:
            metrics.check(self.config.max_samples)
        except WireError as error:
            raise Refused("bad_metrics", error.problem, error.fix) from None
        with self._lock:
            self._round_or_404(round_id)
            if self.store.assignment(round_id, device) is None:
                raise Refused(
                    "not_sampled",
                    f"device {device!r} was not sampled in round {round_id}",
                    "report metrics for a round you trained in",
                )
            previous = self.store.eval_metrics(round_id, device)
            if previous:
                same = (previous[0].accuracy, previous[0].loss, previous[0].num_samples) == (
                    metrics.accuracy,
                    metrics.loss,
                    metrics.num_samples,
                )
                if not same:
                    raise Refused(
                        "duplicate_metrics",
                        f"device {device!r} already reported metrics for round {round_id}, with different values",
                        "report each round's metrics once",
                    )
                return {"accepted": True, "round": round_id, "duplicate": True}
            self.store.add_eval_metrics(
                EvalRecord(round_id, device, metrics.accuracy, metrics.loss, metrics.num_samples, self.clock())
            )
        return {"accepted": True, "round": round_id, "duplicate": False}

    # the round loop

    def tick(self) -> None:
        """Close a round that is complete or past its deadline, then open the next one if devices wait."""
        with self._lock:
            now = self.clock()
            current = self.store.open_round()
            to_close = None
            if current is not None and self._closing is None:
                accepted = len(self.store.updates(current.round_id))
                if accepted >= len(current.sampled) or now >= current.deadline:
                    if accepted >= self.config.min_clients:
                        to_close = current
                        self._closing = current.round_id
                    else:
                        self._abandon(current, now, f"{accepted} of {len(current.sampled)} uploads by the deadline")
        if to_close is not None:
            self._close(to_close)
        with self._lock:
            if self._closing is None and not self._done() and self.store.open_round() is None:
                self._maybe_open(self.clock())

    def run(self, stop: threading.Event, interval: float = 0.25) -> None:
        """Tick until `stop` is set; woken early by each accepted upload. Never dies on an error."""
        while not stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            try:
                self.tick()
            except Exception:  # the loop must outlive any one round's failure; the round stays open
                log.exception("round engine tick failed; retrying")
                with self._lock:
                    self._closing = None
                stop.wait(1.0)

    def _close(self, record: RoundRecord) -> None:
        started = time.perf_counter()
        try:
            global_base = decode_tensors(self.store.read_blob(record.base_sha))
            ledger = None
            if self.budget is not None:
                new_base, ledger = self.budget.aggregate(
                    record.round_id,
                    self.uploads.deltas(record),
                    global_base,
                    self.specs,
                    record.population or len(record.sampled),
                    len(record.sampled),
                    self.noise_seed,
                )
            else:
                updates = self.uploads.bounded_updates(record, self.strategy.streaming)
                new_base = self.strategy.aggregate(record.round_id, updates, global_base)
            check_tensors(new_base, self.specs, what=f"aggregate of round {record.round_id}")
        except OSError:
            with self._lock:
                self._load_strategy_state()  # the round stays open and is aggregated again from the saved state
                self._closing = None
            raise
        except (EdgePFLError, ValueError) as error:
            log.error("round %d cannot be aggregated: %s", record.round_id, error)
            with self._lock:
                self._load_strategy_state()
                self._abandon(record, self.clock(), f"aggregation failed: {error}")
                self._closing = None
            return
        try:
            sha = self.store.put_blob(encode_tensors(new_base))
            strategy_state = self.strategy.state_bytes()
            state_sha = self.store.put_blob(strategy_state) if strategy_state is not None else None
            seconds = time.perf_counter() - started
            epsilon = ledger.epsilon() if ledger is not None else None
            with self._lock:
                self.store.finish_round(
                    record.round_id,
                    "closed",
                    self.clock(),
                    global_base_sha=sha,
                    result_sha=sha,
                    aggregate_seconds=seconds,
                    strategy_state_sha=state_sha,
                    epsilon=epsilon,
                    meta={"privacy_ledger": ledger.to_json()} if ledger is not None else None,
                )
                if self.budget is not None and ledger is not None:
                    self.budget.ledger = ledger
        except BaseException:
            with self._lock:
                self._load_strategy_state()
                self._closing = None
            raise
        with self._lock:
            self._closing = None
            self.uploads.closed(record.round_id)
            self._downloads.clear()
            self._apply_history()  # after the commit: a failed release leaves the round closed and the blobs kept
        spent = f"; epsilon {epsilon:.4g} at delta {self.dp.delta:g}" if epsilon is not None and self.dp else ""
        log.info(
            "round %d closed: %d update(s) aggregated in %.3f s%s",
            record.round_id,
            len(self.store.updates(record.round_id)),
            seconds,
            spent,
        )

    def _apply_history(self) -> None:
        """Release the tensors of rounds older than the last `history` closed rounds (0 keeps every round)."""
        if self.config.history == 0:
            return
        closed = [record.round_id for record in self.store.rounds() if record.state == "closed"]
        if len(closed) <= self.config.history:
            return
        through = closed[-self.config.history] - 1
        removed = self.store.release_history(through)
        if removed:
            log.info("history: released the tensors of rounds up to %d (%d blob file(s))", through, removed)

    def _load_strategy_state(self) -> None:
        """Bring the strategy back to its last saved state (a strategy that keeps none is left as is)."""
        sha = self.store.get_meta("strategy_state_sha")
        if sha is not None:
            self.strategy.load_state(self.store.read_blob(sha))
        elif self.strategy.state_bytes() is not None:  # nothing saved yet: back to a fresh strategy
            self.strategy = type(self.strategy)(self.specs, self.strategy.options)

    def _abandon(self, record: RoundRecord, now: float, why: str) -> None:
        global_base = self.store.get_meta("global_base_sha") or record.base_sha
        self.store.finish_round(record.round_id, "abandoned", now, global_base_sha=global_base, note=why)
        log.warning("round %d abandoned: %s; the next round starts from the same base", record.round_id, why)

    def _maybe_open(self, now: float) -> RoundRecord | None:
        recent = sorted(d for d, seen in self._seen.items() if now - seen <= self.config.available_for)
        available = self.strategy.admissible(recent)
        if len(available) < self.config.min_clients:
            self._quorum_since = None
            return None
        if self._quorum_since is None:
            self._quorum_since = now
        everyone = len(available) >= self.store.count_devices()
        if not everyone and now - self._quorum_since < self.config.poll_interval:
            return None
        self._quorum_since = None
        round_id = self.store.last_round_id() + 1
        sampled = sample_devices(self.config.seed, round_id, available, self.config.fraction, self.config.min_clients)
        if self.budget is not None:
            self.stopped = self.budget.stop_before(round_id, len(available), len(sampled))
            if self.stopped is not None:
                log.warning("%s", self.stopped)
                return None
        base_sha = self.store.get_meta("global_base_sha")
        assert base_sha is not None, "bind_state() stores the initial base"
        try:
            assignments = self._plan_round(round_id, sampled, base_sha)
            # planning may change the strategy (e.g. a device's first sight): saved with the round's opening
            strategy_state = self.strategy.state_bytes()
            state_sha = self.store.put_blob(strategy_state) if strategy_state is not None else None
        except EdgePFLError as error:  # the strategy refuses this round
            self._load_strategy_state()
            log.error("round %d not opened: %s", round_id, error)
            raise Refused("round_not_opened", error.problem, error.fix) from None
        except BaseException:
            self._load_strategy_state()
            raise
        record = RoundRecord(
            round_id, "open", base_sha, now, now + self.config.round_timeout, tuple(sampled), population=len(available)
        )
        try:
            self.store.create_round(record, assignments, strategy_state_sha=state_sha)
        except BaseException:
            self._load_strategy_state()
            raise
        log.info("round %d opened: %d of %d available device(s) sampled", round_id, len(sampled), len(available))
        return record

    def _plan_round(self, round_id: int, sampled: list[str], base_sha: str) -> list[Assignment]:
        """Ask the strategy for every sampled device's settings and base; each distinct base is stored once."""
        global_base = decode_tensors(self.store.read_blob(base_sha))
        plans = self.strategy.configure_round(round_id, sampled, global_base)
        stored: dict[int, str] = {id(global_base): base_sha}  # the shared base is already a blob
        assignments = []
        for device in sampled:
            settings, payload = plans[device]
            if id(payload) not in stored:
                check_plan(self.strategy.name, self.specs, device, settings, payload)
                stored[id(payload)] = self.store.put_blob(encode_tensors(payload))
            assignments.append(
                Assignment(round_id, device, stored[id(payload)], json.dumps(settings.to_json(), sort_keys=True))
            )
        return assignments

    def _shares_base(self, round_id: int) -> bool:
        """Whether every device sampled in a round was sent the round's shared base (not its own mix)."""
        record = self.store.round(round_id)
        return record is not None and self.store.assigned_bases(round_id) <= {record.base_sha}

    def _done(self) -> bool:
        return self.stopped is not None or self.store.count_closed() >= self.config.rounds

    def _done_task(self, device: str) -> Task:
        closed = [r for r in self.store.rounds() if r.state == "closed"]
        last = closed[-1].round_id if closed else None
        # with a per-device base (pFedLA) the round's result is no device's model: each keeps what it trained
        shared_result = last is not None and self._shares_base(last)
        return Task(
            action="done",
            base_layout_hash=self.manifest.base_layout_hash,
            round_id=last,
            base_url=f"{API_PREFIX}/rounds/{last}/result" if shared_result else None,
            # how the device takes the final base (recompute_bn, batch_size): its settings of the last round
            settings=self.settings_for(device, last) if shared_result else None,
        )

    # checks

    def _round_or_404(self, round_id: int) -> RoundRecord:
        record = self.store.round(round_id)
        if record is None:
            raise Refused(
                "no_such_round",
                f"round {round_id} does not exist (last is {self.store.last_round_id()})",
                "poll /v1/task for the current round",
            )
        return record

    def settings_for(self, device: str, round_id: int) -> RoundSettings:
        """The settings `device` was given for a round (the strategy's default if it was not sampled)."""
        return self._settings_of(self.store.assignment(round_id, device), round_id)

    def _settings_of(self, assignment: Assignment | None, round_id: int) -> RoundSettings:
        """The settings a sampled device was given for a round (every strategy's, stored with the assignment)."""
        if assignment is None:
            return self.strategy.settings(round_id)
        return RoundSettings.from_json(json.loads(assignment.settings))

    def _check_retained(self, record: RoundRecord) -> None:
        if record.round_id <= self.store.released_through():
            raise Refused(
                "released",
                f"round {record.round_id}'s tensors were released (the server keeps the last "
                f"{self.config.history} rounds' global models)",
                "choose a round listed by GET /v1/history, or restart the server with a larger --history",
            )

    def _check_open_for(self, device: str, round_id: int) -> None:
        record = self._round_or_404(round_id)
        if self.store.assignment(round_id, device) is None:
            raise Refused(
                "not_sampled",
                f"device {device!r} was not sampled in round {round_id}",
                "poll /v1/task and train only when told to",
            )
        if self.clock() >= record.deadline:
            raise Refused(
                "deadline_passed",
                f"round {round_id} stopped taking uploads at its deadline",
                "poll /v1/task for the next round; this update was not stored",
            )
        if record.state != "open" or record.round_id == self._closing:
            state = "closing" if record.state == "open" else record.state
            raise Refused("round_closed", f"round {round_id} is {state}", "poll /v1/task for the current round")

    def _retry_receipt(self, previous: UpdateRecord, sha: str) -> dict[str, Any]:
        if previous.blob_sha != sha:
            raise Refused(
                "duplicate_update",
                f"device {previous.device!r} already uploaded a different update for round {previous.round_id}",
                "upload once per round; a retry must send the same bytes",
            )
        return {
            "accepted": True,
            "round": previous.round_id,
            "sha256": sha,
            "duplicate": True,
            "uploads": len(self.store.updates(previous.round_id)),
            "sampled": len(self._round_or_404(previous.round_id).sampled),
        }
