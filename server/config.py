"""The server's configuration: one typed model per concern, made at the CLI edge and passed down.

Each field's default, bounds, choices and help live here (or, for a strategy's own knobs, in that strategy's
file; for what a device does in a round, in `edgepfl.protocol.RoundSettings`); `edgepfl serve` builds its
flags from them (`edgepfl.options.flag`), so no default or help text is written twice.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, InstanceOf, field_validator, model_validator

from edgepfl.credentials import read_secret_file
from edgepfl.encoding import Encoding
from edgepfl.errors import UsageError
from edgepfl.options import FLAG, OPTIONS, settings_field
from edgepfl.privacy import DPConfig, check_dp_strategy
from edgepfl.protocol import ALGORITHMS, DOWNLOAD_ENCODINGS, RoundSettings
from edgepfl.server.strategies import STRATEGIES
from edgepfl.server.strategies.heurpfedla import HeurPFedLAOptions
from edgepfl.server.strategies.pfedla import PFedLAOptions
from edgepfl.server.strategies.trimmed_mean import TrimmedMeanOptions

MIN_ENROLL_SECRET = 16  # characters; shorter shared secrets are refused at start


def encoding_label(value: str) -> str:
    """An --upload-encoding value in its one spelling (Encoding.label); a pydantic ValueError for any other."""
    try:
        return Encoding.parse(value).label
    except UsageError as error:
        raise ValueError(f"{error.problem}: {error.fix}") from None


class RoundOptions(BaseModel):
    """The round settings `edgepfl serve` hands out (defaults, bounds and help from RoundSettings)."""

    model_config = OPTIONS

    algorithm: Literal[ALGORITHMS] = settings_field("algorithm", flag="--client-update")
    epochs: int = settings_field("epochs")
    batch_size: int = settings_field("batch_size")
    lr: float = settings_field("lr")
    finetune_epochs: int = settings_field("finetune_epochs")
    personal_epochs: int = settings_field("personal_epochs")
    share_buffers: bool = settings_field("share_buffers", flag="--share-bn-stats")
    recompute_bn: bool = settings_field("recompute_bn")
    upload_encoding: str = settings_field("upload_encoding")
    download_encoding: Literal[DOWNLOAD_ENCODINGS] = settings_field("download_encoding")  # type: ignore[valid-type]

    _encoding = field_validator("upload_encoding")(encoding_label)

    def settings(self, privacy: PrivacyOptions | None = None) -> RoundSettings:
        """The RoundSettings these options make (with DP, the clip norm devices clip their delta to); a model that
        extends these options keeps its other fields out."""
        clip = privacy.dp_clip if privacy is not None and privacy.enabled else None
        return RoundSettings(**self.model_dump(include=set(RoundOptions.model_fields)), clip_norm=clip)


class PrivacyOptions(BaseModel):
    """User-level DP-FedAvg (McMahan et al. 2018): clip on the device, Gaussian noise on the server's sum."""

    model_config = OPTIONS

    dp_noise_multiplier: Annotated[
        float | None,
        Field(gt=0.0, allow_inf_nan=False, description="DP: noise sigma, in units of the clip norm; turns DP on"),
    ] = None
    dp_clip: Annotated[
        float | None,
        Field(gt=0.0, allow_inf_nan=False, description="DP: L2 norm C each device clips its base delta to"),
    ] = None
    dp_delta: Annotated[
        float, Field(gt=0.0, lt=1.0, description="DP: the delta epsilon is reported at (below 1/devices)")
    ] = 1e-5
    dp_target_epsilon: Annotated[
        float | None,
        Field(gt=0.0, allow_inf_nan=False, description="DP: stop before a round would take epsilon above this"),
    ] = None

    @model_validator(mode="after")
    def _together(self) -> PrivacyOptions:
        if (self.dp_noise_multiplier is None) != (self.dp_clip is None):
            raise UsageError(
                "--dp-noise-multiplier and --dp-clip go together",
                "pass both to turn differential privacy on, e.g. --dp-noise-multiplier 1.0 --dp-clip 1.0",
            )
        if self.dp_target_epsilon is not None and not self.enabled:
            raise UsageError("--dp-target-epsilon needs DP on", "pass --dp-noise-multiplier and --dp-clip too")
        return self

    @property
    def enabled(self) -> bool:
        """Whether DP-FedAvg is on."""
        return self.dp_noise_multiplier is not None

    def dp_config(self) -> DPConfig | None:
        """The privacy module's settings (None: DP off)."""
        if self.dp_noise_multiplier is None or self.dp_clip is None:
            return None
        return DPConfig(self.dp_noise_multiplier, self.dp_clip, self.dp_delta, self.dp_target_epsilon)


class StrategyOptions(TrimmedMeanOptions, PFedLAOptions, HeurPFedLAOptions):
    """What a strategy is told at construction: the round settings it hands out and every strategy's own knobs."""

    settings: InstanceOf[RoundSettings] = Field(default_factory=RoundSettings)
    seed: int = 0  # strategies that draw random numbers (pfedla's hypernetwork initialisation): the server's --seed


class ServerConfig(BaseModel):
    """Everything `edgepfl serve` was told about rounds and devices; the engine and the HTTP app read only this."""

    model_config = OPTIONS

    bundle: Path
    state: Path
    strategy: Literal[tuple(STRATEGIES)] = Field(  # type: ignore[valid-type]
        "fedper", description="how accepted uploads become the next global base"
    )
    rounds: Annotated[int, Field(ge=1, description="rounds to aggregate, then tell devices 'done'")] = 100
    min_clients: Annotated[
        int, Field(ge=1, description="devices needed to open a round and to close it at its deadline")
    ] = 2
    fraction: Annotated[
        float, Field(gt=0.0, le=1.0, description="fraction of available devices sampled per round")
    ] = 1.0
    round_timeout: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="seconds from a round's opening to its deadline")
    ] = 600.0
    max_upload_mb: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="largest accepted upload body, in MiB")
    ] = 64.0
    max_samples: Annotated[
        int, Field(ge=1, description="largest sample count an upload may claim (larger ones are refused as absurd)")
    ] = 10_000_000
    seed: Annotated[int, Field(description="seed of device sampling (and of pfedla's hypernetworks)")] = 0
    init: Annotated[
        Path | None, Field(description="initial base tensors (default: BUNDLE/portable/initial.safetensors)")
    ] = None
    poll_interval: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="retry_after told to waiting devices (seconds)")
    ] = 5.0
    available_for: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="a device is available this long after it polls (s)")
    ] = 60.0
    upload_slots: Annotated[
        int, Field(ge=1, description="uploads decoded and checked at once (memory stays O(slots x model))")
    ] = 4
    public_status: Annotated[bool, Field(description="/, /plot.png and /v1/status need no token")] = False
    history: Annotated[
        int, Field(ge=0, description="closed rounds whose global model is kept for new participants; 0 keeps all")
    ] = 0
    enroll_secret: Annotated[str | None, Field(repr=False)] = None  # POST /v1/enroll is open while set; never stored
    enroll_max_failures: Annotated[
        int, Field(ge=1, description="wrong enrollment secrets from one address before it gets 429 (--enroll-window)")
    ] = 10
    enroll_window: Annotated[
        int, Field(ge=1, description="seconds over which --enroll-max-failures are counted (a sliding window)")
    ] = 600
    clip_multiple: Annotated[
        float,
        Field(
            ge=0.0,
            allow_inf_nan=False,
            description="clip each update's delta to this many times the round's median delta norm; 0: off",
        ),
    ] = 3.0
    weight_multiple: Annotated[
        float,
        Field(
            ge=0.0,
            allow_inf_nan=False,
            description="cap each claimed sample count at this many times the round's median; 0: off",
        ),
    ] = 2.0
    strategy_options: StrategyOptions = Field(default_factory=StrategyOptions)
    privacy: PrivacyOptions = Field(default_factory=PrivacyOptions)
    web: Annotated[
        bool,
        Field(
            description="serve the browser device page (/device/) and the join link (/join)",
            json_schema_extra={FLAG: "--web/--no-web"},
        ),
    ] = True

    @field_validator("clip_multiple", "weight_multiple")
    @classmethod
    def _off_or_at_least_one(cls, value: float) -> float:
        if 0.0 < value < 1.0:
            raise ValueError("must be 0 (off) or at least 1 (times the round's median)")
        return value

    @model_validator(mode="after")
    def _rounds_can_open(self) -> ServerConfig:
        clients = self.strategy_options.clients
        if clients and self.min_clients > clients:
            raise UsageError(
                f"--min-clients {self.min_clients} is more than the {clients} clients of --pfedla-clients, "
                "so no round could open",
                f"pass --min-clients {clients} or less",
            )
        settings = self.strategy_options.settings
        if self.privacy.enabled:
            check_dp_strategy(self.strategy)
            if settings.clip_norm != self.privacy.dp_clip:
                raise UsageError("the round settings do not carry --dp-clip", "build them with RoundOptions.settings")
        if self.strategy == "heurpfedla" and settings.uploads_delta:
            raise UsageError(
                "heurpfedla changes which tensors travel each round, and an encoded upload's error-feedback "
                "residual belongs to one set of tensors",
                "use --upload-encoding fp32 with heurpfedla",
            )
        if settings.download_encoding != "fp32" and settings.share_buffers:
            raise UsageError(
                "--download-encoding fp16 cannot carry the integer BatchNorm counters of --share-bn-stats",
                "drop --share-bn-stats, or use --download-encoding fp32",
            )
        return self

    @property
    def share_buffers(self) -> bool:
        """Base-block BatchNorm statistics travel and are averaged (the round settings' `--share-bn-stats`)."""
        return self.strategy_options.settings.share_buffers

    @property
    def max_upload_bytes(self) -> int:
        """The upload size cap in bytes."""
        return int(self.max_upload_mb * 1024 * 1024)


class HttpLimits(BaseModel):
    """What one slow or lying client may cost the others; made at the CLI edge, read by the app and uvicorn.

    A request's headers must arrive within `read_timeout` seconds. A body (an upload holds one of the
    `--upload-slots` while it is read) must then keep up an average of `min_upload_rate` KiB/s after
    a grace of `read_timeout` seconds, or it is refused (408) and its slot goes to the next upload.
    """

    model_config = OPTIONS

    read_timeout: Annotated[
        float,
        Field(
            gt=0.0,
            allow_inf_nan=False,
            description="seconds for a request's headers, and a body's grace before --min-upload-rate",
        ),
    ] = 20.0
    min_upload_rate: Annotated[
        float,
        Field(
            gt=0.0,
            allow_inf_nan=False,
            description="KiB/s a request body must average after --read-timeout, or it is refused (408)",
        ),
    ] = 8.0
    forwarded_allow_ips: Annotated[
        tuple[str, ...],
        Field(
            description="reverse proxies (IPs or networks, comma-separated) whose X-Forwarded-For is believed",
            examples=["10.0.0.5,10.0.1.0/24"],
        ),
    ] = ()

    @field_validator("forwarded_allow_ips", mode="before")
    @classmethod
    def _proxies(cls, value: object) -> object:
        if isinstance(value, str):
            value = tuple(part.strip() for part in value.split(",") if part.strip())
        for proxy in value if isinstance(value, tuple | list) else ():
            try:
                ipaddress.ip_network(proxy, strict=False)
            except (TypeError, ValueError):
                raise ValueError(f"{proxy!r} is not an IP address or network") from None
        return value

    def body_deadline(self, started: float, received: int) -> float:
        """When a body whose reading began at `started` must have sent its next bytes, having sent `received`."""
        return started + self.read_timeout + received / (self.min_upload_rate * 1024)


class Listen(BaseModel):
    """Where `edgepfl serve` listens, over HTTP or HTTPS, and how much it logs."""

    model_config = OPTIONS

    host: Annotated[str, Field(description="address to listen on")] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535, description="port to listen on (0: any free port)")] = 8080
    tls_cert: Annotated[Path | None, Field(description="TLS certificate (PEM); with --tls-key serves HTTPS")] = None
    tls_key: Annotated[Path | None, Field(description="TLS private key (PEM)")] = None
    log_level: Annotated[Literal["debug", "info", "warning"], Field(description="server log level")] = "info"

    @model_validator(mode="after")
    def _tls_files(self) -> Listen:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise UsageError("--tls-cert and --tls-key go together", "pass both, or neither for plain HTTP")
        for path in (self.tls_cert, self.tls_key):
            if path is not None and not path.is_file():
                raise UsageError(f"{path} does not exist", "pass a PEM file")
        return self

    @property
    def tls(self) -> tuple[Path, Path] | None:
        """The certificate and key files, or None for plain HTTP."""
        return (self.tls_cert, self.tls_key) if self.tls_cert and self.tls_key else None


def read_enroll_secret(path: Path) -> str:
    """The shared enrollment secret held in `path` (surrounding whitespace stripped); UsageError if unusable."""
    secret = read_secret_file(path, "--enroll-secret-file")
    if len(secret) < MIN_ENROLL_SECRET:
        raise UsageError(
            f"--enroll-secret-file {path} holds a secret shorter than {MIN_ENROLL_SECRET} characters",
            "write a longer one, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE`",
        )
    return secret
