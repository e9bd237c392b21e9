"""What one simulated experiment is: a typed config made at the CLI edge (flags or a JSON/TOML file).

`SimulateConfig` holds the experiment's own fields and the models of the parts it drives, each owned by its
part: the dataset and its split (`PartitionOptions`, also `edgepfl partition`'s and a Flower node's), the round
settings (`edgepfl.protocol.RoundOptions`, with simulate's own defaults), DP (`edgepfl.privacy.PrivacyOptions`),
the options of the strategies its algorithms run (`StrategyKnobs`, made from their strategy files' models) and
PersFL's stage 2 (`device_runtime.options.DistillOptions`, its keys prefixed `distill_`). `edgepfl simulate`'s
flags, a config file's keys and results.json's `config` are its flat leaves (`edgepfl.options.flatten`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, create_model, field_validator, model_validator

from edgepfl.datasets import NATURAL, is_natural
from edgepfl.datasets.textdata import DEFAULT_MIN_WORDS
from edgepfl.device_runtime.options import DistillOptions
from edgepfl.device_runtime.persfl import DistillConfig
from edgepfl.errors import UsageError
from edgepfl.export.sequence_options import TEXT_MODELS
from edgepfl.options import GROUP, Composed, flatten, nest, titled, validated
from edgepfl.personal import SPEC_HELP, parse_spec, personal_choice
from edgepfl.privacy import PrivacyOptions, check_dp_strategy
from edgepfl.protocol import RoundOptions
from edgepfl.secagg.config import MIN_DEVICES
from edgepfl.secagg.options import SecureAggregationOptions, check_secure
from edgepfl.server.config import ServerConfig
from edgepfl.server.fleet import FleetOptions
from edgepfl.server.sampling import sample_size
from edgepfl.server.strategies import STRATEGIES, strategy_options
from edgepfl.simulate.fleet import SPEC_EXAMPLE, FleetSpec
from edgepfl.text import DEFAULT_SEQ_LEN, DEFAULT_VOCAB_SIZE, TRAINING_DEFAULTS

SIM_ENGINES = ("torch", "portable", "ort-training")


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


def strategy_knobs_model() -> type[BaseModel]:
    """The options of the strategies simulate's algorithms run, from their files' `Options` models, less the fixed
    cohort the run sets (pfedla's number of clients): a new option of theirs is a simulate flag with no change here."""
    fields: dict[str, Any] = {}
    for name in dict.fromkeys(plan.strategy for plan in ALGORITHMS.values() if plan.strategy is not None):
        strategy = STRATEGIES[name]
        for key, info in strategy.Options.model_fields.items():
            if key != strategy.cohort_option:
                fields[key] = (info.annotation, info)
    model = create_model("StrategyKnobs", __config__=titled("Strategies"), **fields)
    model.__doc__ = "the options of the strategies the algorithms run (pfedla's, heurpfedla's)"
    return model


StrategyKnobs = strategy_knobs_model()


def personal_algorithms() -> str:
    """The algorithms that keep the parameters --kp or --personal chooses on the device ("a, b or c")."""
    names = [name for name, plan in ALGORITHMS.items() if plan.kp == "given"]
    return f"{', '.join(names[:-1])} or {names[-1]}"


class PartitionOptions(BaseModel):
    """The dataset and its split into clients (what a Flower node trains a part of); seeded by the run's --seed.

    Made without `SimulateConfig`, whose model check needs torch: a node has none.
    """

    model_config = titled("Data")

    dataset: Annotated[
        str,
        Field(
            description="mnist, fashion-mnist, emnist[-SPLIT], cifar10, cifar100, a .npz file; with their own "
            "clients: shakespeare, textdir:FOLDER (a .txt per client), har (docs/datasets.md)"
        ),
    ] = "cifar10"
    data_root: Annotated[str, Field(description="folder that holds the dataset")] = "data"
    download: Annotated[bool, Field(description="download the dataset if it is missing")] = False
    checksums: Annotated[str | None, Field(description="md5 list (JSON or CSV) of a known dataset copy")] = None
    partition: Annotated[
        str,
        Field(
            description="iid | classes:K | dirichlet:A | ds3 | dominant:D[:SHARE] | file:PATH.json | natural (the "
            "default of a dataset with its own clients)"
        ),
    ] = "classes:4"
    clients: Annotated[
        int | None,
        Field(
            ge=1,
            description="number of clients (a file: partition has its own count; a dataset with its own clients: "
            "the N with most training samples, default all)",
        ),
    ] = 10
    vocab_size: Annotated[
        int, Field(ge=1, description="text datasets: words in the vocabulary (from all clients' training text)")
    ] = DEFAULT_VOCAB_SIZE
    seq_len: Annotated[int, Field(ge=1, description="text datasets: tokens a next-word sample reads")] = DEFAULT_SEQ_LEN
    min_words: Annotated[
        int, Field(ge=1, description="text datasets: drop roles (shakespeare) or refuse files with fewer words")
    ] = DEFAULT_MIN_WORDS
    split: Annotated[
        tuple[float, float, float],
        Field(description="each client's train,val,test fractions", examples=["0.6,0.2,0.2"]),
    ] = (0.6, 0.2, 0.2)

    @field_validator("split", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return split_value(value)

    @model_validator(mode="before")
    @classmethod
    def _natural_defaults(cls, values: Any) -> Any:
        """A dataset with its own clients partitions by them, all of them, unless told otherwise."""
        if isinstance(values, dict) and is_natural(str(values.get("dataset", ""))):
            return {"partition": NATURAL, "clients": None, **values}
        return values


class PartitionCommand(Composed):
    """`edgepfl partition`: split a dataset among clients, show the counts or write the partition."""

    model_config = titled("Partition")

    data: PartitionOptions = PartitionOptions(dataset="mnist", partition="iid", clients=None)
    seed: Annotated[int, Field(description="seed of the partition")] = 0
    show: Annotated[bool, Field(description="print the client x class count table")] = False
    out: Annotated[Path | None, Field(description="write the partition as a file: JSON (train+test indices)")] = None


# simulate's own defaults for the round settings: the papers' local work per round
SIMULATE_ROUND = RoundOptions(epochs=4, batch_size=128, finetune_epochs=1)
PERSFL_STAGE_TWO = {"exclude": ["batch_size", "trainable"], "prefix": "distill_"}  # stage 2 uses the run's batch size


class SimulateConfig(Composed):
    """Everything `edgepfl simulate` was told; results.json records it (flat). Its flags are made from it."""

    model_config = titled("Experiment")

    out: Annotated[str, Field(description="run folder (results.json, accuracy.png); rerun to resume")] = "runs/sim"
    model: Annotated[
        str,
        Field(
            description="zoo name (mobilenet, cnn, mlp, resnet34), torchvision:NAME, path/to/file.py:factory "
            "or package.module:factory"
        ),
    ] = "mobilenet"
    width: Annotated[
        float,
        Field(gt=0.0, allow_inf_nan=False, description="mobilenet, transformer, lstm, har-cnn width: 0.25|0.5|0.75|1"),
    ] = 0.25
    kp: Annotated[
        int | None, Field(ge=0, description="personal blocks, counted from the classifier (default 2): output:K")
    ] = None
    personal: Annotated[
        str | None, Field(description=f"which parameters stay on the device: {SPEC_HELP}", examples=["adapters:16"])
    ] = None
    norm: Annotated[
        Literal["batch", "group", "none"] | None, Field(description="normalisation (default: the zoo model's own)")
    ] = None
    algorithm: Literal[tuple(ALGORITHMS)] = Field("fedper", description="the method (fedper = fedsim)")  # type: ignore[valid-type]
    data: PartitionOptions = Field(default_factory=PartitionOptions)
    fraction: Annotated[float, Field(gt=0.0, le=1.0, description="fraction of clients sampled per round")] = 1.0
    min_clients: Annotated[int, Field(ge=1, description="clients needed to close a round")] = 1
    rounds: Annotated[int, Field(ge=1, description="rounds (fedbuff: server steps)")] = 50
    fleet: Annotated[
        str | None,
        Field(
            description="simulate a fleet on a virtual clock: dropouts, speeds, on/off periods "
            "(edgepfl/simulate/fleet.py)",
            examples=[SPEC_EXAMPLE],
        ),
    ] = None
    fleet_rounds: FleetOptions = Field(default_factory=FleetOptions)
    round_timeout: float = ServerConfig.model_fields["round_timeout"]
    # the client update (fedsim, fedalt, local) is the method's: --algorithm chooses it
    round: Annotated[RoundOptions, Field(json_schema_extra={GROUP: {"exclude": ["algorithm"]}})] = SIMULATE_ROUND
    strategy_knobs: StrategyKnobs = Field(default_factory=StrategyKnobs)  # type: ignore[valid-type]
    privacy: PrivacyOptions = Field(default_factory=PrivacyOptions)
    secure: SecureAggregationOptions = Field(default_factory=SecureAggregationOptions)
    distill: Annotated[DistillOptions, Field(json_schema_extra={GROUP: PERSFL_STAGE_TWO})] = DistillOptions()
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

    @model_validator(mode="before")
    @classmethod
    def _text_training(cls, values: Any) -> Any:
        """A next-word model's round settings not given are the text models' measured ones (edgepfl.text
        TRAINING_DEFAULTS), not simulate's image defaults."""
        if not isinstance(values, dict):
            return values
        nested = nest(cls, values)
        if nested.get("model") not in TEXT_MODELS:
            return values
        given = nested.get("round")
        base = SIMULATE_ROUND.model_dump(include=SIMULATE_ROUND.model_fields_set) if given is None else {}
        return {**nested, "round": {**base, **TRAINING_DEFAULTS, **(given or {})}}

    @model_validator(mode="after")
    def _model_and_stage_two(self) -> SimulateConfig:
        from edgepfl.export.source import parse_model  # a zoo name or a MODEL string of `edgepfl export`

        parse_model(self.model)
        personal_choice(self.kp, self.personal)
        if self.personal is not None:
            parse_spec(self.personal)
            if self.plan.kp != "given":
                raise UsageError(
                    f"--algorithm {self.algorithm} keeps {'no' if self.plan.kp == 'zero' else 'every'} parameter "
                    "personal: --personal does not apply",
                    f"drop --personal, or choose {personal_algorithms()}",
                )
        if self.plan.persfl:
            self.distill_config()
        lossy = self.round.upload_encoding != "fp32" or self.round.download_encoding != "fp32" or self.privacy.enabled
        if (lossy or self.secure.secure_aggregation) and self.plan.strategy is None:
            raise UsageError(
                f"--algorithm {self.algorithm} uploads nothing: --upload-encoding, --download-encoding, --dp-* "
                "and --secure-aggregation do not apply",
                "drop them, or choose an algorithm that aggregates",
            )
        if self.plan.strategy is not None:
            check_secure(
                self.secure,
                self.plan.strategy,
                self.privacy.clip_norm,
                self.fleet_rounds.asynchronous,
                self.round.upload_encoding,
                self.min_clients,
                "--algorithm",
                self.cohort(),
            )
        if self.secure.secure_aggregation and self.on_a_clock:
            raise UsageError(
                "the simulated fleet's virtual clock (--fleet, --over-select) does not run secure rounds",
                "drop --fleet and --over-select with --secure-aggregation (edgepfl serve runs them)",
            )
        if self.privacy.enabled and self.plan.strategy is not None:
            check_dp_strategy(self.plan.strategy, "--algorithm")
        if self.fleet is not None:
            FleetSpec.parse(self.fleet)
        if self.on_a_clock and self.plan.strategy is None:
            raise UsageError(
                f"--algorithm {self.algorithm} aggregates nothing: --fleet, --over-select and fedbuff do not apply",
                "drop them, or choose an algorithm that aggregates",
            )
        if self.fleet_rounds.asynchronous:
            self.fleet_rounds.check_strategy(str(self.plan.strategy))
            if self.privacy.enabled:
                raise UsageError("DP-FedAvg's accountant counts rounds, not fedbuff's steps", "drop the --dp-* options")
        if self.device != "cpu" and self.engine != "torch":
            raise UsageError(
                f"--device {self.device} applies to --engine torch; the {self.engine} engine runs on the CPU",
                "use --engine torch, or drop --device",
            )
        return self

    def cohort(self) -> tuple[int, str, str] | None:
        """Each round's clients as secure aggregation checks them (`check_secure`): every sampled client trains,
        since secure rounds run without a --fleet's dropouts; None for a partition file (its count is inside)."""
        clients = self.data.clients
        if clients is None:
            return None
        count = sample_size(clients, self.fraction, self.min_clients)
        said = f"each round has {count} of the {clients} clients (--clients {clients}, --fraction {self.fraction:g})"
        return count, said, f"raise --clients or --fraction so a round has {MIN_DEVICES} or more clients"

    @property
    def on_a_clock(self) -> bool:
        """Whether rounds run on the fleet's virtual clock (--fleet, over-selection or fedbuff)."""
        return self.fleet is not None or self.fleet_rounds != FleetOptions()

    def round_options(self) -> RoundOptions:
        """The round settings the strategy hands every sampled client: the method's client update, and its
        personal fine-tuning only for fedper-ft."""
        finetune = self.round.finetune_epochs if self.plan.finetune else 0
        return self.round.model_copy(update={"algorithm": self.plan.client, "finetune_epochs": finetune})

    def server_options(self) -> dict[str, Any]:
        """Its round engine's `ServerConfig` fields (`open_server`'s): those it shares by name, the method's round
        settings and its strategy's options (None: `local` aggregates nothing)."""
        strategy = self.plan.strategy
        chosen = None if strategy is None else strategy_options(strategy, **self.strategy_knobs.model_dump())
        return {**ServerConfig.shared_fields(self), "round": self.round_options(), "strategy": chosen}

    def updated(self, **changes: Any) -> SimulateConfig:
        """This config with `changes` (flat keys), validated again."""
        return validated(SimulateConfig, {**self.to_json(), **changes})

    def distill_config(self) -> DistillConfig:
        """PersFL stage 2's settings (DistillConfig checks them); stage 2 trains with the run's batch size."""
        return self.distill.model_copy(update={"batch_size": self.round.batch_size}).config(self.seed)

    @property
    def plan(self) -> AlgorithmPlan:
        """The client algorithm and strategy this run uses."""
        return ALGORITHMS[self.algorithm]

    def to_json(self) -> dict[str, Any]:
        """JSON form (results.json `config`): the flat keys."""
        return flatten(self)

    def same_experiment(self, other: SimulateConfig) -> list[str]:
        """Keys that differ in a way that makes `other` a different experiment (rounds, threads, workers may)."""
        free = {"rounds", "threads", "device", "out", "workers", "ray_address", "client_cpus", "client_gpus"}
        mine, theirs = self.to_json(), other.to_json()
        for keys in (mine, theirs):  # results.json of runs before --personal recorded the default kp as 2
            keys["kp"] = 2 if keys.get("kp") is None and keys.get("personal") is None else keys.get("kp")
        return [key for key in mine if key not in free and mine[key] != theirs.get(key)]


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
    table = data.get("simulate", data)
    return {str(key).replace("-", "_"): value for key, value in table.items()}


def _parse_toml(text: str, path: Path) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise UsageError(f"reading {path} needs Python 3.11 or later (tomllib)", "write the config as JSON") from None
    return tomllib.loads(text)


def split_value(value: Any) -> Any:
    """`--split` as a (train, val, test) tuple: "0.6,0.2,0.2" parsed, a sequence checked."""
    from edgepfl.datasets.partition import check_split, parse_split

    if isinstance(value, str):
        return parse_split(value)
    return check_split(value) if isinstance(value, tuple | list) else value
