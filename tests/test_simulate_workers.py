"""edgepfl simulate --workers: a round's clients in Ray actors give bit for bit the run of one process."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from test_simulate import state_of, tiny_config, tiny_npz  # noqa: F401  (tiny_npz is a fixture)

pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from edgepfl.errors import UsageError  # noqa: E402
from edgepfl.simulate.loop import run_simulation  # noqa: E402
from edgepfl.simulate.rounds import final_global_base  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray for the module (a run reuses a Ray that is already up, and leaves it up)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def assert_same_run(first, second, out_first, out_second) -> None:
    """Every client's tensors, the global base and every reported number are equal, bit for bit."""
    a, b = state_of(out_first), state_of(out_second)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    if (out_first / "server").is_dir():
        base_a, base_b = final_global_base(out_first), final_global_base(out_second)
        assert base_a.keys() == base_b.keys()
        for name in base_a:
            np.testing.assert_array_equal(base_a[name], base_b[name], err_msg=name)
    for x, y in zip(first.rounds, second.rounds, strict=True):
        assert x.test_accuracy == y.test_accuracy and x.trained_test_accuracy == y.trained_test_accuracy
        assert x.train_loss == y.train_loss and x.bytes_up == y.bytes_up


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "engine", "fraction"),
    [("fedper", "torch", 1.0), ("pfedla", "torch", 1.0), ("persfl", "torch", 1.0), ("fedper", "portable", 0.5)],
)
def test_two_workers_equal_one(tiny_npz, tmp_path, algorithm, engine, fraction):  # noqa: F811
    config = tiny_config(tiny_npz, tmp_path / "one", algorithm=algorithm, engine=engine, fraction=fraction)
    if algorithm == "persfl":
        config = config.updated(
            split=(0.6, 0.2, 0.2), distill_lambdas=(0.5,), distill_temperatures=(2.0,), distill_epochs=1
        )
    one = run_simulation(config)
    seen: list[tuple[int, int]] = []
    two = run_simulation(
        config.updated(out=str(tmp_path / "two"), workers=2), progress=lambda r, done, n: seen.append((r, done))
    )
    assert seen == [(r, d) for r in (1, 2) for d in range(1, len(seen) // 2 + 1)], "the bar moves per client"
    assert_same_run(one, two, tmp_path / "one", tmp_path / "two")
    if algorithm == "persfl":
        assert one.persfl["clients"] == two.persfl["clients"]


@pytest.mark.slow
def test_a_workers_run_resumes_to_the_one_process_run(tiny_npz, tmp_path):  # noqa: F811
    straight = run_simulation(tiny_config(tiny_npz, tmp_path / "straight", rounds=3))
    run_simulation(tiny_config(tiny_npz, tmp_path / "resumed", rounds=1, workers=2))
    resumed = run_simulation(tiny_config(tiny_npz, tmp_path / "resumed", rounds=3, workers=2))
    assert_same_run(straight, resumed, tmp_path / "straight", tmp_path / "resumed")


@pytest.mark.slow
def test_bad_worker_options_are_one_line(tiny_npz, tmp_path, monkeypatch):  # noqa: F811
    with pytest.raises(UsageError, match="--workers 0: input should be greater than or equal to 1"):
        run_simulation(tiny_config(tiny_npz, tmp_path / "zero", workers=0))
    with pytest.raises(UsageError, match="--client-gpus 1 asks for GPUs and the Ray cluster has 0"):
        run_simulation(tiny_config(tiny_npz, tmp_path / "gpu", workers=2, client_gpus=1.0))
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(UsageError, match=r"pip install 'edgepfl\[ray\]'"):
        run_simulation(tiny_config(tiny_npz, tmp_path / "noray", workers=2))
