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
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from edgepfl.errors import UsageError
from edgepfl.options import OPTIONS, validated
from edgepfl.server.config import RoundOptions, ServerConfig
from edgepfl.server.strategies import STRATEGIES
from edgepfl.server.strategies.heurpfedla import HeurPFedLAOptions
from edgepfl.server.strategies.pfedla import PFedLAOptions
from edgepfl.server.strategies.trimmed_mean import TrimmedMeanOptions
from edgepfl.simulate.config import PartitionOptions

FLOWER_KEYS = ("partition_id", "num_partitions")  # set by Flower's simulation engine on each virtual node


class ServerRunConfig(RoundOptions):
    """The ServerApp's options: the bundle, the edgepfl strategy, rounds and sampling, the round settings."""

    bundle: Annotated[Path, Field(description="the exported bundle every node trains (its manifest and initial base)")]
    out: Annotated[Path, Field(description="run folder: the round engine's state in OUT/server, replaced each run")] = (
        Path("flower-run")
    )
    strategy: Literal[tuple(STRATEGIES)] = ServerConfig.model_fields["strategy"]  # type: ignore[valid-type]
    rounds: Annotated[int, Field(ge=1, description="rounds")] = 3
    nodes: Annotated[int, Field(ge=1, description="SuperNodes to wait for before round 1 (each is one device)")] = 2
    min_clients: int = ServerConfig.model_fields["min_clients"]
    fraction: float = ServerConfig.model_fields["fraction"]
    seed: int = ServerConfig.model_fields["seed"]
    timeout: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="seconds a round waits for replies (its deadline)")
    ] = 600.0
    hn_lr: float = PFedLAOptions.model_fields["hn_lr"]
    retain_top_k: int = HeurPFedLAOptions.model_fields["retain_top_k"]
    trim_fraction: float = TrimmedMeanOptions.model_fields["trim_fraction"]

    def knobs(self) -> dict[str, Any]:
        """The edgepfl strategy's own options."""
        return {"hn_lr": self.hn_lr, "retain_top_k": self.retain_top_k, "trim_fraction": self.trim_fraction}


class NodeRunConfig(BaseModel):
    """A ClientApp's options: its bundle, engine, identity, data and durable state folder."""

    model_config = OPTIONS

    bundle: Annotated[Path, Field(description="the node's copy of the bundle the server trains")]
    engine: Annotated[
        Literal["auto", "ort-training", "portable"], Field(description="training engine (never torch)")
    ] = "auto"
    threads: Annotated[int | None, Field(ge=1, description="CPU threads of the engine (default: its choice)")] = None
    device_name: Annotated[
        str | None, Field(description="this device's name (default with partition-id: client-NNN)")
    ] = None
    data: Annotated[Path | None, Field(description="this device's own data (.npz or image folder)")] = None
    val_fraction: Annotated[
        float, Field(ge=0.0, lt=1.0, description="share of the own data held out for validation")
    ] = 0.2
    partition_id: Annotated[
        int | None, Field(ge=0, description="train client N of the run's dataset partition, as edgepfl simulate")
    ] = None
    num_partitions: int | None = None  # Flower's; the partition's own `clients` decides
    state: Annotated[Path | None, Field(description="durable device state folder (default: STATE-ROOT/NAME)")] = None
    state_root: Annotated[Path, Field(description="where device state folders are made")] = Path("flower-devices")
    seed: Annotated[int, Field(description="shuffling seed (with partition-id: the run seed, as simulate)")] = 0
    persfl_teacher: Annotated[
        bool,
        Field(description="PersFL stage 1: keep the received base with the lowest held-out loss (for device distill)"),
    ] = False


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
    known = {*ServerRunConfig.model_fields, *NodeRunConfig.model_fields, *PartitionOptions.model_fields, *FLOWER_KEYS}
    unknown = sorted(set(keys) - known)
    if unknown:
        raise UsageError(
            f"{origin} has unknown key {unknown[0].replace('_', '-')!r}",
            f"use one of: {', '.join(sorted(key.replace('_', '-') for key in known))}",
        )
    return keys


def _pick(keys: Mapping[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    return {key: value for key, value in keys.items() if key in model.model_fields}
