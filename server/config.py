"""The server's configuration: one typed object made at the CLI edge and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edgepfl.credentials import read_secret_file
from edgepfl.errors import UsageError
from edgepfl.protocol import ALGORITHMS, RoundSettings

MIN_ENROLL_SECRET = 16  # characters; shorter shared secrets are refused at start


@dataclass(frozen=True)
class StrategyOptions:
    """What a strategy is told at construction: the round settings it hands out and its own knobs."""

    settings: RoundSettings = field(default_factory=RoundSettings)
    trim_fraction: float = 0.1  # trimmed-mean: fraction cut from each end per coordinate
    clients: int = 0  # pfedla: how many clients the hypernetworks mix (N)
    hn_lr: float = 5e-3  # pfedla: SGD learning rate of the embeddings and hypernetworks
    seed: int = 0  # strategies that draw random numbers (pfedla's hypernetwork initialisation)
    retain_top_k: int = 1  # heurpfedla: tensors (largest self-weight) that stay on each device


@dataclass(frozen=True)
class ServerConfig:
    """Everything `edgepfl serve` was told; the engine and the HTTP app read only this."""

    bundle: Path
    state: Path
    strategy: str = "fedper"
    rounds: int = 100
    min_clients: int = 2
    fraction: float = 1.0
    round_timeout: float = 600.0  # seconds from a round's opening to its deadline
    max_upload_mb: float = 64.0
    max_samples: int = 10_000_000  # larger sample counts are refused as absurd
    seed: int = 0  # device sampling
    share_buffers: bool = False  # base-block BatchNorm statistics travel and are averaged
    init: Path | None = None  # initial base tensors; default: the bundle's portable/initial.safetensors
    poll_interval: float = 5.0  # retry_after for devices told to wait
    available_for: float = 60.0  # a device counts as available this long after its last /v1/task poll
    upload_slots: int = 4  # uploads decoded and checked at once (memory stays O(slots x model))
    public_status: bool = False  # `/`, `/plot.png` and `/v1/status` readable without a token
    history: int = 0  # closed rounds whose global model (and tensors) are kept; 0 keeps every round
    enroll_secret: str | None = field(default=None, repr=False)  # POST /v1/enroll is open while set; never stored
    enroll_max_failures: int = 10  # wrong secrets from one address that block it from POST /v1/enroll ...
    enroll_window: int = 600  # ... while they fall within this many seconds
    clip_multiple: float = 3.0  # an update's delta is clipped to this many times the round's median delta norm
    weight_multiple: float = 2.0  # a claimed sample count is capped at this many times the round's median
    strategy_options: StrategyOptions = field(default_factory=StrategyOptions)
    web: bool = True  # the browser device: /device/ (page, runtime, portable bundle files) and /join; --no-web

    @property
    def max_upload_bytes(self) -> int:
        """The upload size cap in bytes."""
        return int(self.max_upload_mb * 1024 * 1024)

    def check(self) -> None:
        """Refuse values that cannot work, naming the option (raises UsageError)."""
        settings = self.strategy_options.settings
        checks = [
            (self.rounds >= 1, "--rounds must be at least 1", "pass e.g. --rounds 100"),
            (self.min_clients >= 1, "--min-clients must be at least 1", "pass e.g. --min-clients 2"),
            (0.0 < self.fraction <= 1.0, "--fraction must be in (0, 1]", "pass e.g. --fraction 1.0"),
            (self.round_timeout > 0, "--round-timeout must be positive", "pass seconds, e.g. 600"),
            (self.max_upload_mb > 0, "--max-upload-mb must be positive", "pass e.g. 64"),
            (self.max_samples >= 1, "--max-samples must be at least 1", "pass e.g. 10000000"),
            (self.poll_interval > 0, "--poll-interval must be positive", "pass seconds, e.g. 5"),
            (self.available_for > 0, "--available-for must be positive", "pass seconds, e.g. 60"),
            (self.history >= 0, "--history must not be negative", "pass 0 to keep every round, or e.g. 10"),
            (self.upload_slots >= 1, "--upload-slots must be at least 1", "pass e.g. 4"),
            (self.enroll_max_failures >= 1, "--enroll-max-failures must be at least 1", "pass e.g. 10"),
            (self.enroll_window >= 1, "--enroll-window must be at least 1 second", "pass seconds, e.g. 600"),
            (
                self.clip_multiple == 0 or self.clip_multiple >= 1,
                "--clip-multiple must be 0 (off) or at least 1 (times the round's median delta norm)",
                "pass e.g. 3",
            ),
            (
                self.weight_multiple == 0 or self.weight_multiple >= 1,
                "--weight-multiple must be 0 (off) or at least 1 (times the round's median sample count)",
                "pass e.g. 2",
            ),
            (
                settings.algorithm in ALGORITHMS,
                f"--client-update {settings.algorithm!r} is unknown",
                f"use one of: {', '.join(ALGORITHMS)}",
            ),
            (
                min(settings.epochs, settings.finetune_epochs, settings.personal_epochs) >= 0,
                "epoch counts must not be negative",
                "pass 0 or more",
            ),
            (settings.batch_size >= 1, "--batch-size must be at least 1", "pass e.g. 32"),
            (settings.lr > 0, "--lr must be positive", "pass e.g. 0.01"),
            (0.0 <= self.strategy_options.trim_fraction < 0.5, "--trim-fraction must be in [0, 0.5)", "pass e.g. 0.1"),
            (
                self.strategy_options.clients == 0 or self.min_clients <= self.strategy_options.clients,
                f"--min-clients {self.min_clients} is more than the {self.strategy_options.clients} clients of "
                "--pfedla-clients, so no round could open",
                f"pass --min-clients {self.strategy_options.clients} or less",
            ),
        ]
        for ok, problem, fix in checks:
            if not ok:
                raise UsageError(problem, fix)


def read_enroll_secret(path: Path) -> str:
    """The shared enrollment secret held in `path` (surrounding whitespace stripped); UsageError if unusable."""
    secret = read_secret_file(path, "--enroll-secret-file")
    if len(secret) < MIN_ENROLL_SECRET:
        raise UsageError(
            f"--enroll-secret-file {path} holds a secret shorter than {MIN_ENROLL_SECRET} characters",
            "write a longer one, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE`",
        )
    return secret
