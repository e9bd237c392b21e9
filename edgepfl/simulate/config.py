"""What one simulated experiment is: a typed config made at the CLI edge (flags or a JSON/TOML file)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from edgepfl.device_runtime.persfl import DistillConfig
from edgepfl.errors import UsageError

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


@dataclass(frozen=True)
class SimulateConfig:
    """Everything `edgepfl simulate` was told; results.json records it verbatim."""

    out: str = "runs/sim"
    model: str = "mobilenet"  # zoo name, torchvision:NAME, path/to/file.py:factory or package.module:factory
    width: float = 0.25
    kp: int = 2
    norm: str | None = None  # None: the zoo model's default
    algorithm: str = "fedper"
    dataset: str = "cifar10"
    data_root: str = "data"
    download: bool = False
    checksums: str | None = None
    partition: str = "classes:4"
    clients: int | None = 10  # None only with file: partitions (the file's count)
    split: tuple[float, float, float] = (0.6, 0.2, 0.2)
    fraction: float = 1.0
    min_clients: int = 1
    rounds: int = 50
    epochs: int = 4
    batch_size: int = 128
    lr: float = 0.01
    finetune_epochs: int = 1  # fedper-ft only
    personal_epochs: int = 1  # fedalt only
    hn_lr: float = 5e-3  # pfedla, heurpfedla: SGD learning rate of the hypernetworks
    retain_top_k: int = 1  # heurpfedla: tensors with the largest self-weight that stay on each client
    share_buffers: bool = False
    distill_lambdas: tuple[float, ...] = tuple(_DISTILL_DEFAULTS.lambdas)  # persfl stage 2: the (λ, T) grid
    distill_temperatures: tuple[float, ...] = tuple(_DISTILL_DEFAULTS.temperatures)
    distill_epochs: int = _DISTILL_DEFAULTS.epochs
    distill_lr: float = _DISTILL_DEFAULTS.lr
    distill_variant: str = _DISTILL_DEFAULTS.variant
    engine: str = "torch"
    seed: int = 0
    threads: int | None = None
    workers: int = 1  # > 1: clients train in this many Ray actors (simulate/workers.py)
    ray_address: str | None = None  # an existing Ray cluster; None: a local Ray instance when workers > 1
    client_cpus: float = 1.0  # each Ray actor's CPUs
    client_gpus: float = 0.0  # each Ray actor's GPUs

    def check(self) -> None:
        """Refuse values that cannot work, naming the option (raises UsageError)."""
        checks = [
            (
                self.algorithm in ALGORITHMS,
                f"--algorithm {self.algorithm!r} is unknown",
                f"use {', '.join(ALGORITHMS)}",
            ),
            (self.engine in SIM_ENGINES, f"--engine {self.engine!r} is unknown", f"use {', '.join(SIM_ENGINES)}"),
            (self.rounds >= 1, "--rounds must be at least 1", "pass e.g. --rounds 50"),
            (self.epochs >= 0, "--epochs must not be negative", "pass e.g. --epochs 4"),
            (self.batch_size >= 1, "--batch-size must be at least 1", "pass e.g. --batch-size 128"),
            (self.lr > 0 and math.isfinite(self.lr), "--lr must be a positive number", "pass e.g. --lr 0.01"),
            (0.0 < self.fraction <= 1.0, "--fraction must be in (0, 1]", "pass e.g. --fraction 1.0"),
            (self.min_clients >= 1, "--min-clients must be at least 1", "pass e.g. --min-clients 1"),
            (self.kp >= 0, "--kp must not be negative", "pass e.g. --kp 2"),
            (min(self.finetune_epochs, self.personal_epochs) >= 0, "epoch counts must not be negative", "pass 0+"),
            (self.clients is None or self.clients >= 1, "--clients must be at least 1", "pass e.g. --clients 10"),
            (self.threads is None or self.threads >= 1, "--threads must be at least 1", "leave it out or pass 1+"),
            (self.hn_lr > 0 and math.isfinite(self.hn_lr), "hn_lr must be a positive number", "pass e.g. 0.005"),
            (self.retain_top_k >= 1, "retain_top_k must be at least 1", "pass e.g. 1"),
            (self.workers >= 1, "--workers must be at least 1", "pass e.g. --workers 2"),
            (self.client_cpus > 0, "--client-cpus must be positive", "pass e.g. --client-cpus 1"),
            (self.client_gpus >= 0, "--client-gpus must not be negative", "leave it out or pass e.g. 0.5"),
        ]
        for ok, problem, fix in checks:
            if not ok:
                raise UsageError(problem, fix)
        from edgepfl.export.source import parse_model  # a zoo name or a MODEL string of `edgepfl export`

        parse_model(self.model)
        if self.plan.persfl:
            self.distill_config()

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
        data = asdict(self)
        data["split"] = list(self.split)
        for key in GRID_KEYS:
            data[key] = list(data[key])
        return data

    def same_experiment(self, other: SimulateConfig) -> list[str]:
        """Fields that differ in a way that makes `other` a different experiment (rounds, threads, workers may)."""
        free = {"rounds", "threads", "out", "workers", "ray_address", "client_cpus", "client_gpus"}
        return [f.name for f in fields(self) if f.name not in free and getattr(self, f.name) != getattr(other, f.name)]


def config_from_json(data: dict[str, Any], origin: str = "config") -> SimulateConfig:
    """A config from a mapping (a config file or results.json); unknown keys are refused by name."""
    known = {f.name for f in fields(SimulateConfig)}
    normalised = {key.replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(set(normalised) - known)
    if unknown:
        raise UsageError(f"{origin} has unknown key {unknown[0]!r}", f"use keys of: {', '.join(sorted(known))}")
    if "split" in normalised:
        split = normalised["split"]
        if isinstance(split, str):
            from edgepfl.partition import parse_split

            split = parse_split(split)
        normalised["split"] = tuple(float(v) for v in split)
    for key in GRID_KEYS:
        if key in normalised:
            normalised[key] = _float_tuple(normalised[key], key, origin)
    for key in ("out", "data_root", "checksums"):
        if isinstance(normalised.get(key), Path):
            normalised[key] = str(normalised[key])
    return replace(SimulateConfig(), **normalised)


def _float_tuple(value: Any, key: str, origin: str) -> tuple[float, ...]:
    items = value.split(",") if isinstance(value, str) else value
    try:
        return tuple(float(item) for item in items)
    except (TypeError, ValueError):
        raise UsageError(f"{origin}: {key} must be a list of numbers", f'write e.g. "{key}": [0.1, 0.5]') from None


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
