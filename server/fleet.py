"""Rounds for fleets that come and go: over-selection with a quorum, and asynchronous buffered aggregation.

- Over-selection (Bonawitz et al. 2019, "Towards Federated Learning at Scale"): a synchronous round samples
  ceil(target x (1 + F)) devices, where the target is the round's usual sample size, and closes as soon as the
  target's uploads are accepted; a later upload is refused `round_closed` and its device moves on.
- FedBuff (Nguyen et al., AISTATS 2022): no round barrier. A device takes the current base whenever it is free,
  trains and uploads; every `buffer_size` accepted uploads make one server step, each upload weighted by its
  staleness s (the steps made since the base it trained on): x <- x + eta_g * sum_k n_k w(s_k) delta_k /
  sum_k n_k, with w(s) = (1 + s)^-a (`poly:a`) or 1 (`const`). With w = 1, eta_g = 1 and every device in one
  step this is FedAvg's sample-weighted mean. An upload trained on a base more than `max_staleness` steps old
  is refused `too_stale`. Under fedbuff a "round" is one server step: the base version devices quote.

Staleness weighting wraps the upload path, not the strategy: each buffered upload is re-expressed as the
current base plus its weighted delta (`rebased`), and the strategy (fedavg or fedper) averages those as it
averages any round's uploads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, Field, field_validator

from edgepfl.capabilities import either, needs_of, strategies_where
from edgepfl.errors import UsageError
from edgepfl.options import titled
from edgepfl.server.sampling import sample_size
from edgepfl.server.strategy import AcceptedUpdate

AGGREGATIONS = ("sync", "fedbuff")


class FleetOptions(BaseModel):
    """How rounds treat a fleet: over-selection, or FedBuff's asynchronous steps."""

    model_config = titled("Fleet rounds")

    over_select: Annotated[
        float,
        Field(
            ge=0.0,
            le=10.0,
            allow_inf_nan=False,
            description="sync: sample ceil(target x (1 + F)) devices and close the round at the target's uploads",
        ),
    ] = 0.0
    aggregation: Annotated[
        Literal[AGGREGATIONS],  # type: ignore[valid-type]
        Field(description="sync rounds, or FedBuff's asynchronous buffered steps"),
    ] = "sync"
    buffer_size: Annotated[int, Field(ge=1, description="fedbuff: accepted uploads per server step (K)")] = 10
    max_staleness: Annotated[
        int, Field(ge=0, description="fedbuff: refuse (too_stale) an upload trained on a base this many steps old")
    ] = 10
    staleness_weight: Annotated[
        str, Field(description="fedbuff: const, or poly:A for the weight (1 + s)^-A of an upload s steps stale")
    ] = "poly:0.5"
    server_lr: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="fedbuff: the server's step size (eta_g)")
    ] = 1.0

    @field_validator("staleness_weight")
    @classmethod
    def _weight(cls, value: str) -> str:
        staleness_exponent(value)
        return value

    @property
    def asynchronous(self) -> bool:
        """Whether rounds are FedBuff's steps."""
        return self.aggregation == "fedbuff"

    def check_strategy(self, strategy: str) -> None:
        """Refuse, in one line, a strategy that cannot take steps of a few uploads."""
        # a step of a few uploads is well defined for a running weighted sum only (edgepfl.capabilities)
        if self.asynchronous and not needs_of(strategy).sum_of_deltas:
            raise UsageError(
                f"--aggregation fedbuff cannot run --strategy {strategy}: it needs every device's update of a round "
                "at once (median, trimmed mean) or one base per device planned at the round's start (pfedla)",
                f"use --strategy {either(strategies_where(lambda needs: needs.sum_of_deltas))} with fedbuff, or "
                "--aggregation sync",
            )


def fleet_warnings(
    options: FleetOptions, fraction: float, min_clients: int, round_timeout: float, enrolled: int
) -> list[str]:
    """Fleet settings that cannot do what they are for, one line each with the fix (serve prints them at start,
    the status page shows them): over-selection whose target is already the whole fleet, and a FedBuff buffer
    that more uploads than the fleet has devices fill. `enrolled` is the fleet so far (0: only what holds for
    any fleet is said)."""
    problems = []
    timeout = f"its whole --round-timeout ({round_timeout:g} s)"
    if options.over_select > 0 and not options.asynchronous:
        why = None
        if fraction >= 1.0:
            why = "with --fraction 1 a round's target is every available device"
        elif enrolled and sample_size(enrolled, fraction, min_clients) >= enrolled:
            why = (
                f"a round's target is all {enrolled} enrolled devices (--fraction {fraction:g}, --min-clients "
                f"{min_clients})"
            )
        if why is not None:
            problems.append(
                f"--over-select {options.over_select:g} samples no extra device: {why}, so a device that vanishes "
                f"holds the round for {timeout}; fix: lower --fraction (e.g. --fraction 0.6) or --min-clients so "
                "the target is below the fleet"
            )
    if options.asynchronous and enrolled and options.buffer_size > enrolled:
        problems.append(
            f"--buffer-size {options.buffer_size} is more than the {enrolled} enrolled devices, and a device uploads "
            f"once per base version, so every FedBuff step waits for {timeout}; fix: --buffer-size {enrolled} or less"
        )
    return problems


def staleness_exponent(weight: str) -> float:
    """A in (1 + s)^-A for `poly:A`, 0 for `const`; ValueError naming the accepted forms otherwise."""
    if weight == "const":
        return 0.0
    kind, _, exponent = weight.partition(":")
    try:
        value = float(exponent)
    except ValueError:
        value = math.nan
    if kind != "poly" or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{weight!r} is not const or poly:A with A >= 0 (e.g. poly:0.5)")
    return value


def rebased(
    updates: Iterable[AcceptedUpdate],
    sent: Mapping[str, Mapping[str, np.ndarray]],
    staleness: Mapping[str, int],
    global_base: Mapping[str, np.ndarray],
    options: FleetOptions,
) -> Iterator[AcceptedUpdate]:
    """Each buffered update as the current base plus its weighted delta: base + eta_g w(s) (upload - its base).

    `sent` and `staleness` are by update key (`AcceptedUpdate.device`): the base it trained on, its staleness.
    The strategy's sample-weighted mean of these is FedBuff's step (float64, as the strategies sum).
    """
    exponent = staleness_exponent(options.staleness_weight)
    for update in updates:
        scale = options.server_lr * (1.0 + staleness[update.device]) ** -exponent
        base = sent[update.device]
        tensors = {}
        for name, value in update.base_tensors.items():
            current = np.asarray(global_base[name], dtype=np.float64)
            delta = np.asarray(value, dtype=np.float64) - np.asarray(base[name], dtype=np.float64)
            tensors[name] = current + scale * delta
        yield AcceptedUpdate(update.device, update.num_samples, tensors, update.train_loss, update.val_accuracy)
