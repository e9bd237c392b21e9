"""The device commands' options as typed models: each default, bound, choice and help text is written once here.

`edgepfl device …` makes its flags from these fields (edgepfl/options.py `flag`) and its values into these
models through `validated`, so a bad value is one line naming the flag. Library callers build them directly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from edgepfl.device_runtime.engine import ENGINE_NAMES
from edgepfl.device_runtime.persfl import VARIANTS, DistillConfig
from edgepfl.manifest import TRAINABLE_SETS
from edgepfl.options import ARGUMENT, FLAG, GROUP, OPTIONS, Composed, comma_separated, titled

POSITIVE = {"gt": 0.0, "allow_inf_nan": False}
_DISTILL = {item.name: item.default for item in dataclasses.fields(DistillConfig)}


class LocalOptions(BaseModel):
    """Which engine trains, how the device's data is split into train and held-out, and how many threads."""

    model_config = titled("Engine and data")

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

    model_config = titled("Connection")

    retries: Annotated[int, Field(ge=1, le=100, description="tries per request on connection errors and 5xx")] = 8
    timeout: Annotated[float, Field(le=3600.0, description="seconds per request", **POSITIVE)] = 60.0


class DeviceOptions(BaseModel):
    """How `edgepfl device run` takes part in rounds; made at the CLI edge."""

    model_config = titled("Rounds")

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

    model_config = titled("Training")

    epochs: Annotated[int, Field(ge=1, le=10_000, description="local epochs")] = 1
    trainable: Annotated[
        Literal[TRAINABLE_SETS],  # type: ignore[valid-type]
        Field(description="what trains: all, personal (fine-tuning, base frozen) or base"),
    ] = "full"
    lr: Annotated[float, Field(description="SGD learning rate", **POSITIVE)] = 0.01
    batch_size: Annotated[int, Field(ge=1, le=65_536, description="batch size")] = 32


class DistillOptions(BaseModel):
    """`edgepfl device distill`: PersFL stage 2's grid and training, defaults from DistillConfig."""

    model_config = titled("PersFL stage 2")

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
    batch_size: Annotated[int | None, Field(ge=1, description="batch size (default: the bundle's portable batch)")] = (
        _DISTILL["batch_size"]
    )
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

    model_config = titled("Prediction")

    top: Annotated[int, Field(ge=1, le=1000, description="classes shown per input, most likely first")] = 3
    text: Annotated[
        str | None, Field(description="a phrase: a text bundle's most likely next words (instead of input files)")
    ] = None


class ModelExportOptions(BaseModel):
    """`edgepfl device export-model`: the inference model's number format, and int8's calibration."""

    model_config = titled("Model file")

    quantize: Annotated[
        Literal["none", "int8"],
        Field(description="int8: onnxruntime's static QDQ quantization, calibrated on --data (under 0.3x the size)"),
    ] = "none"
    calibration_samples: Annotated[
        int, Field(ge=1, le=100_000, description="training images that calibrate int8's activation ranges")
    ] = 512


# what the device commands are told: each is a tree of the models above and these (edgepfl.commands makes the flags)

ENVVAR = "envvar"  # json_schema_extra key: an environment variable that gives the flag's value


class DeviceFiles(BaseModel):
    """The device's bundle, data and state folder."""

    model_config = titled("Files")

    bundle: Annotated[Path, Field(description="bundle folder written by `edgepfl export`", examples=["DIR"])]
    data: Annotated[
        Path,
        Field(
            description=".npz with x and y, or an image folder with one sub-folder per class; a text bundle: a UTF-8 "
            ".txt; a sensor bundle: .npz (x, y, channels) or .csv windows (docs/device.md)",
            examples=["DIR"],
        ),
    ]
    state: Annotated[
        Path,
        Field(description="device state folder (personal tensors, last round); reuse it to resume", examples=["DIR"]),
    ]


class ServerAccess(BaseModel):
    """The server and this device's token."""

    model_config = titled("Server")

    server: Annotated[str, Field(description="server URL, e.g. http://192.168.1.10:8080", examples=["URL"])]
    token: Annotated[
        str | None,
        Field(
            description="device token from `edgepfl serve tokens add` (or use --token-file)",
            json_schema_extra={ENVVAR: "EDGEPFL_TOKEN"},
            repr=False,
        ),
    ] = None
    token_file: Annotated[
        Path | None, Field(description="file holding the device token, e.g. written by `edgepfl device enroll`")
    ] = None


class Output(BaseModel):
    """How the result is printed."""

    model_config = titled("Output")

    as_json: Annotated[bool, Field(description="print the result as JSON only", json_schema_extra={FLAG: "--json"})] = (
        False
    )


class EnrollCommand(Composed):
    """`edgepfl device enroll`."""

    model_config = titled("Enrollment")

    server: str = ServerAccess.model_fields["server"]
    name: Annotated[str, Field(description="this device's name (1-64 letters, digits, . _ -)", examples=["phone-1"])]
    secret_file: Annotated[Path, Field(description="file holding the server's shared enrollment secret")]
    token_file: Annotated[
        Path | None, Field(description="write the token to this new file (0600) instead of printing it")
    ] = None
    connection: Annotated[ConnectionOptions, Field(json_schema_extra={GROUP: {"exclude": ["retries"]}})] = (
        ConnectionOptions()
    )


class RunCommand(Composed):
    """`edgepfl device run`."""

    model_config = OPTIONS

    files: DeviceFiles
    access: ServerAccess
    local: LocalOptions = LocalOptions()
    connection: ConnectionOptions = ConnectionOptions()
    # its shuffling seed is --seed, the data split's (LocalOptions)
    device: Annotated[DeviceOptions, Field(json_schema_extra={GROUP: {"exclude": ["seed"]}})] = DeviceOptions()
    output: Output = Output()


class TrainCommand(Composed):
    """`edgepfl device train`."""

    model_config = OPTIONS

    files: DeviceFiles
    train: TrainOptions = TrainOptions()
    local: LocalOptions = LocalOptions()
    output: Output = Output()


class TeacherCommand(Composed):
    """`edgepfl device teacher`."""

    model_config = OPTIONS

    files: DeviceFiles
    access: ServerAccess
    local: LocalOptions = LocalOptions()
    connection: ConnectionOptions = ConnectionOptions()
    output: Output = Output()


class DistillCommand(Composed):
    """`edgepfl device distill`."""

    model_config = OPTIONS

    files: DeviceFiles
    distill: DistillOptions = DistillOptions()
    local: LocalOptions = LocalOptions()
    output: Output = Output()


class EvalCommand(Composed):
    """`edgepfl device eval`."""

    model_config = OPTIONS

    files: DeviceFiles
    local: LocalOptions = LocalOptions()
    output: Output = Output()


class StatusCommand(Composed):
    """`edgepfl device status`."""

    model_config = OPTIONS

    state: Path = DeviceFiles.model_fields["state"]
    output: Output = Output()


class ModelFiles(BaseModel):
    """The device's bundle and state folder."""

    model_config = titled("Files")

    bundle: Path = DeviceFiles.model_fields["bundle"]
    state: Path = DeviceFiles.model_fields["state"]


class PredictCommand(Composed):
    """`edgepfl device predict`."""

    model_config = OPTIONS

    inputs: Annotated[
        list[Path],
        Field(
            description="image files, folders of images, or .npz files (images, or a text or sensor bundle's "
            "windows, as x)",
            json_schema_extra={ARGUMENT: True},
        ),
    ] = []
    files: ModelFiles
    predict: PredictOptions = PredictOptions()
    # nothing is split or shuffled: the inputs are predicted as they are
    local: Annotated[LocalOptions, Field(json_schema_extra={GROUP: {"exclude": ["val_fraction", "seed"]}})] = (
        LocalOptions()
    )
    output: Output = Output()


class ExportModelCommand(Composed):
    """`edgepfl device export-model`."""

    model_config = OPTIONS

    files: ModelFiles
    out: Annotated[Path, Field(description="the .onnx file to write", examples=["model.onnx"])]
    data: Annotated[
        Path | None,
        Field(description="the device's data (.npz or image folder): calibrates int8, measures accuracy"),
    ] = None
    export: ModelExportOptions = ModelExportOptions()
    local: LocalOptions = LocalOptions()
    output: Output = Output()
