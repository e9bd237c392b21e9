"""What the server's store keeps of devices, rounds, uploads and evaluations, as the rest of the server reads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundRecord:
    """One round as stored: open, closed (aggregated) or abandoned (too few uploads by the deadline)."""

    round_id: int
    state: str
    base_sha: str
    opened: float
    deadline: float
    sampled: tuple[str, ...]
    closed: float | None = None
    result_sha: str | None = None
    aggregate_seconds: float | None = None
    note: str | None = None
    population: int | None = None  # devices available (and admissible) when it opened: the sampler's N
    epsilon: float | None = None  # DP: epsilon spent through this round (closed rounds of a DP run)
    target: int | None = None  # uploads that close it (over-selection samples more); None: every sampled device

    @property
    def needed(self) -> int:
        """The accepted uploads that close the round."""
        return self.target if self.target is not None else len(self.sampled)


@dataclass(frozen=True)
class Assignment:
    """What one sampled device was given in a round: its base blob and its settings (JSON)."""

    round_id: int
    device: str
    base_sha: str
    settings: str


@dataclass(frozen=True)
class UpdateRecord:
    """Metadata of one accepted upload; the tensors are in the blob `blob_sha`."""

    round_id: int
    device: str
    blob_sha: str
    nbytes: int
    num_samples: int
    train_loss: float | None
    val_accuracy: float | None
    val_loss: float | None
    received: float
    status: str = "accepted"  # accepted | corrupt (its blob failed the sha256 check when read) | dropped
    start_val_accuracy: float | None = None  # the held model of the round before, scored as the round began
    applied_in: int | None = None  # fedbuff: the step (round) whose close applied it; None: still buffered
    staleness: int | None = None  # fedbuff: the steps made between its base and the step that applied it


@dataclass(frozen=True)
class EvalRecord:
    """One device's evaluation of its personalized model after a round."""

    round_id: int
    device: str
    accuracy: float
    loss: float | None
    num_samples: int
    received: float


@dataclass(frozen=True)
class DeviceRecord:
    """An enrolled device (only a hash of its token is kept)."""

    name: str
    created: float
