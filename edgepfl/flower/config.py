"""What a Flower run is told: the run config (pyproject's `[tool.flwr.app.config]`, `--run-config`) and each
SuperNode's `--node-config`, as typed models made once at the app's edge.

Flower hands one run config to the ServerApp and to every ClientApp, so its keys are the union of the
server's (`ServerRunConfig`), the node's (`NodeRunConfig`) and, for nodes that train a part of a dataset as
`edgepfl simulate` does, the partition's (`PartitionOptions`). A key none of them
knows is refused on both sides, so a typo never passes silently. Keys are written with dashes (`min-clients`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

from edgepfl.device_runtime.options import DeviceOptions, LocalOptions
from edgepfl.errors import UsageError
from edgepfl.options import GROUP, Composed, leaves, titled, validated
from edgepfl.protocol import RoundOptions
from edgepfl.secagg.options import SecureAggregationOptions, check_secure
from edgepfl.server.config import ServerConfig
from edgepfl.server.fleet import FleetOptions
from edgepfl.server.strategies import StrategyChoice, options_model
from edgepfl.simulate.config import PartitionOptions

FLOWER_KEYS = ("partition_id", "num_partitions")  # set by Flower's simulation engine on each virtual node


class ServerRunConfig(Composed):
    """The ServerApp's options: the bundle, the edgepfl strategy, rounds and sampling, the round settings."""

    model_config = titled("Flower server")

    bundle: Annotated[Path, Field(description="the exported bundle every node trains (its manifest and initial base)")]
    out: Annotated[Path, Field(description="run folder: the round engine's state in OUT/server, replaced each run")] = (
        Path("flower-run")
    )
    rounds: Annotated[int, Field(ge=1, description="rounds")] = 3
    nodes: Annotated[int, Field(ge=1, description="SuperNodes to wait for before round 1 (each is one device)")] = 2
    min_clients: int = ServerConfig.model_fields["min_clients"]
    fraction: float = ServerConfig.model_fields["fraction"]
    seed: int = ServerConfig.model_fields["seed"]
    timeout: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="seconds a round waits for replies (its deadline)")
    ] = 600.0
    # pfedla mixes the enrolled nodes: their number is the run's, not a key
    strategy: Annotated[StrategyChoice, Field(json_schema_extra={GROUP: {"exclude": ["pfedla_clients"]}})] = Field(
        default_factory=lambda: options_model("fedper")()
    )
    round: RoundOptions = Field(default_factory=RoundOptions)
    fleet_rounds: FleetOptions = Field(default_factory=FleetOptions)
    secure: SecureAggregationOptions = Field(default_factory=SecureAggregationOptions)

    @model_validator(mode="after")
    def _synchronous(self) -> ServerRunConfig:
        if self.fleet_rounds.asynchronous:
            raise UsageError(
                "aggregation fedbuff cannot run in Flower: its Strategy.start sends a round's messages and waits for "
                "their replies, so every step would be a round barrier",
                "use aggregation sync (with over-select) in Flower, or edgepfl serve for fedbuff",
            )
        check_secure(self.secure, str(self.strategy.name), None, False, self.round.upload_encoding, self.min_clients)
        return self


class NodeRunConfig(Composed):
    """A ClientApp's options: its bundle, engine, identity, data and durable state folder."""

    model_config = titled("Flower node")

    bundle: Annotated[Path, Field(description="the node's copy of the bundle the server trains")]
    local: LocalOptions = Field(default_factory=LocalOptions)
    device_name: Annotated[
        str | None, Field(description="this device's name (default with partition-id: client-NNN)")
    ] = None
    data: Annotated[Path | None, Field(description="this device's own data (.npz or image folder)")] = None
    partition_id: Annotated[
        int | None, Field(ge=0, description="train client N of the run's dataset partition, as edgepfl simulate")
    ] = None
    num_partitions: int | None = None  # Flower's; the partition's own `clients` decides
    state: Annotated[Path | None, Field(description="durable device state folder (default: STATE-ROOT/NAME)")] = None
    state_root: Annotated[Path, Field(description="where device state folders are made")] = Path("flower-devices")
    persfl_teacher: bool = DeviceOptions.model_fields["persfl_teacher"]


def server_config(values: Mapping[str, Any]) -> ServerRunConfig:
    """The ServerApp's options from Flower's run config; one UsageError line for an unknown key or a bad value."""
    keys = _checked(values, "the Flower run config")
    return validated(ServerRunConfig, _pick(keys, ServerRunConfig), "the Flower run config")


def node_config(
    run_config: Mapping[str, Any], node: Mapping[str, Any]
) -> tuple[NodeRunConfig, PartitionOptions | None]:
    """A ClientApp's options (its --node-config over the run config) and, with partition-id, its dataset partition."""
    keys = {**_checked(run_config, "the Flower run config"), **_checked(node, "the node config")}
    config = validated(NodeRunConfig, _pick(keys, NodeRunConfig), "the Flower node config")
    if config.partition_id is None:
        return config, None
    return config, validated(PartitionOptions, _pick(keys, PartitionOptions), "the Flower run config")


def _checked(values: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """Keys with underscores; a key that no side of the run knows is refused."""
    keys = {str(key).replace("-", "_"): value for key, value in values.items()}
    known = {*_names(ServerRunConfig), *_names(NodeRunConfig), *_names(PartitionOptions), *FLOWER_KEYS}
    unknown = sorted(set(keys) - known)
    if unknown:
        raise UsageError(
            f"{origin} has unknown key {unknown[0].replace('_', '-')!r}",
            f"use one of: {', '.join(sorted(key.replace('_', '-') for key in known))}",
        )
    return keys


def _pick(keys: Mapping[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    names = _names(model)
    return {key: value for key, value in keys.items() if key in names}


def _names(model: type[BaseModel]) -> set[str]:
    """The flat keys of a model's tree (edgepfl.options.leaves)."""
    return {leaf.name for leaf in leaves(model)}
