"""The operator's secure-aggregation options (`--secure-aggregation` and `--secagg-*`), shared by `edgepfl serve`,
`edgepfl simulate` and Flower's run config, and the one check of what they may run with.

What they turn on is docs/secure-aggregation.md's: each sampled device masks its clipped, weighted base delta, and
the round engine learns only the sum (server/secure/). The quantization range is the clip norm: DP's `--dp-clip`
when DP is on (then every device weighs the same, as DP-FedAvg's sum asks), else `--secagg-clip` when given, else
measured each round from the previous round's sum (edgepfl.secagg.config.Measured), as is the weight scale unless
`--secagg-max-weight` fixes it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, field_validator

from edgepfl.capabilities import either, needs_of, strategies_where
from edgepfl.errors import UsageError
from edgepfl.options import titled
from edgepfl.secagg.config import (
    FIRST_CLIP,
    FIRST_WEIGHT_SCALE,
    MIN_DEVICES,
    WEIGHT_CAP,
    Measured,
    SecAggConfig,
)
from edgepfl.secagg.ring import MAX_BITS, MIN_BITS

# the clip devices are told when each round's key book sets it (measured): it never binds, so the delta they keep
# is whole and the key book's clip is the one applied (a delta body needs a clip, protocol.RoundSettings)
UNBOUNDED_CLIP = 1e30


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
        Field(
            description="devices each one masks with: auto (SecAgg+, enough for the threshold), all (classic) or "
            "an even number"
        ),
    ] = "auto"
    secagg_clip: Annotated[
        float | None,
        Field(
            gt=0.0,
            allow_inf_nan=False,
            description="L2 norm each device clips its weighted delta to (default: "
            "--dp-clip, else measured: 4 times the previous round's mean delta norm, 10 in round 1)",
        ),
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
        int | None,
        Field(
            ge=1,
            lt=1 << 31,
            description="sample counts are capped at this and a delta is weighted by count / "
            "this (default: weighted by count / the previous round's mean count, 1000 in round 1)",
        ),
    ] = None
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
        measured = self.measured(dp_clip)
        if dp_clip is not None:
            weight, scale = 1, None
        elif measured.weight:
            weight, scale = WEIGHT_CAP, FIRST_WEIGHT_SCALE
        else:
            weight, scale = self.secagg_max_weight, None
        return SecAggConfig(
            clip_norm=FIRST_CLIP if clip is None else clip,
            threshold=self.secagg_threshold,
            neighbours=neighbours(self.secagg_neighbours),
            bits=self.secagg_bits,
            max_weight=weight,
            weight_scale=scale,
        )

    def measured(self, dp_clip: float | None) -> Measured:
        """Which settings each round measures from the previous round's sum: what no flag (nor DP) fixes."""
        return Measured(
            clip=dp_clip is None and self.secagg_clip is None, weight=dp_clip is None and self.secagg_max_weight is None
        )

    def clip_norm(self, dp_clip: float | None) -> float | None:
        """The L2 norm a device clips its delta to in a secure round (None: secure aggregation off)."""
        config = self.config(dp_clip)
        if config is None:
            return None
        return UNBOUNDED_CLIP if self.measured(dp_clip).clip else config.clip_norm

    def device_clip(self, dp_clip: float | None) -> float | None:
        """The clip norm devices are told: secure aggregation's quantization range when it runs, else DP's (None:
        neither is on)."""
        secure = self.clip_norm(dp_clip)
        return dp_clip if secure is None else secure


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
        for name in ("secagg_clip", "secagg_bits", "secagg_max_weight"):
            if getattr(options, name) is not None:
                dashed = name.replace("_", "-")
                raise UsageError(
                    f"--{dashed} needs secure aggregation on", f"pass --secure-aggregation, or drop --{dashed}"
                )
        return
    reason = needs_of(strategy).secure_refusal(strategy)
    if reason is not None:
        summed = either(strategies_where(lambda needs: needs.secure_refusal("") is None))
        raise UsageError(
            f"secure aggregation cannot run with {flag} {strategy}: {reason}",
            f"use {flag} {summed} with --secure-aggregation",
        )
    if asynchronous:
        raise UsageError(
            "secure aggregation cannot run with --aggregation fedbuff: its masks cancel only in the sum "
            "of one round's devices, and fedbuff's steps mix uploads of several rounds",
            "use --aggregation sync with --secure-aggregation",
        )
    if upload_encoding != "fp32":
        raise UsageError(
            f"--upload-encoding {upload_encoding} does not apply to secure aggregation: a device uploads "
            "its delta quantized into the masked vector",
            "drop --upload-encoding (--secagg-bits sets a masked upload's bits per value)",
        )
    if dp_clip is not None and options.secagg_clip is not None:
        raise UsageError(
            "--secagg-clip and --dp-clip both set the clip norm",
            "drop --secagg-clip: with DP the devices clip to --dp-clip",
        )
    if dp_clip is not None and options.secagg_max_weight is not None:
        raise UsageError(
            "--secagg-max-weight does not apply with DP: every device weighs the same", "drop --secagg-max-weight"
        )
    devices, said, fix = cohort or (
        min_clients,
        f"--min-clients is {min_clients}",
        f"pass --min-clients {MIN_DEVICES} or more",
    )
    if devices < MIN_DEVICES:
        raise UsageError(f"secure aggregation needs at least {MIN_DEVICES} devices a round, and {said}", fix)
    options.config(dp_clip)
