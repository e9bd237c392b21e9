"""The server's configuration: one typed model per concern, made at the CLI edge and passed down.

`ServerConfig` holds what the round engine and the HTTP app read: its own fields (rounds, sampling, bounds,
enrollment) and the models of the parts it drives, each owned by its part: the round settings
(`edgepfl.protocol.RoundOptions`), DP (`edgepfl.privacy.PrivacyOptions`), secure aggregation
(`edgepfl.secagg.options`) and the strategy's options (its file's, chosen by `--strategy`:
`edgepfl.server.strategies.StrategyChoice`). `ServeCommand` adds where and how the server listens; `edgepfl serve`'s
flags are made from its leaves (`edgepfl.commands`).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from edgepfl.credentials import read_secret_file
from edgepfl.errors import UsageError
from edgepfl.options import FLAG, HIDDEN, OPTIONS, Composed, flag_name, titled
from edgepfl.privacy import PrivacyOptions, check_dp_strategy
from edgepfl.protocol import RoundOptions, RoundSettings
from edgepfl.secagg.options import SecureAggregationOptions, check_secure
from edgepfl.server.fleet import FleetOptions, fleet_warnings
from edgepfl.server.strategies import STRATEGIES, StrategyChoice, options_model

MIN_ENROLL_SECRET = 16  # characters; shorter shared secrets are refused at start


class ServerConfig(Composed):
    """The server: rounds, sampling, bounds and enrollment.

    The round engine and the HTTP app read only this.
    """

    model_config = titled("Server")

    bundle: Annotated[Path, Field(description="bundle folder written by `edgepfl export`", examples=["DIR"])]
    state: Annotated[Path, Field(description="state folder (SQLite + blobs); reuse it to resume", examples=["DIR"])]
    strategy: StrategyChoice = Field(default_factory=lambda: options_model("fedper")())
    round: RoundOptions = Field(default_factory=RoundOptions)
    fleet_rounds: FleetOptions = Field(default_factory=FleetOptions)
    privacy: PrivacyOptions = Field(default_factory=PrivacyOptions)
    secure: SecureAggregationOptions = Field(default_factory=SecureAggregationOptions)
    rounds: Annotated[int, Field(ge=1, description="rounds to aggregate, then tell devices 'done'")] = 100
    min_clients: Annotated[
        int, Field(ge=1, description="devices needed to open a round and to close it at its deadline")
    ] = 2
    fraction: Annotated[float, Field(gt=0.0, le=1.0, description="fraction of available devices sampled per round")] = (
        1.0
    )
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
    enroll_secret_file: Annotated[
        Path | None,
        Field(description="file holding a shared secret (16+ characters): devices enroll with it (POST /v1/enroll)"),
    ] = None
    # POST /v1/enroll is open while set (read from enroll_secret_file, or given by a library caller); never stored
    enroll_secret: Annotated[str | None, Field(repr=False, json_schema_extra={HIDDEN: True})] = None
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

    @model_validator(mode="before")
    @classmethod
    def _read_enroll_secret(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("enroll_secret_file") is not None and data.get("enroll_secret") is None:
            data = {**data, "enroll_secret": read_enroll_secret(Path(data["enroll_secret_file"]))}
        return data

    @model_validator(mode="after")
    def _rounds_can_open(self) -> ServerConfig:
        strategy = STRATEGIES[self.strategy_name]
        cohort = strategy.cohort_option  # a fixed cohort of client places (pfedla's N)
        clients = getattr(self.strategy, cohort) if cohort is not None else 0
        if cohort is not None and clients and self.min_clients > clients:
            raise UsageError(
                f"--min-clients {self.min_clients} is more than the {clients} clients of "
                f"{flag_name(strategy.Options, cohort)}, so no round could open",
                f"pass --min-clients {clients} or less",
            )
        settings = self.settings
        self.fleet_rounds.check_strategy(self.strategy_name)
        if self.privacy.enabled:
            check_dp_strategy(self.strategy_name)
            if self.fleet_rounds.asynchronous:
                raise UsageError(
                    "DP-FedAvg's accountant counts rounds of a fixed sample size, and fedbuff's steps are not",
                    "drop the --dp-* options, or use --aggregation sync",
                )
        check_secure(
            self.secure,
            self.strategy_name,
            self.privacy.clip_norm,
            self.fleet_rounds.asynchronous,
            self.round.upload_encoding,
            self.min_clients,
        )
        if strategy.needs.varying_tensors and settings.uploads_delta:
            raise UsageError(
                f"{self.strategy_name} changes which tensors travel each round, and an encoded upload's "
                "error-feedback residual belongs to one set of tensors",
                f"use --upload-encoding fp32 with {self.strategy_name}",
            )
        if settings.download_encoding != "fp32" and settings.share_buffers:
            raise UsageError(
                "--download-encoding fp16 cannot carry the integer BatchNorm counters of --share-bn-stats",
                "drop --share-bn-stats, or use --download-encoding fp32",
            )
        return self

    @classmethod
    def shared_fields(cls, source: BaseModel) -> dict[str, Any]:
        """The fields of a run's config (`source`: simulate's, Flower's) that are this model's, by the same name."""
        return {name: getattr(source, name) for name in cls.model_fields if name in type(source).model_fields}

    def fleet_warnings(self, enrolled: int) -> list[str]:
        """This server's fleet settings that cannot work for `enrolled` devices, one line each with the fix."""
        return fleet_warnings(self.fleet_rounds, self.fraction, self.min_clients, self.round_timeout, enrolled)

    @property
    def strategy_name(self) -> str:
        """The strategy's CLI name."""
        return str(self.strategy.name)

    @property
    def settings(self) -> RoundSettings:
        """What every sampled device is told (with DP or secure aggregation, the clip norm devices clip their delta
        to)."""
        return self.round.settings(self.secure.device_clip(self.privacy.clip_norm))

    @property
    def share_buffers(self) -> bool:
        """Base-block BatchNorm statistics travel and are averaged (the round settings' `--share-bn-stats`)."""
        return self.round.share_buffers

    @property
    def max_upload_bytes(self) -> int:
        """The upload size cap in bytes."""
        return int(self.max_upload_mb * 1024 * 1024)


class HttpLimits(BaseModel):
    """What one slow or lying client may cost the others (read by the app and uvicorn).

    A request's headers must arrive within `read_timeout` seconds. A body (an upload holds one of the
    `--upload-slots` while it is read) must then keep up an average of `min_upload_rate` KiB/s after
    a grace of `read_timeout` seconds, or it is refused (408) and its slot goes to the next upload.
    """

    model_config = titled("HTTP limits")

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
    """Where the server listens, over HTTP or HTTPS, and how much it logs."""

    model_config = titled("Listening")

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


class ServeCommand(Composed):
    """`edgepfl serve`: the server, its HTTP limits and where it listens."""

    model_config = OPTIONS

    server: ServerConfig
    limits: HttpLimits = Field(default_factory=HttpLimits)
    listen: Listen = Field(default_factory=Listen)


def read_enroll_secret(path: Path) -> str:
    """The shared enrollment secret held in `path` (surrounding whitespace stripped); UsageError if unusable."""
    secret = read_secret_file(path, "--enroll-secret-file")
    if len(secret) < MIN_ENROLL_SECRET:
        raise UsageError(
            f"--enroll-secret-file {path} holds a secret shorter than {MIN_ENROLL_SECRET} characters",
            "write a longer one, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE`",
        )
    return secret
