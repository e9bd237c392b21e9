"""What a round's stored uploads stand for: the base each device was sent, its tensors or decoded delta, bounded.

The round engine accepts an upload (checks, stores, remembers its delta norm) and, at the round's close,
hands the strategy the updates read back from here: bounded base tensors, or (a strategy that reads deltas,
DP-FedAvg) the decoded deltas as they were accepted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from edgepfl.manifest import TensorSpec
from edgepfl.privacy import delta_norm
from edgepfl.protocol import RoundSettings
from edgepfl.server.bounds import UpdateBounds, bounded
from edgepfl.server.errors import BlobError
from edgepfl.server.fleet import FleetOptions, rebased
from edgepfl.server.records import RoundRecord, UpdateRecord
from edgepfl.server.store import Store
from edgepfl.server.strategy import AcceptedUpdate, Strategy
from edgepfl.server.uploads import add_delta, read_upload_delta
from edgepfl.wire import decode, decode_tensors

log = logging.getLogger("edgepfl.server")

MAX_CACHED_BASES = 64  # per-device bases (pFedLA) beyond this are read again when needed


class RoundUploads:
    """Reads a round's accepted uploads back for aggregation; caches the decoded bases of the open round."""

    def __init__(
        self,
        store: Store,
        specs: Sequence[TensorSpec],
        bounds: UpdateBounds,
        settings_for: Callable[[str, int], RoundSettings],
    ):
        self.store = store
        self.specs = specs
        self.bounds = bounds
        self.settings_for = settings_for  # (device, round id) -> the settings it was given
        self._norms: dict[tuple[int, str], float] = {}  # (round, device) -> |upload - its base|, from acceptance
        self._bases: dict[str, Mapping[str, np.ndarray]] = {}  # decoded base blobs of the open round, by sha256

    def base_of(self, round_id: int, device: str) -> Mapping[str, np.ndarray]:
        """The base tensors a sampled device was sent in a round (decoded once per blob while its round is open)."""
        assignment = self.store.assignment(round_id, device)
        assert assignment is not None, "uploads are accepted from sampled devices only"
        base = self._bases.get(assignment.base_sha)
        if base is None:
            if len(self._bases) > MAX_CACHED_BASES:
                self._bases.clear()
            base = self._bases[assignment.base_sha] = decode_tensors(self.store.blobs.read(assignment.base_sha))
        return base

    def remember_norm(self, round_id: int, device: str, norm: float) -> None:
        """The delta norm of an upload as it was accepted (measured again after a restart)."""
        self._norms[(round_id, device)] = norm

    def forget(self, round_id: int) -> None:
        """Drop what is remembered of a round whose uploads were withdrawn."""
        self._norms = {key: norm for key, norm in self._norms.items() if key[0] != round_id}

    def closed(self, round_id: int, applied: Sequence[tuple[int, str]] | None = None) -> None:
        """A round closed: the norms of its uploads (fedbuff: of the (round, device) uploads its step `applied`)
        and every cached base are no longer needed."""
        if applied is None:
            self._norms = {key: norm for key, norm in self._norms.items() if key[0] > round_id}
        else:
            for key in applied:
                self._norms.pop(key, None)
        self._bases.clear()

    def for_strategy(self, record: RoundRecord, strategy: Strategy) -> Iterator[AcceptedUpdate]:
        """The round's accepted updates as `strategy` reads them: bounded base tensors, or unbounded deltas."""
        if strategy.reads_deltas:
            return self._deltas(record)
        if not strategy.bounded:
            stored = self.store.updates(record.round_id)
            return self._accepted_updates(record.round_id, stored, streaming=strategy.streaming)
        return self.bounded_updates(record, strategy.streaming)

    def bounded_updates(self, record: RoundRecord, streaming: bool) -> Iterator[AcceptedUpdate]:
        """The round's accepted updates with what one device can move bounded (see bounds.py).

        `streaming`: the strategy reads one update at a time (each is read whole); otherwise it holds every
        device's copy of one tensor at a time, and the uploads are read lazily, one tensor at a time.
        """
        stored = self.store.updates(record.round_id)
        return self._bounded(record.round_id, stored, lambda update: update.device, streaming)

    def step(
        self, buffered: list[UpdateRecord], version: int, global_base: Mapping[str, np.ndarray], options: FleetOptions
    ) -> Iterator[AcceptedUpdate]:
        """Fedbuff's step over the buffered uploads (of several base versions; a device may have two): each bounded
        against the base it trained on, then rebased on the current base with its staleness weight (fleet.py)."""
        updates = self._bounded(version, buffered, fleet_key, streaming=True)
        sent = {fleet_key(update): self.base_of(update.round_id, update.device) for update in buffered}
        staleness = {fleet_key(update): version - update.round_id for update in buffered}
        return rebased(updates, sent, staleness, global_base, options)

    def _bounded(
        self, round_id: int, stored: list[UpdateRecord], key: Callable[[UpdateRecord], str], streaming: bool
    ) -> Iterator[AcceptedUpdate]:
        """`stored` read back and bounded (`key` names each update: its device, or device@round under fedbuff)."""
        bases = {key(u): self.base_of(u.round_id, u.device) for u in stored}
        norms = {}
        for update in stored:  # norms are measured at acceptance; after a restart they are measured again here
            norm = self._norms.get((update.round_id, update.device))
            if norm is None:
                try:
                    norm = delta_norm(self._upload_of(update.round_id, update), bases[key(update)])
                except BlobError:
                    continue  # excluded as corrupt by _accepted_updates
            norms[key(update)] = norm
        counts = {key(u): u.num_samples for u in stored if key(u) in norms}
        accepted = self._accepted_updates(round_id, stored, key, streaming)
        yield from bounded(accepted, bases, norms, counts, self.bounds)

    def _deltas(self, record: RoundRecord) -> Iterator[AcceptedUpdate]:
        """The decoded deltas of the round's accepted uploads, one at a time (a corrupt blob is excluded)."""
        for update in self.store.updates(record.round_id):
            try:
                delta = self._delta_of(record.round_id, update)
            except BlobError as error:
                self._exclude(record.round_id, update, error)
                continue
            yield AcceptedUpdate(update.device, update.num_samples, {}, update.train_loss, update.val_accuracy, delta)

    def _accepted_updates(
        self,
        round_id: int,
        stored: list[UpdateRecord],
        key: Callable[[UpdateRecord], str] = lambda update: update.device,
        streaming: bool = True,
    ) -> Iterator[AcceptedUpdate]:
        for update in stored:
            try:
                tensors = self._upload_of(update.round_id, update, lazy=not streaming)
            except BlobError as error:
                self._exclude(round_id, update, error)
                continue
            yield AcceptedUpdate(key(update), update.num_samples, tensors, update.train_loss, update.val_accuracy)

    def _upload_of(self, round_id: int, update: UpdateRecord, lazy: bool = False) -> Mapping[str, np.ndarray]:
        """The base tensors an accepted upload stands for: as stored, or (a delta upload) the base it was sent + delta.

        `lazy`: read one tensor at a time from disk; a delta upload is decoded whole, as it was at acceptance.
        """
        settings = self.settings_for(update.device, round_id)
        if not settings.uploads_delta and lazy:
            return self.store.blobs.tensors(update.blob_sha)
        if not settings.uploads_delta:
            return decode_tensors(self.store.blobs.read(update.blob_sha))
        travelling = settings.travelling(self.specs)
        return add_delta(self.base_of(round_id, update.device), self._delta_of(round_id, update), travelling)

    def _delta_of(self, round_id: int, update: UpdateRecord) -> dict[str, np.ndarray]:
        """The decoded delta of an accepted delta upload (checked again: the blob is the bytes that were accepted)."""
        settings = self.settings_for(update.device, round_id)
        tensors, metadata = decode(self.store.blobs.read(update.blob_sha))
        return read_upload_delta(tensors, metadata, settings, settings.travelling(self.specs))

    def _exclude(self, round_id: int, update: UpdateRecord, error: BlobError) -> None:
        log.error("round %d: upload of %s is excluded: %s", round_id, update.device, error)
        self.store.mark_corrupt(update.round_id, update.device)


def fleet_key(update: UpdateRecord) -> str:
    """A buffered upload's name in a fedbuff step: its device and the round (base version) it trained on."""
    return f"{update.device}@{update.round_id}"
