"""Secure aggregation's encoding costs no accuracy (issue 42): the aggregate's quantization error is small next to
the update, the stochastic rounding is unbiased, the agreed scale cannot overflow the ring for the cohort, and the
clip and weight scale default to what the previous round's sum measured (DP's clip under DP)."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.errors import UsageError
from edgepfl.privacy import clip_delta, delta_norm
from edgepfl.secagg import SecAggConfig, VectorLayout, dequantize_sum, quantize_delta
from edgepfl.secagg.config import (
    CLIP_MARGIN,
    FIRST_CLIP,
    FIRST_WEIGHT_SCALE,
    WEIGHT_CAP,
    Measured,
    levels,
    ring_bits,
    weight_digits,
)
from edgepfl.secagg.options import UNBOUNDED_CLIP, SecureAggregationOptions, check_secure
from tests.secagg_helpers import SHAPES, Round, sample_delta

LAYOUT = VectorLayout.of(SHAPES)


def ring_sum(vectors: list[np.ndarray], bits: int) -> np.ndarray:
    """The exact sum of ring vectors mod 2^b, as the unmasked secure sum is."""
    return (sum(v.astype(np.int64) for v in vectors) % (1 << bits)).astype(np.uint32)


def exact_mean(deltas: list[dict], weights: list[int]) -> dict[str, np.ndarray]:
    return {
        name: sum(w * d[name].astype(np.float64) for d, w in zip(deltas, weights)) / sum(weights) for name in SHAPES
    }


def test_the_aggregate_error_is_far_below_the_update_at_a_measured_clip():
    n = 8
    deltas = [sample_delta(i) for i in range(n)]
    weights = [4000 + 700 * i for i in range(n)]
    mean = exact_mean(deltas, weights)
    # what the next round agrees on after a round with this mean: C = CLIP_MARGIN |mean|, W = the mean weight
    config = Measured(clip=True, weight=True).next_config(
        SecAggConfig(clip_norm=FIRST_CLIP, max_weight=WEIGHT_CAP, weight_scale=FIRST_WEIGHT_SCALE),
        delta_norm(mean),
        sum(weights),
        n,
    )
    assert config.clip_norm == pytest.approx(CLIP_MARGIN * delta_norm(mean))
    assert config.weight_scale == pytest.approx(np.mean(weights))
    book = Round(n, config).advertise()
    vectors = [
        quantize_delta(d, w, book, np.random.default_rng([3, i])) for i, (d, w) in enumerate(zip(deltas, weights))
    ]
    decoded = dequantize_sum(ring_sum(vectors, book.plan.bits), LAYOUT, book)
    assert decoded.total_weight == sum(weights)  # uncapped sample counts sum exactly
    error = delta_norm({k: decoded.weighted_mean()[k] - mean[k] for k in mean})
    # each device's rounding error has E|e|^2 <= (s C / q)^2 / 4; n independent ones, over the mean: s C / (2 q sqrt n)
    bound = config.coordinate_sigmas * config.clip_norm / (2 * levels(n, book.plan.bits) * np.sqrt(n))
    assert error <= 1.5 * bound
    assert error <= 0.03 * delta_norm(mean)  # far below the update itself


def test_stochastic_rounding_is_unbiased():
    config = SecAggConfig(clip_norm=1.0, max_weight=100, weight_scale=50.0)
    book = Round(3, config).advertise()
    delta, weight = sample_delta(11), 40
    draws = 400
    total = np.zeros(LAYOUT.size)
    for seed in range(draws):
        vector = quantize_delta(delta, weight, book, np.random.default_rng([seed, 1]))
        total += np.concatenate([v.reshape(-1) for v in dequantize_sum(vector, LAYOUT, book).scaled_sum.values()])
    expected = np.concatenate(
        [delta[name].reshape(-1).astype(np.float64) * weight / 50.0 for name, _ in LAYOUT.tensors]
    )
    nearest = dequantize_sum(quantize_delta(delta, weight, book, None), LAYOUT, book).scaled_sum
    nearest_flat = np.concatenate([v.reshape(-1) for v in nearest.values()])
    bias = np.linalg.norm(total / draws - expected)
    assert bias < 0.25 * np.linalg.norm(nearest_flat - expected)  # averaging removes the error rounding leaves
    assert bias < 0.01 * np.linalg.norm(expected)


@pytest.mark.parametrize("n", [3, 8, 50, 200])
def test_the_agreed_scale_cannot_overflow_the_ring_for_the_cohort(n):
    config = SecAggConfig(clip_norm=0.01, max_weight=WEIGHT_CAP, weight_scale=10.0)
    bits = ring_bits(n)
    assert n * levels(n, bits) <= (1 << (bits - 1)) - 1  # n values at +-q each cannot wrap
    if n > 8:
        return  # a whole round of 50 or 200 devices is the bench's; the bound above is what makes it safe
    book = Round(n, config).advertise()
    assert book.plan.bits == bits
    # every device pushes the same huge delta with the heaviest weight: each is clipped to C, the sum is n of them
    huge = {name: np.full(shape, 50.0, dtype=np.float32) for name, shape in SHAPES.items()}
    vectors = [quantize_delta(huge, WEIGHT_CAP, book, np.random.default_rng([i])) for i in range(n)]
    decoded = dequantize_sum(ring_sum(vectors, book.plan.bits), LAYOUT, book)
    one = clip_delta(huge, config.clip_norm)
    assert delta_norm(decoded.scaled_sum) == pytest.approx(n * delta_norm(one), rel=0.05)
    cosine = sum(float((decoded.scaled_sum[k].astype(np.float64) * one[k]).sum()) for k in one)
    assert cosine / (delta_norm(decoded.scaled_sum) * delta_norm(one)) > 0.99  # no slot wrapped to the other sign
    assert decoded.total_weight == n * WEIGHT_CAP


def test_the_clip_and_weight_scale_default_to_what_was_measured_and_dp_fixes_them():
    measured = SecureAggregationOptions(secure_aggregation=True)
    config = measured.config(None)
    assert (config.clip_norm, config.weight_scale, config.max_weight) == (FIRST_CLIP, FIRST_WEIGHT_SCALE, WEIGHT_CAP)
    assert measured.measured(None) == Measured(clip=True, weight=True)
    assert measured.clip_norm(None) == UNBOUNDED_CLIP  # the device keeps its whole delta; the key book clips it
    check_secure(measured, "fedper", None, False, "fp32", 3)  # no flag needed
    dp = measured.config(0.7)
    assert (dp.clip_norm, dp.max_weight, dp.scale_weight) == (0.7, 1, 1.0)
    assert measured.measured(0.7) == Measured(clip=False, weight=False)
    fixed = SecureAggregationOptions(secure_aggregation=True, secagg_clip=2.0, secagg_max_weight=300)
    assert fixed.measured(None) == Measured(clip=False, weight=False) and fixed.clip_norm(None) == 2.0
    assert fixed.config(None).scale_weight == 300.0
    with pytest.raises(UsageError, match="--secagg-max-weight does not apply with DP"):
        check_secure(fixed.model_copy(update={"secagg_clip": None}), "fedper", 0.7, False, "fp32", 3)
    # the rule: C = CLIP_MARGIN |the previous round's mean delta|, W = its mean weight; a zero sum keeps the values
    rule = Measured(clip=True, weight=False)
    after = rule.next_config(config, 0.25, 9000, 6)
    assert (after.clip_norm, after.weight_scale) == (CLIP_MARGIN * 0.25, FIRST_WEIGHT_SCALE)
    assert Measured(clip=True, weight=True).next_config(config, 0.0, 0, 0) == config


@pytest.mark.parametrize("n", [3, 8, 10, 129, 200, 1000])
def test_the_measured_weight_cap_keeps_the_masked_vector_as_long_as_before(n):
    bits = ring_bits(n)
    assert weight_digits(n, bits, WEIGHT_CAP)[1] == weight_digits(n, bits, 1000)[1] == 2
