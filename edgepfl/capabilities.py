"""What each aggregation strategy needs of a round, and the one-line refusals that follow from it.

A strategy (server/strategies/) is described by what its aggregate needs: every device's update of a round at
once (median, trimmed mean), one base per device planned at the round's start (pfedla), the updates in plaintext
(both of those), a fixed cohort of client places (pfedla's N), the same tensors travelling every round. DP-FedAvg,
secure aggregation and FedBuff's steps each need an aggregate that is one (weighted) sum of deltas; what refuses a
strategy with them is derived here from its needs, never from a list of names. The strategy classes read their
`needs` from `NEEDS` by name (server/strategy.py), so the core checks that run before any strategy is made
(`edgepfl.privacy`, `edgepfl.secagg.options`) and the strategy itself say the same.

A strategy whose aggregate is a sum of the devices' deltas (fedavg, fedper) needs nothing; a strategy missing from
`NEEDS` is refused with all three, since nothing says its aggregate is such a sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StrategyNeeds:
    """What a strategy's aggregate needs of a round (all False: it is one weighted sum of the devices' deltas)."""

    every_update: bool = False  # every device's update of a round at once (an order statistic, not a sum)
    device_plan: bool = False  # one base per device, planned when the round opens from what the others sent
    fixed_cohort: bool = False  # a fixed number of client places (an option the run fills with its client count)
    varying_tensors: bool = False  # which tensors travel changes from round to round and device to device
    unknown: bool = False  # nothing is said: treated as not a sum
    aggregate: str = ""  # how a refusal names what it computes ("the median"; default: the strategy's name)

    @property
    def plaintext(self) -> bool:
        """Whether each device's update must reach the server in the clear (not only the round's sum)."""
        return self.every_update or self.device_plan or self.unknown

    @property
    def sum_of_deltas(self) -> bool:
        """Whether the aggregate is one weighted sum of the devices' deltas (DP, SecAgg and FedBuff need this)."""
        return not self.plaintext

    def what(self, name: str) -> str:
        """How refusals name this strategy's aggregate."""
        return self.aggregate or name

    def dp_refusal(self, name: str) -> str | None:
        """Why DP-FedAvg's noise does not cover this strategy (None: it does)."""
        if self.every_update:
            return (
                f"{self.what(name)} is not a sum of clipped deltas, so Gaussian noise of sigma*C gives no stated "
                "epsilon"
            )
        if self.device_plan:
            return (
                f"{self.what(name)} mixes a different, un-noised combination of the others' updates into each "
                "device's base"
            )
        if self.unknown:
            return f"{name} is not one noised average of clipped deltas"
        return None

    def secure_refusal(self, name: str) -> str | None:
        """Why secure aggregation (the server learns only the sum) cannot run this strategy (None: it can)."""
        if self.every_update:
            return f"{self.what(name)} needs every device's update, and the server learns only their sum"
        if self.device_plan:
            return (
                f"{self.what(name)} mixes each device's update into the others' bases with its own weights, and "
                "the server learns only the sum"
            )
        if self.unknown:
            return f"{name} is not a sum of the devices' deltas"
        return None


SUM_OF_DELTAS = StrategyNeeds()
NEEDS: dict[str, StrategyNeeds] = {
    "fedavg": SUM_OF_DELTAS,
    "fedper": SUM_OF_DELTAS,
    "median": StrategyNeeds(every_update=True, aggregate="the median"),
    "trimmed-mean": StrategyNeeds(every_update=True, aggregate="the trimmed mean"),
    "pfedla": StrategyNeeds(device_plan=True, fixed_cohort=True),
    "heurpfedla": StrategyNeeds(device_plan=True, fixed_cohort=True, varying_tensors=True),
}
UNKNOWN = StrategyNeeds(unknown=True)


def needs_of(strategy: str) -> StrategyNeeds:
    """What strategy `strategy` needs (UNKNOWN for a name `NEEDS` does not hold)."""
    return NEEDS.get(strategy, UNKNOWN)


def strategies_where(test: Callable[[StrategyNeeds], bool]) -> list[str]:
    """The strategies whose needs pass `test`, in `NEEDS` order (for a refusal's fix: "use fedavg or fedper")."""
    return [name for name, needs in NEEDS.items() if test(needs)]


def either(names: list[str]) -> str:
    """`a or b` (a fix's choice of strategies)."""
    return " or ".join(names)
