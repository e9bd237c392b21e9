"""The round engine's core (`EngineCore`): the store, the strategy, the upload path and the clock, and what
devices ask of them. `engine.py`'s `RoundEngine` is this core with the in-process drivers' calls.

The other concerns live in files of their own: `sampling.py` (who a round samples), `uploads.py` (what
an upload must be), `bounds.py` (what one device can move), `round_uploads.py` (a round's uploads read back for
aggregation), `budget.py` (DP-FedAvg, a wrapper around the strategy), `downloads.py` (the bytes a base travels
in), `history.py` (which rounds' models are kept), `enrollment.py` (tokens, the shared secret), `status.py`
(status), `store.py` and `blobs.py` (SQLite and blobs), `engine.py` (the API in-process drivers call),
`http_errors.py` (refusal -> status), `secure/` (secure aggregation's rounds, its mode and its routes).

One engine per state folder and per process. How its rounds run is its round mode's (`modes/`: synchronous with
over-selection, FedBuff; secure aggregation's in `secure/`), the tick and a close's transaction `lifecycle.py`'s (an
object the engine owns); the rest is here: binding the state folder, and what devices ask of it. A mode that takes
device calls of its own reaches the core through the `DeviceCalls` the core hands it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgepfl.errors import BundleError, EdgePFLError, StateError
from edgepfl.manifest import Manifest, layout_hash
from edgepfl.privacy import PrivacyLedger, delta_norm
from edgepfl.protocol import API_PREFIX, EvalMetrics, RoundSettings, Task
from edgepfl.server.bounds import UpdateBounds
from edgepfl.server.budget import PrivacyBudget, PrivateStrategy
from edgepfl.server.config import ServerConfig
from edgepfl.server.downloads import Downloads
from edgepfl.server.enrollment import Enrollment
from edgepfl.server.errors import Refused, not_sampled
from edgepfl.server.history import History
from edgepfl.server.lifecycle import Lifecycle
from edgepfl.server.modes import DeviceCalls, make_mode
from edgepfl.server.records import Assignment, EvalRecord, RoundRecord, UpdateRecord
from edgepfl.server.round_uploads import RoundUploads
from edgepfl.server.status import server_status
from edgepfl.server.store import Store
from edgepfl.server.strategy import Strategy
from edgepfl.server.uploads import Upload, finite_or_none
from edgepfl.wire import check_tensors, encode_tensors, load_tensors

log = logging.getLogger("edgepfl.server")

INITIAL_TENSORS = Path("portable") / "initial.safetensors"


class EngineCore:
    """Owns the rounds of one state folder; the HTTP app calls it, a background thread ticks it (`RoundEngine`,
    engine.py, adds the in-process drivers' calls)."""

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
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.seen: dict[str, float] = {}  # device -> last /v1/task poll (availability is not durable state)
        self.closing: int | None = None  # round being aggregated outside the lock
        self.enrollment = Enrollment(config, store, clock)
        bounds = UpdateBounds(config.clip_multiple, config.weight_multiple)
        self.uploads = RoundUploads(store, self.specs, bounds, self.settings_for)
        self.downloads = Downloads(store.blobs)
        self.dp = config.privacy.dp_config()  # DP-FedAvg settings (None: off)
        self.budget: PrivacyBudget | None = None  # what a DP run has spent (bind_state binds it)
        # the DP noise is drawn from OS entropy: whoever knows the noise can subtract it (simulate seeds it)
        self.noise_seed: int | None = None
        self.stopped: str | None = None  # why the run ended before --rounds (the DP budget), once known
        calls = DeviceCalls(self.lock, self.wake, self.round_or_404, self.check_sampled)
        self.mode = make_mode(self, calls)  # how rounds open, take uploads and close (server/modes/)
        self.lifecycle = Lifecycle(self)  # the tick, closing, abandoning and the rollback, for every mode
        self.retention = History(store, self.mode.retained(config.history))

    def tick(self) -> None:
        """Close the open round if its mode says so, then open the next one if devices wait (lifecycle.py)."""
        self.lifecycle.tick()

    def run(self, stop: threading.Event, interval: float = 0.25) -> None:
        """Tick until `stop` is set; woken early by each accepted upload. Never dies on an error."""
        self.lifecycle.run(stop, interval)

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
            sha = self.store.blobs.put(encode_tensors(self._initial_base()))
            self.store.set_meta({**binding, "initial_base_sha": sha, "global_base_sha": sha})
        self.budget = PrivacyBudget.bind(self.dp, self.store, self.strategy.name, self.config.state)
        if self.budget is not None:  # DP-FedAvg wraps the strategy: it aggregates, the strategy plans
            self.strategy = PrivateStrategy(self.strategy, self.budget, self.round_or_404, lambda: self.noise_seed)
        self.mode.bind()  # e.g. secure aggregation wraps both: it aggregates the unmasked sum
        self.lifecycle.abandon_foreign()
        self.lifecycle.load_strategy_state()
        self.retention.apply()
        removed = self.store.blobs.remove_unreferenced(self.store.referenced_blobs())
        if removed:
            log.info("removed %d unreferenced blob(s) left by an interrupted write", removed)

    @property
    def ledger(self) -> PrivacyLedger | None:
        """The privacy budget spent so far (None without DP)."""
        return self.budget.ledger if self.budget is not None else None

    def close(self) -> None:
        """Close the state folder's database."""
        self.store.close()

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
        with self.lock:
            try:
                self.strategy.check_device(device)
            except EdgePFLError as error:  # e.g. pfedla's N client places all belong to other devices
                raise Refused("cannot_join", error.problem, error.fix) from None
            now = self.clock()
            self.seen[device] = now
            if self.lifecycle.done():
                return self._done_task(device)
            current = self.store.open_round()
            if current is None and self.closing is None:
                current = self.lifecycle.maybe_open(now)
            task = self.mode.task(device, current, now) if current is not None else None
            if task is not None:
                return task
            return Task(
                action="wait", base_layout_hash=self.manifest.base_layout_hash, retry_after=self.config.poll_interval
            )

    def train_task(self, record: RoundRecord, assignment: Assignment, deadline: float | None) -> Task:
        """A train task on `record` for the device `assignment` names (deadline None: no barrier)."""
        return Task(
            action="train",
            base_layout_hash=self.manifest.base_layout_hash,
            round_id=record.round_id,
            settings=self._settings_of(assignment, record.round_id),
            base_url=f"{API_PREFIX}/rounds/{record.round_id}/base",
            deadline=deadline,
        )

    def base_for(self, device: str, round_id: int) -> tuple[bytes, str]:
        """The base tensors a device gets for a round (safetensors bytes) and their sha256."""
        record = self.round_or_404(round_id)
        self.retention.check_retained(record)
        assignment = self.store.assignment(round_id, device)
        if assignment is not None:
            sha = assignment.base_sha
        elif self._shares_base(round_id):
            sha = record.base_sha
        else:
            raise not_sampled(device, round_id, "poll /v1/task and fetch the base it names")
        return self.downloads.base(sha, self._settings_of(assignment, round_id).download_encoding)

    def result_of(self, round_id: int) -> tuple[bytes, str]:
        """The aggregated base (global model) a closed round produced."""
        record = self.round_or_404(round_id)
        self.retention.check_retained(record)
        if record.result_sha is None:
            raise Refused(
                "no_result",
                f"round {round_id} is {record.state} and has no aggregated base",
                "fetch the result of a closed round (see /v1/status)",
            )
        return self.store.blobs.read(record.result_sha), record.result_sha

    def history(self) -> dict[str, Any]:
        """JSON: the closed rounds whose global model can still be fetched, oldest first, and the retention."""
        with self.lock:
            return self.retention.listing()

    def status(self, names: bool = False) -> dict[str, Any]:
        """JSON summary of the server and every round (no tensors; device names only with `names`: the operator)."""
        with self.lock:
            now = self.clock()
            rounds = self.store.rounds()
            available = sum(1 for seen in self.seen.values() if now - seen <= self.config.available_for)
            training = self.store.open_round() is not None
            done = self.lifecycle.done()
            state = "done" if done else "closing" if self.closing else "training" if training else "waiting"
        return server_status(self, rounds, available, state, names)

    def check_upload_allowed(self, device: str, round_id: int) -> None:
        """Refuse an upload before its body is read: unknown round, closed round, not sampled, too late, secure."""
        self.mode.check_upload(device, round_id)
        with self.lock:
            if self._kept_update(round_id, device) is not None:
                return  # a retry: decided by comparing the bytes
            self._check_open_for(device, round_id)

    def accept_update(self, device: str, round_id: int, payload: bytes) -> dict[str, Any]:
        """Check an upload against the manifest and the round, and store it durably; returns the receipt."""
        self.check_upload_allowed(device, round_id)
        upload = Upload.parse(payload, self.manifest, self.config.max_samples, self._shared_names)
        settings = self.settings_for(device, round_id)
        base = self.uploads.base_of(round_id, device)
        tensors = upload.stands_for(settings, base, settings.travelling(self.specs))
        previous = self._kept_update(round_id, device)
        if previous is not None:
            return self._retry_receipt(previous, upload.sha256)
        norm = delta_norm(tensors, base)
        self.store.blobs.put(payload, upload.sha256)  # on disk (fsynced) before the row that names it is committed
        with self.lock:
            previous = self._kept_update(round_id, device)
            if previous is not None:
                return self._retry_receipt(previous, upload.sha256)
            self._check_open_for(device, round_id)
            self.store.blobs.put(payload, upload.sha256)  # again: a release of history may have deleted equal bytes
            meta = upload.meta
            self.store.add_update(
                UpdateRecord(
                    round_id,
                    device,
                    upload.sha256,
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
            receipt = self._receipt(round_id, upload.sha256, duplicate=False)
        self.wake.set()
        return receipt

    def accept_refusal(self, device: str, round_id: int, reason: str) -> dict[str, Any]:
        """A device refused the base of a round it was given (NaN or Inf in it, or training diverged from it).

        When a majority of the round's devices (and at least min_clients of them, or all when fewer) refused it,
        the base is rejected and the global base rolls back (lifecycle.py `_reject_base`); the initial base is
        never rolled back (there is nothing before it).
        """
        with self.lock:
            record = self.round_or_404(round_id)
            self.check_sampled(device, round_id, "report refusals of your rounds")
            new = self.store.add_refusal(round_id, device, reason[:200], self.clock())
            refused = len(self.store.refusals(round_id))
            given = len(self.store.assigned_devices(round_id))
            needed = max(min(self.config.min_clients, given), math.ceil(given / 2))
            # the initial base has nothing before it to roll back to: its round goes on with those who train
            rollback = record.base_sha != self.store.get_meta("initial_base_sha")
            rolled_back = rollback and record.state == "open" and refused >= needed and record.round_id != self.closing
            if rolled_back:
                self.lifecycle.reject_base(record, refused)
        log.warning("round %d: device %s refused its base (%s)", round_id, device, reason[:200])
        return {"accepted": True, "round": round_id, "duplicate": not new, "rolled_back": rolled_back}

    def accept_metrics(self, device: str, round_id: int, metrics: EvalMetrics) -> dict[str, Any]:
        """Store a device's evaluation of its personalized model after a round."""
        try:
            metrics.check(self.config.max_samples)
        except EdgePFLError as error:
            raise Refused("bad_metrics", error.problem, error.fix) from None
        with self.lock:
            self.round_or_404(round_id)
            self.check_sampled(device, round_id, "report metrics for a round you trained in")
            previous = self.store.eval_metrics(round_id, device)
            if previous:
                stored = (previous[0].accuracy, previous[0].loss, previous[0].num_samples)
                if stored != (metrics.accuracy, metrics.loss, metrics.num_samples):
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

    def _shares_base(self, round_id: int) -> bool:
        """Whether every device sampled in a round was sent the round's shared base (not its own mix)."""
        record = self.store.round(round_id)
        return record is not None and self.store.assigned_bases(round_id) <= {record.base_sha}

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

    def round_or_404(self, round_id: int) -> RoundRecord:
        """A round's record; Refused (404) for a round that does not exist."""
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

    def check_sampled(self, device: str, round_id: int, fix: str) -> None:
        """Refused (403 `not_sampled`, with `fix`) unless `device` was given round `round_id`."""
        if self.store.assignment(round_id, device) is None:
            raise not_sampled(device, round_id, fix)

    def _check_open_for(self, device: str, round_id: int) -> None:
        record = self.round_or_404(round_id)
        self.check_sampled(device, round_id, "poll /v1/task and train only when told to")
        self.mode.check_open(record)

    def _kept_update(self, round_id: int, device: str) -> UpdateRecord | None:
        """The device's upload in the round, unless a rollback dropped it (then the round is closed to it: a retry
        of a dropped upload is refused, never told it was taken)."""
        previous = self.store.update(round_id, device)
        return previous if previous is not None and previous.status != "dropped" else None

    def _retry_receipt(self, previous: UpdateRecord, sha: str) -> dict[str, Any]:
        if previous.blob_sha != sha:
            raise Refused(
                "duplicate_update",
                f"device {previous.device!r} already uploaded a different update for round {previous.round_id}",
                "upload once per round; a retry must send the same bytes",
            )
        return self._receipt(previous.round_id, sha, duplicate=True)

    def _receipt(self, round_id: int, sha: str, duplicate: bool) -> dict[str, Any]:
        receipt = {"accepted": True, "round": round_id, "sha256": sha, "duplicate": duplicate}
        return {**receipt, **self.mode.receipt(round_id)}
