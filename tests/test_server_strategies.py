"""Strategies in isolation: FedAvg/FedPer weighted means, median, trimmed mean, the registry."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepfl.errors import UsageError
from edgepfl.manifest import TensorSpec
from edgepfl.server.strategies import STRATEGIES, make_strategy, strategy_options
from edgepfl.server.strategy import AcceptedUpdate

SPECS = [TensorSpec("w", (3, 2), "float32", "base", 0), TensorSpec("b", (2,), "float32", "base", 0)]


def _updates(values: list[float], counts: list[int]) -> list[AcceptedUpdate]:
    return [
        AcceptedUpdate(f"d{i}", n, {"w": np.full((3, 2), v, np.float32), "b": np.full((2,), -v, np.float32)})
        for i, (v, n) in enumerate(zip(values, counts))
    ]


def test_registry_names_are_the_cli_names() -> None:
    assert set(STRATEGIES) == {"fedavg", "fedper", "median", "trimmed-mean", "pfedla", "heurpfedla"}
    assert all(cls.name == name for name, cls in STRATEGIES.items())
    with pytest.raises(UsageError, match="unknown strategy"):
        make_strategy("fedprox", SPECS)


@pytest.mark.parametrize("name", ["fedavg", "fedper"])
def test_fedavg_is_the_sample_weighted_mean(name: str) -> None:
    strategy = make_strategy(name, SPECS)
    result = strategy.aggregate(1, iter(_updates([1.0, 2.0, 4.0], [1, 1, 2])), {})
    assert result["w"].dtype == np.float32
    np.testing.assert_allclose(result["w"], np.full((3, 2), 11 / 4))
    np.testing.assert_allclose(result["b"], np.full((2,), -11 / 4))


def test_fedavg_consumes_updates_one_at_a_time() -> None:
    """Streaming: the strategy never needs more than the current update (a generator is read once)."""
    alive = []

    def stream():
        for update in _updates([1.0, 3.0], [5, 5]):
            alive.append(update.device)
            yield update

    result = make_strategy("fedper", SPECS).aggregate(1, stream(), {})
    assert alive == ["d0", "d1"]
    np.testing.assert_allclose(result["w"], 2.0)
    assert STRATEGIES["fedper"].streaming and not STRATEGIES["median"].streaming


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(-1e3, 1e3, width=32), st.integers(1, 10_000)), min_size=1, max_size=8))
def test_fedavg_matches_float64_reference(pairs: list[tuple[float, int]]) -> None:
    values, counts = [v for v, _ in pairs], [n for _, n in pairs]
    result = make_strategy("fedavg", SPECS).aggregate(1, _updates(values, counts), {})
    expected = np.float32(sum(np.float64(np.float32(v)) * n for v, n in pairs) / sum(counts))
    np.testing.assert_allclose(result["w"], expected, rtol=1e-6, atol=1e-6)


def test_median_resists_one_outlier() -> None:
    result = make_strategy("median", SPECS).aggregate(1, _updates([1.0, 2.0, 1e9], [1, 1, 1000]), {})
    np.testing.assert_allclose(result["w"], 2.0)


class _Logged(Mapping):
    """A device's tensors that log each read, as the server's blobs are read from disk one at a time."""

    def __init__(self, tensors: dict, device: str, log: list) -> None:
        self.tensors, self.device, self.log = tensors, device, log

    def __getitem__(self, name: str) -> np.ndarray:
        self.log.append((self.device, name))
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


@pytest.mark.parametrize("name", ["median", "trimmed-mean"])
def test_robust_strategies_hold_one_tensor_of_every_device_at_a_time(name: str) -> None:
    """O(devices x largest tensor): all devices' "w" is read and reduced before any device's "b"."""
    log: list = []
    updates = [
        AcceptedUpdate(u.device, u.num_samples, _Logged(u.base_tensors, u.device, log))
        for u in _updates([1.0, 2.0, 9.0], [1, 1, 1])
    ]
    result = make_strategy(strategy_options(name, trim_fraction=0.34), SPECS).aggregate(1, iter(updates), {})
    assert log == [(f"d{i}", "w") for i in range(3)] + [(f"d{i}", "b") for i in range(3)]
    np.testing.assert_allclose(result["w"], np.full((3, 2), 2.0))


def test_trimmed_mean_cuts_each_end() -> None:
    strategy = make_strategy(strategy_options("trimmed-mean", trim_fraction=0.2), SPECS)
    result = strategy.aggregate(1, _updates([-1e9, 1.0, 2.0, 3.0, 1e9], [1] * 5), {})
    np.testing.assert_allclose(result["w"], 2.0)
    two = strategy.aggregate(1, _updates([1.0, 3.0], [1, 1]), {})  # nothing to cut with two
    np.testing.assert_allclose(two["w"], 2.0)


def test_integer_tensors_are_rounded_back() -> None:
    specs = [TensorSpec("count", (1,), "int64", "buffer", 0)]
    updates = [AcceptedUpdate("a", 1, {"count": np.array([1])}), AcceptedUpdate("b", 2, {"count": np.array([2])})]
    result = make_strategy("fedavg", specs).aggregate(1, updates, {})
    assert result["count"].dtype == np.int64 and result["count"][0] == 2


def test_every_strategy_says_what_it_needs_and_the_refusals_follow() -> None:
    from edgepfl.capabilities import UNKNOWN, needs_of
    from edgepfl.privacy import check_dp_strategy
    from edgepfl.server.fleet import FleetOptions

    fedbuff = FleetOptions(aggregation="fedbuff")
    for name, strategy in STRATEGIES.items():
        assert strategy.needs is needs_of(name) and strategy.needs is not UNKNOWN, name
        assert (strategy.cohort_option is not None) == strategy.needs.fixed_cohort, name
        if strategy.needs.sum_of_deltas:  # DP, secure aggregation and fedbuff take a sum of deltas
            check_dp_strategy(name)
            fedbuff.check_strategy(name)
        else:
            with pytest.raises(UsageError, match=f"--strategy {name}"):
                check_dp_strategy(name)
            with pytest.raises(UsageError, match=f"cannot run --strategy {name}"):
                fedbuff.check_strategy(name)
    assert [name for name, s in STRATEGIES.items() if s.needs.sum_of_deltas] == ["fedavg", "fedper"]
    with pytest.raises(UsageError, match="krum is not one noised average of clipped deltas"):  # nothing said: refused
        check_dp_strategy("krum")
