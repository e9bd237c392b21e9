"""What one simulated experiment is: a typed config made at the CLI edge (flags or a JSON/TOML file).

The `edgepfl simulate` flags are made from `SimulateConfig`'s fields (defaults, bounds, choices, help)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from edgepfl.device_runtime.persfl import VARIANTS, DistillConfig
from edgepfl.errors import UsageError
from edgepfl.options import OPTIONS, comma_separated, settings_field, validated
from edgepfl.privacy import check_dp_strategy
from edgepfl.protocol import DOWNLOAD_ENCODINGS
from edgepfl.server.config import PrivacyOptions, RoundOptions, encoding_label
from edgepfl.server.strategies.heurpfedla import HeurPFedLAOptions
from edgepfl.server.strategies.pfedla import PFedLAOptions

SIM_ENGINES = ("torch", "portable", "ort-training")
_DISTILL_DEFAULTS = DistillConfig()
GRID_KEYS = ("distill_lambdas", "distill_temperatures")  # tuples of floats; a config file may write "0.1,0.5"


@dataclass(frozen=True)
class AlgorithmPlan:
    """How a simulate algorithm maps onto the device runtime's client algorithm and a server strategy."""

    client: str  # device_runtime client algorithm: fedsim | fedalt | local
    strategy: str | None  # server strategy name; None: nothing is aggregated
    kp: str  # "given" (use --kp), "zero" (FedAvg shares everything) or "all" (Local keeps everything)
    finetune: bool = False  # personal fine-tuning with the base frozen at round start
    persfl: bool = False  # keep each client's best global model as teacher, then distil a student (stage 2)


ALGORITHMS: dict[str, AlgorithmPlan] = {
    "fedavg": AlgorithmPlan("fedsim", "fedavg", kp="zero"),
    "local": AlgorithmPlan("local", None, kp="all"),
    "fedper": AlgorithmPlan("fedsim", "fedper", kp="given"),
    "fedsim": AlgorithmPlan("fedsim", "fedper", kp="given"),
    "fedalt": AlgorithmPlan("fedalt", "fedper", kp="given"),
    "fedper-ft": AlgorithmPlan("fedsim", "fedper", kp="given", finetune=True),
    "pfedla": AlgorithmPlan("fedsim", "pfedla", kp="given"),  # --kp 0 is the paper's; kp > 0 mixes the base only
    "heurpfedla": AlgorithmPlan("fedsim", "heurpfedla", kp="given"),
    "persfl": AlgorithmPlan("fedsim", "fedavg", kp="zero", persfl=True),
}


class SimulateConfig(BaseModel):
    """Everything `edgepfl simulate` was told; results.json records it verbatim. Its flags are made from it."""

    model_config = OPTIONS

    out: Annotated[str, Field(description="run folder (results.json, accuracy.png); rerun to resume")] = "runs/sim"
    model: Annotated[
        str,
        Field(
            description="zoo name (mobilenet, cnn, mlp, resnet34), torchvision:NAME, path/to/file.py:factory "
            "or package.module:factory"
        ),
    ] = "mobilenet"
    width: Annotated[float, Field(gt=0.0, allow_inf_nan=False, description="MobileNet width: 0.25|0.5|0.75|1.0")] = 0.25
    kp: Annotated[int, Field(ge=0, description="personal blocks, counted from the classifier")] = 2
    norm: Annotated[
        Literal["batch", "group", "none"] | None, Field(description="normalisation (default: the zoo model's own)")
    ] = None
    algorithm: Literal[tuple(ALGORITHMS)] = Field("fedper", description="the method (fedper = fedsim)")  # type: ignore[valid-type]
    dataset: Annotated[
        str, Field(description="mnist, fashion-mnist, emnist[-SPLIT], cifar10, cifar100, or a .npz file")
    ] = "cifar10"
    data_root: Annotated[str, Field(description="folder that holds the dataset")] = "data"
    download: Annotated[bool, Field(description="download the dataset if it is missing")] = False
    checksums: Annotated[str | None, Field(description="md5 list (JSON or CSV) of a known dataset copy")] = None
    partition: Annotated[
        str, Field(description="iid | classes:K | dirichlet:A | ds3 | dominant:D | file:PATH.json")
    ] = "classes:4"
    clients: Annotated[
        int | None, Field(ge=1, description="number of clients (a file: partition has its own count)")
    ] = 10
    split: Annotated[
        tuple[float, float, float],
        Field(description="each client's train,val,test fractions", examples=["0.6,0.2,0.2"]),
    ] = (0.6, 0.2, 0.2)
    fraction: Annotated[float, Field(gt=0.0, le=1.0, description="fraction of clients sampled per round")] = 1.0
    min_clients: Annotated[int, Field(ge=1, description="clients needed to close a round")] = 1
    rounds: Annotated[int, Field(ge=1, description="rounds")] = 50
    epochs: int = settings_field("epochs", default=4)
    batch_size: int = settings_field("batch_size", default=128)
    lr: float = settings_field("lr", default=0.01)
    finetune_epochs: int = settings_field("finetune_epochs", default=1)  # fedper-ft only
    personal_epochs: int = settings_field("personal_epochs")
    hn_lr: float = PFedLAOptions.model_fields["hn_lr"]
    retain_top_k: int = HeurPFedLAOptions.model_fields["retain_top_k"]
    share_buffers: bool = settings_field("share_buffers", flag="--share-bn-stats")
    recompute_bn: bool = settings_field("recompute_bn")
    upload_encoding: str = RoundOptions.model_fields["upload_encoding"]
    download_encoding: Literal[DOWNLOAD_ENCODINGS] = settings_field("download_encoding")  # type: ignore[valid-type]
    dp_noise_multiplier: float | None = PrivacyOptions.model_fields["dp_noise_multiplier"]
    dp_clip: float | None = PrivacyOptions.model_fields["dp_clip"]
    dp_delta: float = PrivacyOptions.model_fields["dp_delta"]
    dp_target_epsilon: float | None = PrivacyOptions.model_fields["dp_target_epsilon"]
    distill_lambdas: Annotated[
        tuple[float, ...], Field(description="persfl: the λ grid, comma-separated", examples=["0.1,0.5"])
    ] = tuple(_DISTILL_DEFAULTS.lambdas)
    distill_temperatures: Annotated[
        tuple[float, ...], Field(description="persfl: the temperature grid, comma-separated", examples=["1,2,4"])
    ] = tuple(_DISTILL_DEFAULTS.temperatures)
    distill_epochs: Annotated[int, Field(ge=1, description="persfl: epochs per (λ, T)")] = _DISTILL_DEFAULTS.epochs
    distill_lr: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="persfl: distillation learning rate")
    ] = _DISTILL_DEFAULTS.lr
    distill_variant: Literal[VARIANTS] = Field(  # type: ignore[valid-type]
        _DISTILL_DEFAULTS.variant, description="persfl: kd (soft-label KL) or gd (PersFL-GD, Eq. 7)"
    )
    engine: Literal[SIM_ENGINES] = Field("torch", description="the clients' training engine")  # type: ignore[valid-type]
    seed: Annotated[int, Field(description="seed of partition, init, sampling and shuffling")] = 0
    threads: Annotated[int | None, Field(ge=1, description="CPU threads of the engine (default: its choice)")] = None
    device: Annotated[
        str,
        Field(
            pattern=r"^(cpu|cuda(:[0-9]+)?)$",
            description="--engine torch: where it computes (cpu, cuda, cuda:N); the ONNX engines run on the CPU",
        ),
    ] = "cpu"
    workers: Annotated[
        int, Field(ge=1, description="train a round's clients in this many Ray actors (1: in this process, no Ray)")
    ] = 1
    ray_address: Annotated[
        str | None, Field(description="join this Ray cluster (e.g. ray://head:10001 or auto) instead of a local Ray")
    ] = None
    client_cpus: Annotated[float, Field(gt=0.0, allow_inf_nan=False, description="CPUs each Ray actor reserves")] = 1.0
    client_gpus: Annotated[float, Field(ge=0.0, allow_inf_nan=False, description="GPUs each Ray actor reserves")] = 0.0

    @field_validator("split", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return split_value(value)

    _encoding = field_validator("upload_encoding")(encoding_label)

    @field_validator(*GRID_KEYS, mode="before")
    @classmethod
    def _grid(cls, value: Any) -> Any:
        return comma_separated(value)

    @model_validator(mode="after")
    def _model_and_stage_two(self) -> SimulateConfig:
        from edgepfl.export.source import parse_model  # a zoo name or a MODEL string of `edgepfl export`

        parse_model(self.model)
        if self.plan.persfl:
            self.distill_config()
        privacy = self.privacy()
        lossy = self.upload_encoding != "fp32" or self.download_encoding != "fp32" or privacy.enabled
        if lossy and self.plan.strategy is None:
            raise UsageError(
                f"--algorithm {self.algorithm} uploads nothing: --upload-encoding, --download-encoding and --dp-* "
                "do not apply",
                "drop them, or choose an algorithm that aggregates",
            )
        if privacy.enabled and self.plan.strategy is not None:
            check_dp_strategy(self.plan.strategy, "--algorithm")
        if self.device != "cpu" and self.engine != "torch":
            raise UsageError(
                f"--device {self.device} applies to --engine torch; the {self.engine} engine runs on the CPU",
                "use --engine torch, or drop --device",
            )
        return self

    def privacy(self) -> PrivacyOptions:
        """The run's DP settings, as `edgepfl serve` takes them."""
        return PrivacyOptions(**{name: getattr(self, name) for name in PrivacyOptions.model_fields})

    def updated(self, **changes: Any) -> SimulateConfig:
        """This config with `changes`, validated again."""
        return validated(SimulateConfig, {**dict(self), **changes})

    def distill_config(self) -> DistillConfig:
        """PersFL stage 2's settings (DistillConfig checks them); stage 2 trains with the run's batch size."""
        return DistillConfig(
            lambdas=self.distill_lambdas,
            temperatures=self.distill_temperatures,
            epochs=self.distill_epochs,
            lr=self.distill_lr,
            batch_size=self.batch_size,
            variant=self.distill_variant,
            seed=self.seed,
        )

    @property
    def plan(self) -> AlgorithmPlan:
        """The client algorithm and strategy this run uses."""
        return ALGORITHMS[self.algorithm]

    def to_json(self) -> dict[str, Any]:
        """JSON form (results.json `config`)."""
        return self.model_dump(mode="json")

    def same_experiment(self, other: SimulateConfig) -> list[str]:
        """Fields that differ in a way that makes `other` a different experiment (rounds, threads, workers may)."""
        free = {"rounds", "threads", "device", "out", "workers", "ray_address", "client_cpus", "client_gpus"}
        names = [name for name in SimulateConfig.model_fields if name not in free]
        return [name for name in names if getattr(self, name) != getattr(other, name)]


def config_from_json(data: dict[str, Any], origin: str = "config", flags: Iterable[str] = ()) -> SimulateConfig:
    """A config from a mapping (a config file, results.json, or flags); unknown keys are refused by name.

    Keys in `flags` came from the command line: a problem with one is named by its flag, any other by `origin`.
    """
    normalised = {key.replace("-", "_"): value for key, value in data.items()}
    for key in ("out", "data_root", "checksums"):
        if isinstance(normalised.get(key), Path):
            normalised[key] = str(normalised[key])
    return validated(SimulateConfig, normalised, origin, flags=flags)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The key/value pairs of a JSON or TOML config file (a `[simulate]` table is used when present)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read config file {path} ({exc})", "check the path given to --config") from None
    try:
        data = _parse_toml(text, path) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, json.JSONDecodeError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise UsageError(f"config file {path} is not valid {path.suffix[1:] or 'JSON'} ({exc})", "fix it") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} is not a table of options", 'write {"rounds": 50, ...}')
    return data.get("simulate", data)


def _parse_toml(text: str, path: Path) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise UsageError(f"reading {path} needs Python 3.11 or later (tomllib)", "write the config as JSON") from None
    return tomllib.loads(text)


class PartitionOptions(BaseModel):
    """The dataset and its split into clients, as `SimulateConfig` holds them (what a Flower node trains a part of).

    Made without `SimulateConfig`, whose model check needs torch: a node has none.
    """

    model_config = OPTIONS

    dataset: str = SimulateConfig.model_fields["dataset"]
    data_root: str = SimulateConfig.model_fields["data_root"]
    download: bool = SimulateConfig.model_fields["download"]
    checksums: str | None = SimulateConfig.model_fields["checksums"]
    partition: str = SimulateConfig.model_fields["partition"]
    clients: int | None = SimulateConfig.model_fields["clients"]
    split: tuple[float, float, float] = SimulateConfig.model_fields["split"]
    seed: int = SimulateConfig.model_fields["seed"]

    @field_validator("split", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return split_value(value)


def split_value(value: Any) -> Any:
    """`--split` as a (train, val, test) tuple: "0.6,0.2,0.2" parsed, a sequence checked."""
    from edgepfl.partition import check_split, parse_split

    if isinstance(value, str):
        return parse_split(value)
    return check_split(value) if isinstance(value, tuple | list) else value
