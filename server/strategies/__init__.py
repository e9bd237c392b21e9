"""The strategy registry: a strategy's CLI name is its module's name (dashes for underscores), its options its own.

`StrategyChoice` is the one options field a configuration holds for its strategy: a discriminated union of
every strategy's `Options` model, tagged by the strategy's name (`--strategy`), so each flag of a strategy's
own applies to that strategy only.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, create_model

from edgepfl.errors import UsageError
from edgepfl.manifest import TensorSpec
from edgepfl.options import FLAG
from edgepfl.protocol import RoundSettings
from edgepfl.server.strategies.fedavg import FedAvg
from edgepfl.server.strategies.fedper import FedPer
from edgepfl.server.strategies.heurpfedla import HeurPFedLA
from edgepfl.server.strategies.median import Median
from edgepfl.server.strategies.pfedla import PFedLA
from edgepfl.server.strategies.trimmed_mean import TrimmedMean
from edgepfl.server.strategy import Strategy

STRATEGIES: dict[str, type[Strategy]] = {
    strategy.name: strategy for strategy in (FedAvg, FedPer, HeurPFedLA, Median, PFedLA, TrimmedMean)
}


@functools.cache
def options_model(name: str) -> type[BaseModel]:
    """A strategy's options model with its name as tag (`name`), one member of StrategyChoice."""
    strategy = STRATEGIES[name]
    title = f"{strategy.__name__}Choice"
    model = create_model(title, __base__=strategy.Options, name=(Literal[name], name))  # type: ignore[call-overload]
    model.__doc__ = f"strategy {name}: {(strategy.Options.__doc__ or '').strip().splitlines()[0]}"
    return model


StrategyChoice = Annotated[
    Union[tuple(options_model(name) for name in STRATEGIES)],  # type: ignore[valid-type]  # noqa: UP007
    Field(
        discriminator="name",
        description="how accepted uploads become the next global base",
        json_schema_extra={FLAG: "--strategy"},
    ),
]


def strategy_options(name: str, **knobs: Any) -> BaseModel:
    """The options of strategy `name`: of `knobs`, those it has (a caller may hold knobs of several strategies)."""
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}", f"use one of: {', '.join(STRATEGIES)}")
    model = options_model(name)
    return model(name=name, **{key: value for key, value in knobs.items() if key in model.model_fields})


def cohort_of(name: str, clients: int) -> dict[str, int]:
    """The option a strategy with a fixed cohort of client places takes a run's `clients` as (pfedla's N), or {}."""
    option = STRATEGIES[name].cohort_option if name in STRATEGIES else None
    return {option: clients} if option is not None else {}


def make_strategy(
    options: BaseModel | str, specs: list[TensorSpec], settings: RoundSettings | None = None, seed: int = 0
) -> Strategy:
    """The strategy `options` choose (a StrategyChoice member, or a name: its default options), for these shared
    tensors and round settings (default: RoundSettings())."""
    chosen = strategy_options(options) if isinstance(options, str) else options
    return STRATEGIES[chosen.name](specs, chosen, settings or RoundSettings(), seed)  # type: ignore[attr-defined]
