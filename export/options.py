"""How `edgepfl export` writes a bundle, as one typed model (importable without torch, so the CLI reads it)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from edgepfl.options import OPTIONS
from edgepfl.ortbuild import training_build_installed

ENGINES = ("ort-training", "portable")
OPTIMIZERS = ("sgd", "adamw")


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
