"""The device <-> server protocol (HTTP, versioned under /v1): names both sides share.

- `GET  /v1/task`                 -> JSON `Task` (train / wait / done)
- `GET  /v1/rounds/{r}/base`      -> safetensors bytes of the base tensors for this device, ETag = sha256
- `POST /v1/rounds/{r}/update`    <- safetensors bytes; `UploadMeta` travels in the safetensors header
                                     metadata (`__metadata__`, string -> string), so one body is one upload
- `POST /v1/rounds/{r}/metrics`   <- JSON `EvalMetrics` of the personalized model after the round
- every 4xx/5xx body is JSON `{"error", "detail", "fix"}`
Every call carries `Authorization: Bearer <device token>`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from edgepfl.encoding import Encoding
from edgepfl.errors import UsageError, WireError
from edgepfl.manifest import TensorSpec

API_PREFIX = "/v1"
ALGORITHMS = ("fedsim", "fedalt", "local")
DOWNLOAD_ENCODINGS = ("fp32", "fp16")
# bounds of the integer round settings a device accepts; the server must not send more (epochs and batch
# size beyond these are a server misconfiguration or an attack on the device's battery, never a real round)
SETTINGS_LIMITS = {
    "epochs": (0, 1000),
    "finetune_epochs": (0, 1000),
    "personal_epochs": (0, 1000),
    "batch_size": (1, 1 << 20),
}
SETTINGS_CHOICES = {"algorithm": ALGORITHMS, "download_encoding": DOWNLOAD_ENCODINGS}
# round settings that are finite numbers above 0; one whose default is None (clip_norm: no DP) may also be None
POSITIVE_SETTINGS = ("lr", "clip_norm")


@dataclass(frozen=True)
class RoundSettings:
    """What a device does in one round; chosen by the server's strategy, run by the device runtime."""

    # each field's help (metadata "help") is the help of the flag that sets it (edgepfl.options.settings_field)
    algorithm: str = field(default="fedsim", metadata={"help": "what a device trains each round"})
    epochs: int = field(default=1, metadata={"help": "local epochs per round"})
    batch_size: int = field(default=32, metadata={"help": "local batch size"})
    lr: float = field(default=0.01, metadata={"help": "local SGD learning rate"})
    finetune_epochs: int = field(
        default=0, metadata={"help": "personal fine-tuning epochs per round, base frozen at round start (FedPer A.3)"}
    )
    personal_epochs: int = field(default=1, metadata={"help": "fedalt: epochs of the personal phase per round"})
    share_buffers: bool = field(
        default=False, metadata={"help": "BatchNorm statistics of base blocks travel with the base and are averaged"}
    )
    recompute_bn: bool = field(
        default=True,
        metadata={
            "help": "a device re-estimates its BatchNorm running statistics on its training data whenever a base "
            "arrives (forward passes, weights unchanged): statistics kept from the old base do not fit the new one"
        },
    )
    extra: dict[str, Any] = field(default_factory=dict)  # strategy-specific knobs (pFedLA, PersFL)
    # shared tensors this device keeps its own value of this round (HeurpFedLA): neither in the base it gets
    # nor in the update it sends
    kept_on_device: tuple[str, ...] = ()
    upload_encoding: str = field(
        default="fp32",
        metadata={
            "help": "what a device uploads: fp32 (its trained base), or its base delta as fp16, int8, "
            "int8-block<N>, int8[-block<N>]-sr (stochastic rounding), with error feedback"
        },
    )
    download_encoding: str = field(
        default="fp32", metadata={"help": "how a round's base travels to the devices: fp32 (exact) or fp16"}
    )
    # DP-FedAvg: the L2 norm a device clips its base delta to (None: no DP); the server refuses a larger one
    clip_norm: float | None = None

    @property
    def uploads_delta(self) -> bool:
        """Whether a device uploads its encoded base delta (a non-fp32 encoding or DP) instead of its base."""
        return self.upload_encoding != "fp32" or self.clip_norm is not None

    def to_json(self) -> dict[str, Any]:
        """JSON form sent in a task."""
        return {**asdict(self), "kept_on_device": list(self.kept_on_device)}

    @classmethod
    def from_json(cls, data: Any) -> RoundSettings:
        """Parse settings received from a server; raises WireError naming the first field of a wrong type or range."""
        if not isinstance(data, dict):
            raise _bad_settings(f"settings are {type(data).__name__}, not an object")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        if isinstance(known.get("kept_on_device"), list):
            known["kept_on_device"] = tuple(known["kept_on_device"])
        for name in POSITIVE_SETTINGS:
            if isinstance(known.get(name), int) and not isinstance(known[name], bool):
                known[name] = float(known[name])
        settings = cls(**known)
        problem = settings.problem()
        if problem is not None:
            raise _bad_settings(problem)
        return settings

    def problem(self) -> str | None:
        """What is wrong with these settings (a type or a bound, see SETTINGS_LIMITS), or None when they are valid."""
        for name, choices in SETTINGS_CHOICES.items():
            if getattr(self, name) not in choices:
                return f"{name} {getattr(self, name)!r} is not one of {', '.join(choices)}"
        for name, (low, high) in SETTINGS_LIMITS.items():
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                return f"{name} {value!r} is not an integer in {low}..{high}"
        for name in POSITIVE_SETTINGS:
            value = getattr(self, name)
            if value is None and self.__dataclass_fields__[name].default is None:
                continue
            if type(value) is not float or not (math.isfinite(value) and value > 0.0):
                return f"{name} {value!r} is not a positive number"
        for name in ("share_buffers", "recompute_bn"):
            if type(getattr(self, name)) is not bool:
                return f"{name} {getattr(self, name)!r} is not true or false"
        if not isinstance(self.extra, dict):
            return f"extra {self.extra!r} is not an object"
        if not isinstance(self.kept_on_device, tuple) or not all(isinstance(n, str) for n in self.kept_on_device):
            return f"kept_on_device {self.kept_on_device!r} is not a list of tensor names"
        try:
            Encoding.parse(self.upload_encoding)
        except (UsageError, AttributeError):
            return f"upload_encoding {self.upload_encoding!r} is not fp32, fp16, int8, int8-block<N> or int8[...]-sr"
        return None

    def travelling(self, shared: list[TensorSpec]) -> list[TensorSpec]:
        """The shared tensors that go to and come back from the device this round: all but kept_on_device."""
        kept = set(self.kept_on_device)
        return [spec for spec in shared if spec.name not in kept]


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
class Task:
    """The server's answer to `GET /v1/task`: train in a round, wait and poll again, or stop."""

    action: str  # train | wait | done
    base_layout_hash: str
    round_id: int | None = None  # JSON key "round"
    settings: RoundSettings | None = None
    base_url: str | None = None  # where to GET the base tensors (for "done": the final base)
    deadline: float | None = None  # unix seconds after which an upload for this round is refused
    retry_after: float | None = None  # seconds to wait before polling again

    def to_json(self) -> dict[str, Any]:
        """JSON form sent by the server."""
        return {
            "action": self.action,
            "round": self.round_id,
            "settings": self.settings.to_json() if self.settings is not None else None,
            "base_url": self.base_url,
            "deadline": self.deadline,
            "retry_after": self.retry_after,
            "base_layout_hash": self.base_layout_hash,
        }

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
            task = cls(
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
