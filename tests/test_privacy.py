"""DP-FedAvg pieces: clipping, the server's norm check, the noise's std, the estimator, the accountant."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from edgepfl.errors import StateError, UsageError, WireError
from edgepfl.privacy import (
    DPConfig,
    PrivacyLedger,
    check_delta_norm,
    check_dp_strategy,
    clip_delta,
    delta_norm,
    dp_aggregate,
    fixed_denominator,
)

tensor = arrays(np.float32, st.integers(1, 30), elements=st.floats(-1e6, 1e6, width=32))


@settings(max_examples=80, deadline=None)
@given(a=tensor, b=tensor, clip=st.floats(1e-3, 1e3))
def test_every_clipped_delta_has_norm_at_most_c(a, b, clip):
    delta = {"a": a, "b": b}
    clipped = clip_delta(delta, clip)
    assert delta_norm(clipped) <= clip
    check_delta_norm(clipped, clip)
    if delta_norm(delta) <= clip:  # inside the ball: untouched
        assert all(np.array_equal(clipped[n], delta[n]) for n in delta)
    else:  # outside: same direction, on the sphere
        assert delta_norm(clipped) >= clip * (1 - 1e-5)


def test_the_server_refuses_a_delta_over_the_clip_norm():
    delta = {"w": np.array([3.0, 4.0], np.float32)}
    assert check_delta_norm(delta, 5.0) == pytest.approx(5.0)
    with pytest.raises(WireError, match=r"L2 norm 5, above the clip norm 4.9 \(clip the base delta to 4.9"):
        check_delta_norm(delta, 4.9)
    with pytest.raises(WireError, match="above the clip norm"):
        check_delta_norm({"w": np.array([np.nan], np.float32)}, 1.0)
    with pytest.raises(WireError, match="above the clip norm"):
        dp_aggregate([delta], 4.9, 1.0, 1.0, np.random.default_rng(0))


def test_the_noise_on_the_sum_has_std_sigma_times_c():
    sigma, clip, devices = 0.7, 2.0, 4
    deltas = [{"w": np.full(40_000, 0.001 * k, np.float32), "b": np.zeros(3, np.float32)} for k in range(devices)]
    exact_sum = 0.001 * sum(range(devices))
    out = dp_aggregate(deltas, clip, sigma, denominator=1.0, rng=np.random.default_rng(5))
    noise = out["w"].astype(np.float64) - exact_sum
    # 40 000 draws: the sample std is within 2% of the true one with overwhelming probability
    assert abs(noise.std() / (sigma * clip) - 1) < 0.02
    assert abs(noise.mean()) < 4 * sigma * clip / np.sqrt(noise.size)
    scaled = dp_aggregate(deltas, clip, sigma, denominator=8.0, rng=np.random.default_rng(5))
    np.testing.assert_allclose(scaled["w"], out["w"] / 8, rtol=1e-6)
    again = dp_aggregate(deltas, clip, sigma, denominator=1.0, rng=np.random.default_rng(5))
    assert all(np.array_equal(again[n], out[n]) for n in out)


def test_aggregation_clips_and_checks_every_delta():
    big = {"w": np.array([3.0, 4.0], np.float32) * (1 + 5e-7)}  # within tolerance, re-clipped to exactly C
    out = dp_aggregate([big, big], 5.0, 1e-12, denominator=2.0, rng=np.random.default_rng(0))
    assert delta_norm(out) <= 5.0
    with pytest.raises(WireError, match="different tensors"):
        dp_aggregate([big, {"v": big["w"]}], 5.0, 1.0, 1.0, np.random.default_rng(0))
    with pytest.raises(UsageError, match="at least one delta"):
        dp_aggregate([], 5.0, 1.0, 1.0, np.random.default_rng(0))


def test_fixed_denominator_is_expected_count_or_sample_size():
    assert fixed_denominator("poisson", 1000, sampling_probability=0.05) == pytest.approx(50.0)
    assert fixed_denominator("fixed", 1000, sample_size=20) == 20.0
    for args in (("fixed", 10, 11, None), ("poisson", 10, None, 0.0), ("uniform", 10, 1, None)):
        with pytest.raises(UsageError):
            fixed_denominator(*args)


def test_dp_refuses_strategies_the_noise_does_not_cover():
    check_dp_strategy("fedavg")
    check_dp_strategy("fedper")
    for strategy, reason in (
        ("median", "not a sum"),
        ("trimmed-mean", "not a sum"),
        ("pfedla", "un-noised"),
        ("heurpfedla", "un-noised"),
    ):
        with pytest.raises(UsageError, match=f"--strategy {strategy}: .*{reason}") as caught:
            check_dp_strategy(strategy)
        assert "\n" not in str(caught.value)


def _independent_epsilon(event, relation, rounds: int, delta: float) -> float:
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    accountant.compose(event, rounds)
    return accountant.get_epsilon(delta)


def test_epsilon_equals_dp_accountings_answer_for_poisson_sampling():
    ledger = PrivacyLedger(noise_multiplier=1.1, delta=1e-5, sampling="poisson")
    assert ledger.epsilon() == 0.0
    for _ in range(30):
        ledger = ledger.record_round(population=500, sampling_probability=0.04)
    event = dp_accounting.PoissonSampledDpEvent(0.04, dp_accounting.GaussianDpEvent(1.1))
    expected = _independent_epsilon(event, dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, 30, 1e-5)
    assert ledger.rounds == 30
    assert ledger.epsilon() == pytest.approx(expected, rel=1e-9)
    assert 0 < expected < 10


def test_epsilon_equals_dp_accountings_answer_for_fixed_size_sampling():
    ledger = PrivacyLedger(noise_multiplier=2.0, delta=1e-5, sampling="fixed")
    for _ in range(12):
        ledger = ledger.record_round(population=200, sample_size=10)
    # replace-one neighbours: one swapped device moves the clipped sum by up to 2C, so sigma*C noise is
    # a noise multiplier of sigma/2 on that sensitivity
    event = dp_accounting.SampledWithoutReplacementDpEvent(200, 10, dp_accounting.GaussianDpEvent(1.0))
    expected = _independent_epsilon(event, dp_accounting.NeighboringRelation.REPLACE_ONE, 12, 1e-5)
    assert ledger.epsilon() == pytest.approx(expected, rel=1e-9)


def test_ledger_survives_a_restart_and_counts_changing_populations():
    ledger = PrivacyLedger(1.0, 1e-6, "fixed")
    for population in (100, 100, 120, 120, 120):
        ledger = ledger.record_round(population, sample_size=10)
    assert ledger.history == ((2.0, 100.0, 10.0), (3.0, 120.0, 10.0))
    restored = PrivacyLedger.from_json(ledger.to_json())
    assert restored == ledger and restored.epsilon() == ledger.epsilon()
    for text in ("{}", "not json", '{"noise_multiplier": 1, "delta": 1e-6, "sampling": "fixed", "history": [["x"]]}'):
        with pytest.raises(StateError, match="privacy ledger"):
            PrivacyLedger.from_json(text)


def test_rounds_left_is_the_last_count_under_the_target():
    ledger = PrivacyLedger(1.0, 1e-5, "poisson").record_round(1000, sampling_probability=0.05)
    target = ledger.epsilon(9)  # exactly ten rounds' worth
    left = ledger.rounds_left(target, 1000, sampling_probability=0.05)
    assert left == 9
    assert ledger.epsilon(left) <= target < ledger.epsilon(left + 1)
    assert ledger.rounds_left(target, 1000, sampling_probability=0.05, limit=1) == 1
    assert PrivacyLedger(1.0, 1e-5).rounds_left(1e-9, 1000, sampling_probability=0.05) == 0


def test_ledger_refuses_nonsense_settings():
    for args in ((0.0, 1e-5), (1.0, 0.0), (1.0, 1.5), (1.0, 1e-5, "uniform")):
        with pytest.raises(UsageError):
            PrivacyLedger(*args)


def test_dp_config_checks_everything_before_a_budget_starts():
    ledger = DPConfig(1.0, 0.5, 1e-6, target_epsilon=4.0).new_ledger("fedper", "fixed")
    assert ledger == PrivacyLedger(1.0, 1e-6, "fixed")
    for config, strategy, match in (
        (DPConfig(1.0, 0.0), "fedper", "--dp-clip"),
        (DPConfig(1.0, 1.0, target_epsilon=0.0), "fedper", "--dp-target-epsilon"),
        (DPConfig(0.0, 1.0), "fedavg", "--dp-noise-multiplier"),
        (DPConfig(1.0, 1.0, delta=2.0), "fedavg", "--dp-delta"),
        (DPConfig(1.0, 1.0), "median", "--strategy median"),
    ):
        with pytest.raises(UsageError, match=match):
            config.new_ledger(strategy, "poisson")
