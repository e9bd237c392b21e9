"""`edgepfl export`'s knobs of the text and sensor models (importable without torch, so the CLI reads it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator

from edgepfl.datasets.har import HAR_ACTIVITIES, HAR_CHANNELS, HAR_RATE_HZ, HAR_WINDOW
from edgepfl.kinds import ImageKind, NextWordKind, SampleKind, SensorKind
from edgepfl.options import comma_separated, titled

TEXT_MODELS = ("transformer", "lstm")
SENSOR_MODELS = ("har-cnn",)
SEQUENCE_MODELS = TEXT_MODELS + SENSOR_MODELS
# the kind of sample each sequence model reads; every other model reads images
MODEL_KINDS: dict[str, type[SampleKind]] = {
    **dict.fromkeys(TEXT_MODELS, NextWordKind),
    **dict.fromkeys(SENSOR_MODELS, SensorKind),
}


def kind_read_by(model: str) -> type[SampleKind]:
    """The kind of sample a zoo model reads (images, unless it is a text or sensor model)."""
    return MODEL_KINDS.get(model, ImageKind)


# UCI HAPT, as `--dataset har` reads it: the phone's accelerometer and gyroscope at 50 Hz, windows of 2.56 s, six
# activities; the same channel names, so a har-cnn bundle exported with the defaults reads the dataset's windows
HAPT_CHANNELS, HAPT_WINDOW, HAPT_RATE_HZ = HAR_CHANNELS, HAR_WINDOW, HAR_RATE_HZ
HAPT_ACTIVITIES = len(HAR_ACTIVITIES)


class SequenceOptions(BaseModel):
    """Text and sensor models: the vocabulary's corpus and window (transformer, lstm), the channels (har-cnn)."""

    model_config = titled("Text and sensor models")

    vocab: Annotated[
        Path | None,
        Field(description="UTF-8 corpus whose most frequent words are a text model's vocabulary (one line a text)"),
    ] = None
    vocab_size: Annotated[
        int | None, Field(ge=1, description="words in the vocabulary besides pad/oov/bos/eos (default 10000)")
    ] = None
    seq_len: Annotated[int | None, Field(ge=1, description="tokens a text model reads before a word (default 20)")] = (
        None
    )
    layers: Annotated[
        int | None, Field(ge=1, le=24, description="transformer layers (default 4) or LSTM layers (default 2)")
    ] = None
    channels: Annotated[
        tuple[str, ...] | None,
        Field(
            min_length=1,
            description="comma list of a sensor model's channel names, in input order (default HAPT's six)",
            examples=[",".join(HAPT_CHANNELS)],
        ),
    ] = None
    window: Annotated[int | None, Field(ge=8, description="time steps per sensor window (default 128)")] = None
    rate_hz: Annotated[float | None, Field(gt=0, description="the sensors' sampling rate in Hz (default 50)")] = None
    units: Annotated[
        tuple[str, ...] | None,
        Field(
            min_length=1,
            description="comma list of each channel's unit, as recorded for training (default: g for acc-*, rad/s "
            "for gyro-*: HAPT's); a phone that records for the model converts to them",
            examples=["g,g,g,rad/s,rad/s,rad/s"],
        ),
    ] = None

    @field_validator("channels", "units", mode="before")
    @classmethod
    def _channels(cls, value: Any) -> Any:
        return comma_separated(value)

    def given(self, models: tuple[str, ...] = ("text models", "sensor models")) -> list[str]:
        """The flags that were set among those of `models` (text models: the vocabulary and window; sensor models:
        the channels, window, rate and units)."""
        fields = {
            "text models": ("vocab", "vocab_size", "seq_len", "layers"),
            "sensor models": ("channels", "window", "rate_hz", "units"),
        }
        names = [name for part in models for name in fields[part]]
        return ["--" + name.replace("_", "-") for name in names if getattr(self, name) is not None]
