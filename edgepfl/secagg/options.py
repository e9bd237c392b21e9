"""The operator's secure-aggregation options (`--secure-aggregation` and `--secagg-*`), shared by `edgepfl serve`,
`edgepfl simulate` and Flower's run config, and the one check of what they may run with.

What they turn on is docs/secure-aggregation.md's: each sampled device masks its clipped, weighted base delta, and
the round engine learns only the sum (server/secure.py). The quantization range is the clip norm: DP's `--dp-clip`
when DP is on (then every device weighs the same, as DP-FedAvg's sum asks), else `--secagg-clip`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, field_validator

from edgepfl.errors import UsageError
from edgepfl.options import titled
from edgepfl.secagg.config import MIN_DEVICES, SecAggConfig
from edgepfl.secagg.ring import MAX_BITS, MIN_BITS

SECURE_STRATEGIES = ("fedavg", "fedper")  # a (sample-weighted) sum of deltas: all the server learns is that sum
_REFUSED = {
    "median": "the median needs every device's update, and the server learns only their sum",
    "trimmed-mean": "the trimmed mean needs every device's update, and the server learns only their sum",
    "pfedla": "pfedla mixes each device's update into the others' bases with its own weights, and the server learns "
    "only the sum",
    "heurpfedla": "heurpfedla mixes each device's update into the others' bases with its own weights, and the "
    "server learns only the sum",
}


class SecureAggregationOptions(BaseModel):
    """Secure aggregation (SecAgg+, SecAgg): the server learns only the sum of a round's base deltas."""

    model_config = titled("Secure aggregation")

    secure_aggregation: Annotated[
        bool, Field(description="the server learns only the sum of a round's deltas (fedavg, fedper)")
    ] = False
    secagg_threshold: Annotated[
        float,
        Field(
            gt=0.0,
            le=1.0,
            allow_inf_nan=False,
            description="fraction of a device's group whose shares unmask it, and of the devices that must upload",
        ),
    ] = 0.5
    secagg_neighbours: Annotated[
        str,
        Field(description="devices each one masks with: auto (SecAgg+, enough for the threshold), all (classic) or "
              "an even number"),
    ] = "auto"
    secagg_clip: Annotated[
        float | None,
        Field(gt=0.0, allow_inf_nan=False, description="L2 norm each device clips its delta to (default: --dp-clip)"),
    ] = None
    secagg_bits: Annotated[
        int | None,
        Field(
            ge=MIN_BITS,
            le=MAX_BITS,
            description="bits per value of a masked upload (default: int8's resolution per device, 1 + bits of 127 n)",
        ),
    ] = None
    secagg_max_weight: Annotated[
        int, Field(ge=1, lt=1 << 31, description="sample counts are capped at this in the securely summed weights")
    ] = 1000
    secagg_step_timeout: Annotated[
        float,
        Field(gt=0.0, allow_inf_nan=False, description="seconds each step after training waits for missing devices"),
    ] = 60.0

    @field_validator("secagg_neighbours")
    @classmethod
    def _neighbours(cls, value: str) -> str:
        neighbours(value)
        return value

    def config(self, dp_clip: float | None) -> SecAggConfig | None:
        """The protocol's settings (None: off); with DP (`dp_clip`) every device's weight is 1 of 1."""
        if not self.secure_aggregation:
            return None
        clip = dp_clip if dp_clip is not None else self.secagg_clip
        if clip is None:
            raise UsageError("--secure-aggregation needs a clip norm", "pass --secagg-clip C (or DP's --dp-clip)")
        weight = 1 if dp_clip is not None else self.secagg_max_weight
        return SecAggConfig(clip_norm=clip, threshold=self.secagg_threshold,
                            neighbours=neighbours(self.secagg_neighbours), bits=self.secagg_bits, max_weight=weight)

    def clip_norm(self, dp_clip: float | None) -> float | None:
        """The L2 norm a device clips its delta to in a secure round (None: secure aggregation off)."""
        config = self.config(dp_clip)
        return config.clip_norm if config is not None else None


def neighbours(value: str) -> int | str:
    """`auto`, `all` or an even number >= 2 from a --secagg-neighbours value; ValueError otherwise."""
    if value in ("auto", "all"):
        return value
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 2 or count % 2:
        raise ValueError("not auto, all or an even number >= 2 (e.g. 20)")
    return count


def check_secure(
    options: SecureAggregationOptions,
    strategy: str,
    dp_clip: float | None,
    asynchronous: bool,
    upload_encoding: str,
    min_clients: int,
    flag: str = "--strategy",
    cohort: tuple[int, str, str] | None = None,
) -> None:
    """Refuse, in one line that says why, what secure aggregation cannot run with (`flag`: what chose the strategy).

    A round needs MIN_DEVICES devices: serve knows only --min-clients of its fleet; a caller that knows each round's
    devices (simulate) passes `cohort`, (their number, the words that say how many, the fix), checked instead.
    """
    if not options.secure_aggregation:
        for name in ("secagg_clip", "secagg_bits"):
            if getattr(options, name) is not None:
                dashed = name.replace("_", "-")
                raise UsageError(f"--{dashed} needs secure aggregation on",
                                 f"pass --secure-aggregation, or drop --{dashed}")
        return
    if strategy not in SECURE_STRATEGIES:
        reason = _REFUSED.get(strategy, f"{strategy} is not a sum of the devices' deltas")
        raise UsageError(f"secure aggregation cannot run with {flag} {strategy}: {reason}",
                         f"use {flag} {' or '.join(SECURE_STRATEGIES)} with --secure-aggregation")
    if asynchronous:
        raise UsageError("secure aggregation cannot run with --aggregation fedbuff: its masks cancel only in the sum "
                         "of one round's devices, and fedbuff's steps mix uploads of several rounds",
                         "use --aggregation sync with --secure-aggregation")
    if upload_encoding != "fp32":
        raise UsageError(f"--upload-encoding {upload_encoding} does not apply to secure aggregation: a device uploads "
                         "its delta quantized into the masked vector", "drop --upload-encoding (--secagg-bits sets "
                         "a masked upload's bits per value)")
    if dp_clip is not None and options.secagg_clip is not None:
        raise UsageError("--secagg-clip and --dp-clip both set the clip norm",
                         "drop --secagg-clip: with DP the devices clip to --dp-clip")
    devices, said, fix = cohort or (min_clients, f"--min-clients is {min_clients}",
                                    f"pass --min-clients {MIN_DEVICES} or more")
    if devices < MIN_DEVICES:
        raise UsageError(f"secure aggregation needs at least {MIN_DEVICES} devices a round, and {said}", fix)
    options.config(dp_clip)
