"""The device <-> server protocol (HTTP, versioned under /v1): names both sides share.

- `GET  /v1/task`                 -> JSON `Task` (train / wait / done)
- `GET  /v1/rounds/{r}/base`      -> safetensors bytes of the base tensors for this device, ETag = sha256
- `POST /v1/rounds/{r}/update`    <- safetensors bytes; `UploadMeta` travels in the safetensors header
                                     metadata (`__metadata__`, string -> string), so one body is one upload
- `POST /v1/rounds/{r}/metrics`   <- JSON `EvalMetrics` of the personalized model after the round
- a secure round's task names `secure_aggregation.url` (`/v1/rounds/{r}/secagg`): the device POSTs `advert`, `shares`,
  `masked` (binary) and `reveal`, and GETs `book`, `inbox` and `unmask` (202 until the step is there) in place
  of POST update (docs/secure-aggregation.md)
- every 4xx/5xx body is JSON `{"error", "detail", "fix"}`
Every call carries `Authorization: Bearer <device token>`.
"""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo

from edgepfl.encoding import Encoding
from edgepfl.errors import UsageError, WireError
from edgepfl.manifest import TensorSpec
from edgepfl.options import FLAG, RENAMED, bounds_of, choices_of, extra_of, optional_inner, titled

API_PREFIX = "/v1"
ALGORITHMS = ("fedsim", "fedalt", "local")
DOWNLOAD_ENCODINGS = ("fp32", "fp16")
# the integer round settings are bounded: epochs and batch sizes beyond these are a server misconfiguration or an
# attack on the device's battery, never a real round; a device refuses them (RoundSettings.problem)
MAX_EPOCHS = 1000
MAX_BATCH = 1 << 20


WIRE = "wire"  # a round setting's json_schema_extra key: "encoding" for a string that names an upload encoding


def _setting(description: str, **constraints: Any) -> Any:
    """A round setting's field: its help (the flag's) and the bounds a device accepts."""
    extra = {key: constraints.pop(key) for key in (FLAG, RENAMED, WIRE) if key in constraints}
    return Field(description=description, json_schema_extra=extra or None, **constraints)


def encoding_label(value: str) -> str:
    """An --upload-encoding value in its one spelling (Encoding.label); a pydantic ValueError for any other."""
    try:
        return Encoding.parse(value).label
    except UsageError as error:
        raise ValueError(f"{error.problem}: {error.fix}") from None


class RoundOptions(BaseModel):
    """Round settings: what every sampled device does in a round (flags of serve, simulate and Flower's run config).

    A new round setting is one field here; the flags, the Flower run config and the browser's contract.json are
    made from these fields, and a device refuses a value outside their bounds.
    """

    model_config = titled("Round settings")

    algorithm: Annotated[
        Literal[ALGORITHMS],
        _setting("what a device trains each round", **{FLAG: "--client-update", RENAMED: ("--algorithm",)}),
    ] = "fedsim"
    epochs: Annotated[int, _setting("local epochs per round", ge=0, le=MAX_EPOCHS)] = 1
    batch_size: Annotated[int, _setting("local batch size", ge=1, le=MAX_BATCH)] = 32
    lr: Annotated[float, _setting("local SGD learning rate", gt=0.0, allow_inf_nan=False)] = 0.01
    finetune_epochs: Annotated[
        int,
        _setting("personal fine-tuning epochs per round, base frozen at round start (FedPer A.3)", ge=0, le=MAX_EPOCHS),
    ] = 0
    personal_epochs: Annotated[int, _setting("fedalt: epochs of the personal phase per round", ge=0, le=MAX_EPOCHS)] = 1
    personal_lr: Annotated[
        float | None,
        _setting("fedalt: SGD learning rate of the personal phase (default: --lr)", gt=0.0, allow_inf_nan=False),
    ] = None
    share_buffers: Annotated[
        bool,
        _setting(
            "BatchNorm statistics of base blocks travel with the base and are averaged",
            **{FLAG: "--share-bn-stats", RENAMED: ("--share-buffers",)},
        ),
    ] = False
    recompute_bn: Annotated[
        bool,
        _setting(
            "a device re-estimates its BatchNorm running statistics on its training data whenever a base arrives "
            "(forward passes, weights unchanged): statistics kept from the old base do not fit the new one"
        ),
    ] = True
    upload_encoding: Annotated[
        str,
        _setting(
            "what a device uploads: fp32 (its trained base), or its base delta as fp16, int8, int8-block<N>, "
            "int8[-block<N>]-sr (stochastic rounding), with error feedback",
            **{WIRE: "encoding"},
        ),
    ] = "fp32"
    download_encoding: Annotated[
        Literal[DOWNLOAD_ENCODINGS], _setting("how a round's base travels to the devices: fp32 (exact) or fp16")
    ] = "fp32"

    _encoding = field_validator("upload_encoding")(encoding_label)

    def settings(self, clip_norm: float | None = None) -> RoundSettings:
        """The settings devices get with these options (with DP, `clip_norm` is the norm they clip their delta to)."""
        return RoundSettings(**self.model_dump(include=set(RoundOptions.model_fields)), clip_norm=clip_norm)


class RoundSettings(RoundOptions):
    """What a device does in one round: the operator's round options and what the strategy adds for each device."""

    model_config = ConfigDict(frozen=True, extra="ignore")  # a newer server may send settings this device ignores

    extra: dict[str, Any] = Field(default_factory=dict)  # strategy-specific knobs (pFedLA, PersFL)
    # shared tensors this device keeps its own value of this round (HeurpFedLA): neither in the base it gets
    # nor in the update it sends
    kept_on_device: tuple[str, ...] = ()
    # DP-FedAvg: the L2 norm a device clips its base delta to (None: no DP); the server refuses a larger one
    clip_norm: Annotated[float | None, Field(gt=0.0, allow_inf_nan=False)] = None

    @property
    def uploads_delta(self) -> bool:
        """Whether a device uploads its encoded base delta (a non-fp32 encoding or DP) instead of its base."""
        return self.upload_encoding != "fp32" or self.clip_norm is not None

    def to_json(self) -> dict[str, Any]:
        """JSON form sent in a task."""
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, data: Any) -> RoundSettings:
        """Parse settings received from a server; raises WireError naming the first field of a wrong type or range."""
        if not isinstance(data, dict):
            raise _bad_settings(f"settings are {type(data).__name__}, not an object")
        known = {k: data[k] for k in cls.model_fields if k in data}
        if isinstance(known.get("kept_on_device"), list):
            known["kept_on_device"] = tuple(known["kept_on_device"])
        for name in ("lr", "clip_norm"):
            if isinstance(known.get(name), int) and not isinstance(known[name], bool):
                known[name] = float(known[name])
        problem = settings_problem(cls, known)
        if problem is not None:
            raise _bad_settings(problem)
        return cls(**known)

    def problem(self) -> str | None:
        """What is wrong with these settings (a type or a bound of a field), or None when they are valid."""
        return settings_problem(type(self), dict(self))

    def travelling(self, shared: list[TensorSpec]) -> list[TensorSpec]:
        """The shared tensors that go to and come back from the device this round: all but kept_on_device."""
        kept = set(self.kept_on_device)
        return [spec for spec in shared if spec.name not in kept]


def settings_problem(model: type[RoundSettings], values: dict[str, Any]) -> str | None:
    """The first field of `values` whose type or range `model` does not allow, in words; None when all are valid.

    Strict where pydantic would convert: a device takes only what a correct server sends (no "3" for 3).
    """
    for name, info in model.model_fields.items():
        if name not in values:
            continue
        value = values[name]
        kind = setting_kind(info)
        if value is None and nullable(info):
            continue
        if kind == "choice":
            choices = choices_of(info)
            if value not in choices:
                return f"{name} {value!r} is not one of {', '.join(choices)}"
        elif kind == "integer":
            low, high = (bounds_of(info).get(key) for key in ("ge", "le"))
            inside = (low is None or low <= value) and (high is None or value <= high) if type(value) is int else False
            if not inside:
                within = f" in {low}..{high}" if low is not None and high is not None else ""
                return f"{name} {value!r} is not an integer{within}"
        elif kind == "number":
            if type(value) is not float or not (math.isfinite(value) and value > 0.0):
                return f"{name} {value!r} is not a positive number"
        elif kind == "boolean":
            if type(value) is not bool:
                return f"{name} {value!r} is not true or false"
        elif kind == "text":
            if type(value) is not str:
                return f"{name} {value!r} is not text"
        elif kind == "object":
            if not isinstance(value, dict):
                return f"{name} {value!r} is not an object"
        elif kind == "names":
            if not isinstance(value, tuple) or not all(isinstance(item, str) for item in value):
                return f"{name} {value!r} is not a list of tensor names"
        elif kind == "encoding":
            try:
                Encoding.parse(value)
            except (UsageError, AttributeError):
                return f"{name} {value!r} is not fp32, fp16, int8, int8-block<N> or int8[...]-sr"
    return None


def setting_kind(info: FieldInfo) -> str:
    """How a round setting is typed on the wire: choice, integer, number, boolean, encoding (a string marked so),
    text, object or names (the browser's contract.json says the same; `nullable` says whether null is allowed too).
    TypeError for a type no device reads, as the contract refuses it."""
    if choices_of(info):
        return "choice"
    if extra_of(info).get(WIRE) == "encoding":
        return "encoding"
    annotation = optional_inner(info.annotation)
    origin = typing.get_origin(annotation)
    for python, kind in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "text"), (dict, "object")):
        if (origin or annotation) is python:
            return kind
    if origin is tuple and typing.get_args(annotation)[:1] == (str,):
        return "names"
    raise TypeError(f"round setting type {info.annotation!r} has no form a device reads")


def nullable(info: FieldInfo) -> bool:
    """Whether a round setting may be null (`X | None`)."""
    return optional_inner(info.annotation) is not info.annotation


@dataclass(frozen=True)
class UploadMeta:
    """Metadata of one update upload, carried in the safetensors header."""

    base_layout_hash: str
    num_samples: int
    train_loss: float = float("nan")
    val_accuracy: float = float("nan")  # held-out accuracy after the round's local training (trained)
    val_loss: float = float("nan")
    # held-out accuracy of the model the device held when the round began: the round's base with its own part
    # and re-estimated BatchNorm statistics, i.e. the held model of the round before (evaluation.py)
    start_val_accuracy: float = float("nan")

    def to_metadata(self) -> dict[str, str]:
        """String map for safetensors `__metadata__`."""
        return {key: str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None, max_samples: int = 10**9) -> UploadMeta:
        """Parse and bound-check upload metadata; raises WireError naming the bad field."""
        metadata = metadata or {}
        if "base_layout_hash" not in metadata:
            raise WireError("upload metadata lacks base_layout_hash", "quote the manifest's base_layout_hash")
        raw = metadata.get("num_samples")
        try:
            num_samples = int(raw) if raw is not None else None
        except ValueError:
            num_samples = None
        if num_samples is None or not 0 < num_samples <= max_samples:
            raise WireError(
                f"upload num_samples {raw!r} is not a count in 1..{max_samples}",
                "send the number of local training samples",
            )
        floats = {}
        for key in ("train_loss", "val_accuracy", "val_loss", "start_val_accuracy"):
            try:
                floats[key] = float(metadata.get(key, "nan"))
            except ValueError:
                raise WireError(f"upload metadata {key} is not a number", "send a decimal number") from None
        for key in ("val_accuracy", "start_val_accuracy"):
            if not math.isnan(floats[key]) and not 0.0 <= floats[key] <= 1.0:
                raise WireError(f"upload {key} is outside [0, 1]", "send accuracy as a fraction")
        return cls(metadata["base_layout_hash"], num_samples, **floats)


TASK_ACTIONS = ("train", "wait", "done")


@dataclass(frozen=True)
class SecureTask:
    """A secure round (docs/secure-aggregation.md): where its protocol steps are, and who the device is in them."""

    url: str  # the steps' routes: URL/advert, URL/book, URL/shares, URL/inbox, URL/masked, URL/unmask, URL/reveal
    device: str  # the device's id in the key book: a keyed hash of its name (other devices never learn names)
    context: str  # the round's context, which its keys and shares are bound to

    @classmethod
    def from_json(cls, data: Any) -> SecureTask:
        """Parse a task's `secure_aggregation`; ValueError naming what is wrong."""
        fields = ("url", "device", "context")
        if not isinstance(data, dict) or not all(isinstance(data.get(key), str) for key in fields):
            raise ValueError(f"secure_aggregation {data!r} is not an object of url, device and context")
        return cls(data["url"], data["device"], data["context"])


@dataclass(frozen=True)
class Task:
    """The server's answer to `GET /v1/task`: train in a round, wait and poll again, or stop."""

    action: str  # train | wait | done
    base_layout_hash: str
    round_id: int | None = None  # JSON key "round"
    settings: RoundSettings | None = None
    base_url: str | None = None  # where to GET the base tensors (for "done": the final base)
    deadline: float | None = None  # unix seconds after which an upload for this round is refused
    retry_after: float | None = None  # seconds to wait before polling again
    # a secure round: the device masks its update through these steps instead of uploading it (a task of a round
    # that is not secure has no such key)
    secure_aggregation: SecureTask | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON form sent by the server."""
        data = {
            "action": self.action,
            "round": self.round_id,
            "settings": self.settings.to_json() if self.settings is not None else None,
            "base_url": self.base_url,
            "deadline": self.deadline,
            "retry_after": self.retry_after,
            "base_layout_hash": self.base_layout_hash,
        }
        if self.secure_aggregation is not None:
            data["secure_aggregation"] = asdict(self.secure_aggregation)
        return data

    @classmethod
    def from_json(cls, data: Any) -> Task:
        """Parse a task received from the server; raises WireError naming what makes it not one."""
        if not isinstance(data, dict):
            raise WireError(f"the server's task is {type(data).__name__}, not a JSON object", "check --server")
        try:
            action = data["action"]
            if action not in TASK_ACTIONS:
                raise ValueError(f"unknown action {action!r}")
            settings = data.get("settings")
            round_id = data.get("round")
            base_url = data.get("base_url")
            if round_id is not None and (type(round_id) is not int or round_id < 0):
                raise ValueError(f"round {round_id!r} is not a round number")
            if base_url is not None and not isinstance(base_url, str):
                raise ValueError(f"base_url {base_url!r} is not a URL")
            secure = data.get("secure_aggregation")
            task = cls(
                secure_aggregation=SecureTask.from_json(secure) if secure is not None else None,
                action=action,
                base_layout_hash=str(data["base_layout_hash"]),
                round_id=round_id,
                settings=RoundSettings.from_json(settings) if settings is not None else None,
                base_url=base_url,
                deadline=_seconds(data.get("deadline"), "deadline"),
                retry_after=_seconds(data.get("retry_after"), "retry_after"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            detail = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise WireError(f"the server's task is malformed ({detail})", "use a matching edgepfl version") from None
        return task


def _seconds(value: Any, name: str) -> float | None:
    """A time in seconds from a task: a finite number >= 0, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} {value!r} is not a number of seconds >= 0")
    return float(value)


def _bad_settings(problem: str) -> WireError:
    return WireError(
        f"the server's round settings are invalid: {problem}",
        "ask the operator to check the server's round settings, or use a matching edgepfl version",
    )


@dataclass(frozen=True)
class EvalMetrics:
    """Evaluation of the personalized model after a round (`POST /v1/rounds/{r}/metrics`, JSON)."""

    accuracy: float  # fraction in [0, 1]
    num_samples: int  # evaluation samples
    loss: float | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON form sent by a device."""
        return asdict(self)

    def check(self, max_samples: int = 10**9) -> None:
        """Bound-check the values; raises WireError naming the bad field."""
        if not (math.isfinite(self.accuracy) and 0.0 <= self.accuracy <= 1.0):
            raise WireError("metrics accuracy is outside [0, 1]", "send accuracy as a fraction")
        if not 0 < self.num_samples <= max_samples:
            raise WireError(
                f"metrics num_samples {self.num_samples} is not a count in 1..{max_samples}",
                "send the number of evaluation samples",
            )
        if self.loss is not None and not (math.isfinite(self.loss) and self.loss >= 0.0):
            raise WireError("metrics loss is negative, NaN or Inf", "send the mean evaluation loss or null")
