"""The strategy registry: the CLI name of each strategy is its module's name (dashes for underscores)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgepfl.errors import UsageError
from edgepfl.manifest import TensorSpec
from edgepfl.server.strategies.fedavg import FedAvg
from edgepfl.server.strategies.fedper import FedPer
from edgepfl.server.strategies.heurpfedla import HeurPFedLA
from edgepfl.server.strategies.median import Median
from edgepfl.server.strategies.pfedla import PFedLA
from edgepfl.server.strategies.trimmed_mean import TrimmedMean
from edgepfl.server.strategy import Strategy

if TYPE_CHECKING:
    from edgepfl.server.config import StrategyOptions

STRATEGIES: dict[str, type[Strategy]] = {
    FedAvg.name: FedAvg,
    FedPer.name: FedPer,
    HeurPFedLA.name: HeurPFedLA,
    Median.name: Median,
    PFedLA.name: PFedLA,
    TrimmedMean.name: TrimmedMean,
}


def make_strategy(name: str, specs: list[TensorSpec], options: StrategyOptions) -> Strategy:
    """Build a strategy by its CLI name."""
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}", f"use one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name](specs, options)
