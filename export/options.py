"""How `edgepfl export` writes a bundle, as one typed model (importable without torch, so the CLI reads it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from edgepfl.errors import UsageError
from edgepfl.manifest import class_names_problem
from edgepfl.options import OPTIONS
from edgepfl.ortbuild import training_build_installed

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
    """How to export: which engines, which optimizer for ORT training, the init seed, PersFL's distillation graphs."""

    model_config = OPTIONS

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
