"""One device round, the one every driver runs: the CLI device (`runner.py`), the simulator's clients
(`edgepfl/simulate/workers.py`) and Flower's ClientApp (`edgepfl/flower/client_app.py`).

check the received base -> receive it (BatchNorm statistics re-estimated) -> PersFL's teacher offer -> train
(`algorithms.run_client_round`) -> refuse a diverged result (the last good model back in place) -> encode the
upload -> commit. Where the round is committed is the driver's (`RoundStore`): a device's state folder, written
atomically with the upload's bytes, or a simulated client's memory. The browser device mirrors this round in
`web/src/runner.js`, checked against the same fixtures.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgepfl.data import LocalData, num_batches
from edgepfl.device_runtime.algorithms import (
    ClientResult,
    TrainingDiverged,
    divergence,
    round_losses,
    round_phases,
    run_client_round,
    upload_specs,
    upload_tensors,
)
from edgepfl.device_runtime.engine import Engine
from edgepfl.device_runtime.options import DeviceOptions
from edgepfl.device_runtime.persfl import TeacherStore, consider_global_model
from edgepfl.device_runtime.statistics import receive
from edgepfl.encoding import Encoding, drop_residual, encode_round_upload
from edgepfl.errors import BundleError, WireError
from edgepfl.manifest import Manifest
from edgepfl.protocol import RoundSettings, UploadMeta
from edgepfl.wire import check_tensors, encode_tensors, nonfinite_names


class RoundStore(Protocol):
    """Where a device's rounds are committed (its state folder, `state.StateFolder`, is one)."""

    folder: Path  # PersFL's teacher lives in FOLDER/persfl

    @property
    def residuals(self) -> Path:
        """The folder of the encoded uploads' error-feedback residuals."""

    @property
    def kept(self) -> str:
        """In words, the model a refused round leaves in place (e.g. "the model of round 3")."""

    def commit(
        self,
        tensors: dict[str, Any],
        record: dict[str, Any],
        round_id: int | None = None,
        upload_payload: bytes | None = None,
    ) -> None:
        """Save a trained round: its tensors, its record and its upload's bytes, all or nothing."""


class RoundEvents(Protocol):
    """What a round reports (runner.DeviceEvents implements it)."""

    def message(self, text: str) -> None:
        """A one-line status message."""

    def round_started(self, round_id: int, settings: RoundSettings, total_steps: int) -> None:
        """Training of a round begins."""

    def step(self, phase: str, done: int, total: int, loss: float) -> None:
        """One training step finished."""


@dataclass(frozen=True)
class RoundOutcome:
    """A committed round: its result, the upload's bytes (None: the algorithm uploads nothing), its record."""

    result: ClientResult
    payload: bytes | None
    record: dict[str, Any]
    teacher_loss: float | None = None  # PersFL: the received global model's held-out loss (its teacher offer)


def train_round(
    engine: Engine,
    data: LocalData,
    store: RoundStore,
    round_id: int,
    settings: RoundSettings,
    base: dict[str, Any],
    options: DeviceOptions,
    events: RoundEvents,
) -> RoundOutcome:
    """Train one round from a received base and commit it, its upload body saved with it (however it travels).

    A base holding NaN/Inf, or a result whose loss or tensors blow up, raises TrainingDiverged with the engine
    back at the last good model and nothing saved or sent.
    """
    manifest = engine.manifest
    try:
        _check_base(base, manifest, settings, f"the base of round {round_id}")
    except TrainingDiverged as error:
        raise skipped(error.problem, store) from None
    kept = engine.get_tensors()  # the last good model, back in place if this round's result is refused
    # a tensor kept on the device (HeurpFedLA) keeps the value this device trained; BatchNorm statistics are
    # re-estimated under the new base (statistics.py)
    receive(engine, base, data, settings)
    teacher_loss = offer_teacher(engine, data, store, round_id, events) if options.persfl_teacher else None
    steps = sum(p.epochs for p in round_phases(settings, engine.available_sets()))
    events.round_started(round_id, settings, steps * num_batches(data.num_train, settings.batch_size))
    result = run_client_round(engine, settings, data, options.seed, round_id, progress=events.step)
    tensors = engine.get_tensors()
    why = divergence(round_losses(result), tensors, manifest.num_classes)
    if why is not None:
        engine.set_tensors(kept)
        raise skipped(f"training diverged in round {round_id} ({why})", store, teacher_loss)
    payload = None
    if result.uploads:
        meta = result.upload_meta(manifest.base_layout_hash)
        payload = upload_body(
            upload_tensors(engine, settings), base, settings, meta, store.residuals, round_id, options.seed
        )
    record = {**result.to_json(), "round": round_id, "engine": engine.name, "upload": "pending" if payload else "none"}
    try:
        store.commit(tensors, record, round_id=round_id, upload_payload=payload)
    except BaseException:
        drop_residual(store.residuals, round_id)  # this round was not saved: its residual must feed no later round
        raise
    return RoundOutcome(result, payload, record, teacher_loss)


class RoundRefused(TrainingDiverged):
    """A round the device refused (its base, or the result of training on it); `teacher_loss`: PersFL's score of
    the received global model, when it was offered before training diverged."""

    def __init__(self, problem: str, fix: str, teacher_loss: float | None = None):
        super().__init__(problem, fix)
        self.teacher_loss = teacher_loss


def skipped(problem: str, store: RoundStore, teacher_loss: float | None = None) -> RoundRefused:
    """The one line for a round whose base or result the device refuses: what happened, what it kept, the fix."""
    return RoundRefused(
        f"{problem}: kept {store.kept} and skipped the round",
        "ask the operator to check the server's model and --lr; the device joins the next round",
        teacher_loss,
    )


def offer_teacher(engine: Engine, data: LocalData, store: RoundStore, round_id: int, events: RoundEvents) -> float:
    """PersFL stage 1: score the global model just received; keep it as the teacher if its held-out loss is lowest."""
    teachers = TeacherStore(store.folder, engine.manifest)
    kept, result = consider_global_model(engine, teachers, round_id, engine.get_tensors(), data)
    if kept:
        events.message(f"PersFL teacher: the global model of round {round_id} (held-out loss {result.loss:.4f})")
    return result.loss


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


def encode_update(base_tensors: Mapping[str, np.ndarray], meta: UploadMeta) -> bytes:
    """The body of an fp32 update upload: the base tensors with `UploadMeta` in the safetensors metadata."""
    return encode_tensors(base_tensors, meta.to_metadata())


def upload_body(
    trained: Mapping[str, np.ndarray],
    received: Mapping[str, np.ndarray],
    settings: RoundSettings,
    meta: UploadMeta,
    residuals: str | os.PathLike,
    round_id: int,
    seed: int,
) -> bytes:
    """A round's upload as its settings ask: the trained base (fp32), or the delta trained - received, clipped to
    the round's clip norm (DP) and encoded with error feedback from the residuals kept in the folder `residuals`."""
    if not settings.uploads_delta:
        return encode_update(trained, meta)
    delta = {name: np.asarray(trained[name], np.float64) - np.asarray(received[name], np.float64) for name in trained}
    encoding = Encoding.parse(settings.upload_encoding)
    return encode_round_upload(residuals, round_id, delta, encoding, seed, settings.clip_norm).to_bytes(
        meta.to_metadata()
    )
