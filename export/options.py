"""How `edgepfl export` writes a bundle, as one typed model (importable without torch, so the CLI reads it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from edgepfl.errors import UsageError
from edgepfl.export.sequence_options import SequenceOptions
from edgepfl.manifest import class_names_problem
from edgepfl.options import ARGUMENT, Composed, comma_separated, titled
from edgepfl.ortbuild import training_build_installed
from edgepfl.personal import SPEC_HELP, parse_spec, personal_choice

ENGINES = ("ort-training", "portable")
OPTIMIZERS = ("sgd", "adamw")


def read_class_names_file(path: Path) -> tuple[str, ...]:
    """`--class-names-file`: one class name per line, in class order (a final newline is fine)."""
    try:
        names = tuple(path.read_text(encoding="utf-8-sig").splitlines())  # -sig: a BOM some editors write
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--class-names-file {path} cannot be read ({exc})", "pass a UTF-8 text file") from None
    problem = class_names_problem(names)
    if problem:
        raise UsageError(f"--class-names-file {path}: {problem}", "write one class name per line, in class order")
    return names


def default_engines() -> tuple[str, ...]:
    """Both engines where the training build is installed (it generates ORT artifacts), else portable only."""
    return ENGINES if training_build_installed() else ("portable",)


class ExportOptions(BaseModel):
    """How to export: engines, ORT training's optimizer, the init seed, PersFL's distillation graphs."""

    model_config = titled("Artifacts")

    engines: Annotated[
        tuple[Literal[ENGINES], ...],  # type: ignore[valid-type]
        Field(
            default_factory=default_engines,
            min_length=1,
            description="comma list of engines to write, default both (portable alone without the training build)",
            examples=["ort-training,portable"],
        ),
    ]
    optimizer: Annotated[Literal[OPTIMIZERS], Field(description="ORT-training optimizer")] = "sgd"  # type: ignore[valid-type]
    seed: Annotated[int, Field(ge=0, description="seed of the initial weights (and of a new head)")] = 0
    force: Annotated[bool, Field(description="replace a non-empty output folder")] = False
    portable_batch: Annotated[int, Field(ge=1, description="batch of the portable step graphs")] = 32
    distill: Annotated[
        bool, Field(description="also write PersFL distillation graphs for `device distill` (doubles export time)")
    ] = False
    frozen_variants: Annotated[
        bool,
        Field(
            description="also write each personal-only and base-only step with its frozen tensors as initializers "
            "(the portable engine's faster long phases; the bundle grows by the graphs' size, not the weights')"
        ),
    ] = True
    class_names: Annotated[
        tuple[str, ...],
        Field(
            description="comma list of the class names, in class order (or --class-names-file, one per line)",
            examples=["cat,dog,bird"],
        ),
    ] = ()

    @field_validator("class_names", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        return tuple(name.strip() for name in value.split(",")) if isinstance(value, str) else value

    @field_validator("class_names")
    @classmethod
    def _valid_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        problem = class_names_problem(names)
        if problem:
            raise ValueError(problem)
        return names

    @field_validator("engines", mode="before")
    @classmethod
    def _engines(cls, value: Any) -> Any:
        return comma_separated(value)


class ZooOptions(BaseModel):
    """The zoo models' knobs (each defaults to the zoo model's own)."""

    model_config = titled("Zoo models")

    width: Annotated[
        float | None,
        Field(gt=0.0, description="zoo width multiplier (mobilenet, transformer, lstm, har-cnn): 0.25|0.5|0.75|1.0"),
    ] = None
    input_size: Annotated[int | None, Field(ge=1, description="zoo image side: 32 (CIFAR), 28 (MNIST), 224")] = None
    in_channels: Annotated[int | None, Field(ge=1, description="zoo input channels: 3 colour, 1 grey")] = None
    norm: Annotated[
        Literal["batch", "group", "none"] | None, Field(description="zoo normalisation: batch | group | none")
    ] = None

    def given(self) -> list[str]:
        """The flags of the knobs that were set."""
        return ["--" + name.replace("_", "-") for name, value in self if value is not None]


class ExportCommand(Composed):
    """`edgepfl export`: which model, split where, written where."""

    model_config = titled("Model")

    model: Annotated[
        str,
        Field(
            description="zoo model (mobilenet, cnn, mlp, resnet34; transformer, lstm; har-cnn), torchvision:NAME, "
            "path/to/file.py:factory or package.module:factory",
            json_schema_extra={ARGUMENT: True},
        ),
    ]
    kp: Annotated[
        int | None,
        Field(ge=0, description="personal blocks counted from the classifier (0 = FedAvg; default 2): output:K"),
    ] = None
    personal: Annotated[
        str | None, Field(description=f"which parameters stay on the device: {SPEC_HELP}", examples=["adapters:16"])
    ] = None
    out: Annotated[Path, Field(description="bundle folder to write")] = Path("bundle")
    input_shape: Annotated[
        str | None, Field(description="C,H,W of one sample (torchvision:/factory models; torchvision: 3,224,224)")
    ] = None
    weights: Annotated[
        Path | None, Field(description="local state_dict file (.pt/.pth via torch.load weights_only, or .safetensors)")
    ] = None
    num_classes: Annotated[
        int | None,
        Field(ge=1, description="number of classes (torchvision:/factory models: a new, freshly initialised head)"),
    ] = None
    show_blocks: Annotated[bool, Field(description="print the blocks and what each --kp would upload, then stop")] = (
        False
    )
    class_names_file: Annotated[
        Path | None, Field(description="file of the class names, one per line, in class order")
    ] = None
    zoo: ZooOptions = Field(default_factory=ZooOptions)
    sequence: SequenceOptions = Field(default_factory=SequenceOptions)
    options: ExportOptions = Field(default_factory=ExportOptions)

    @model_validator(mode="after")
    def _one_list_of_names(self) -> ExportCommand:
        if self.class_names_file is not None and self.options.class_names:
            raise UsageError("both --class-names and --class-names-file are given", "pass only one of them")
        if self.personal is not None:
            parse_spec(self.personal)  # a malformed spec is refused before any model is built
        return self

    def split(self) -> int | str:
        """What stays personal: the `--personal` spec, else `--kp` (default 2); one line when both are given."""
        return personal_choice(self.kp, self.personal, default_kp=2)
