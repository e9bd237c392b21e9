"""The device commands' options as typed models: each default, bound, choice and help text is written once here.

`edgepfl device …` makes its flags from these fields (edgepfl/options.py `flag`) and its values into these
models through `validated`, so a bad value is one line naming the flag. Library callers build them directly.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from edgepfl.device_runtime.engine import ENGINE_NAMES
from edgepfl.device_runtime.persfl import VARIANTS, DistillConfig
from edgepfl.manifest import TRAINABLE_SETS
from edgepfl.options import FLAG, OPTIONS, comma_separated

POSITIVE = {"gt": 0.0, "allow_inf_nan": False}
_DISTILL = {item.name: item.default for item in dataclasses.fields(DistillConfig)}


class LocalOptions(BaseModel):
    """Which engine trains, how the device's data is split into train and held-out, and how many threads."""

    model_config = OPTIONS

    engine: Annotated[
        Literal[("auto", *ENGINE_NAMES)],  # type: ignore[valid-type]
        Field(description="training engine (auto: ort-training where installed, else portable)"),
    ] = "auto"
    val_fraction: Annotated[
        float, Field(ge=0.0, lt=1.0, description="fraction of the data held out for evaluation")
    ] = 0.2
    seed: Annotated[int, Field(ge=0, description="seed of the train/held-out split and of batch shuffling")] = 0
    threads: Annotated[int | None, Field(ge=1, description="ONNX Runtime threads (default: ORT's choice)")] = None


class ConnectionOptions(BaseModel):
    """How patiently the device talks to the server."""

    model_config = OPTIONS

    retries: Annotated[int, Field(ge=1, le=100, description="tries per request on connection errors and 5xx")] = 8
    timeout: Annotated[float, Field(le=3600.0, description="seconds per request", **POSITIVE)] = 60.0


class DeviceOptions(BaseModel):
    """How `edgepfl device run` takes part in rounds; made at the CLI edge."""

    model_config = OPTIONS

    seed: Annotated[int, Field(ge=0, description="shuffling seed (the held-out split has its own, in LocalData)")] = 0
    max_rounds: Annotated[
        int | None,
        Field(ge=1, description="stop after training this many rounds", json_schema_extra={FLAG: "--rounds"}),
    ] = None
    poll_interval: Annotated[
        float, Field(le=3600.0, description="seconds between polls when the server gives none", **POSITIVE)
    ] = 5.0
    persfl_teacher: Annotated[
        bool, Field(description="PersFL stage 1: keep the round's global model with the lowest held-out loss")
    ] = False


class TrainOptions(BaseModel):
    """`edgepfl device train`: local training without a server."""

    model_config = OPTIONS

    epochs: Annotated[int, Field(ge=1, le=10_000, description="local epochs")] = 1
    trainable: Annotated[
        Literal[TRAINABLE_SETS],  # type: ignore[valid-type]
        Field(description="what trains: all, personal (fine-tuning, base frozen) or base"),
    ] = "full"
    lr: Annotated[float, Field(description="SGD learning rate", **POSITIVE)] = 0.01
    batch_size: Annotated[int, Field(ge=1, le=65_536, description="batch size")] = 32


class DistillOptions(BaseModel):
    """`edgepfl device distill`: PersFL stage 2's grid and training, defaults from DistillConfig."""

    model_config = OPTIONS

    lambdas: Annotated[
        tuple[float, ...],
        Field(description="comma-separated λ grid (weight of the teacher term)", examples=["0.1,0.5"]),
    ] = tuple(_DISTILL["lambdas"])
    temperatures: Annotated[
        tuple[float, ...], Field(description="comma-separated temperature grid", examples=["1,2,4"])
    ] = tuple(_DISTILL["temperatures"])
    variant: Annotated[Literal[VARIANTS], Field(description="kd (PersFL) or gd (PersFL-GD)")] = _DISTILL["variant"]  # type: ignore[valid-type]
    epochs: Annotated[int, Field(ge=1, description="local epochs per grid point")] = _DISTILL["epochs"]
    lr: Annotated[float, Field(description="SGD learning rate", **POSITIVE)] = _DISTILL["lr"]
    batch_size: Annotated[
        int | None, Field(ge=1, description="batch size (default: the bundle's portable batch)")
    ] = _DISTILL["batch_size"]
    trainable: Annotated[
        Literal["full", "personal"], Field(description="what the student trains (personal: base frozen)")
    ] = _DISTILL["trainable"]

    @field_validator("lambdas", "temperatures", mode="before")
    @classmethod
    def _grid(cls, value: Any) -> Any:
        return comma_separated(value)

    def config(self, seed: int) -> DistillConfig:
        """The DistillConfig these options and `seed` describe (it checks the grid's values)."""
        return DistillConfig(**self.model_dump(), seed=seed)


class PredictOptions(BaseModel):
    """`edgepfl device predict`: how many classes each input shows."""

    model_config = OPTIONS

    top: Annotated[int, Field(ge=1, le=1000, description="classes shown per input, most likely first")] = 3


class ModelExportOptions(BaseModel):
    """`edgepfl device export-model`: the inference model's number format, and int8's calibration."""

    model_config = OPTIONS

    quantize: Annotated[
        Literal["none", "int8"],
        Field(description="int8: onnxruntime's static QDQ quantization, calibrated on --data (under 0.3x the size)"),
    ] = "none"
    calibration_samples: Annotated[
        int, Field(ge=1, le=100_000, description="training images that calibrate int8's activation ranges")
    ] = 512
