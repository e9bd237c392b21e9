"""edgepfl simulate: each algorithm on a tiny model, aggregates equal the server strategy's, resume, engines agree."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from conftest import SHARED, write_stand_in_digits

pytest.importorskip("torch")

from edgepfl.server.sampling import sample_devices  # noqa: E402
from edgepfl.simulate.config import SimulateConfig, config_from_json  # noqa: E402
from edgepfl.simulate.loop import STATE_FILE, run_simulation  # noqa: E402
from edgepfl.simulate.rounds import final_global_base  # noqa: E402
from edgepfl.wire import decode_tensors  # noqa: E402


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
    """600 + 200 MNIST digits (or learnable stand-in digits when shared/data is absent)."""
    path = tmp_path_factory.mktemp("data") / "tiny.npz"
    source = SHARED / "data" / "mnist.npz"
    if not source.is_file():
        return write_stand_in_digits(path)
    rng = np.random.default_rng(0)
    with np.load(source) as mnist:
        train = rng.choice(len(mnist["y_train"]), 600, replace=False)
        test = rng.choice(len(mnist["y_test"]), 200, replace=False)
        arrays = {
            "x_train": mnist["x_train"][train],
            "y_train": mnist["y_train"][train],
            "x_test": mnist["x_test"][test],
            "y_test": mnist["y_test"][test],
        }
    np.savez(path, **arrays)
    return path


def tiny_config(tiny_npz, out, **changes) -> SimulateConfig:
    base = SimulateConfig(
        out=str(out),
        model="mlp",
        kp=1,
        dataset=str(tiny_npz),
        data_root=str(tiny_npz.parent),
        partition="classes:2",
        clients=4,
        rounds=2,
        epochs=1,
        batch_size=32,
        lr=0.05,
        engine="torch",
        threads=1,
    )
    return base.updated(**changes)


def state_of(out) -> dict[str, np.ndarray]:
    return decode_tensors((out / STATE_FILE).read_bytes())


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedavg", "local", "fedper", "fedalt", "fedper-ft"])
def test_every_algorithm_runs_two_rounds(tiny_npz, tmp_path, algorithm):
    out = tmp_path / algorithm
    results = run_simulation(tiny_config(tiny_npz, out, algorithm=algorithm))
    document = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in document["rounds"]] == [1, 2]
    for record in document["rounds"]:
        accuracy = record["test_accuracy"]
        assert len(accuracy["per_client"]) == 4
        assert 0.0 <= accuracy["min"] <= accuracy["mean"] <= accuracy["max"] <= 1.0
        assert math.isclose(accuracy["mean"], float(np.mean(accuracy["per_client"])), abs_tol=1e-5)
        assert math.isfinite(record["train_loss"]) and record["seconds"] > 0
    assert document["summary"]["last"]["round"] == 2
    assert document["config"]["algorithm"] == algorithm
    info = document["info"]
    expected_kp = {"fedavg": 0, "local": info["blocks"]}.get(algorithm, 1)
    assert info["kp"] == expected_kp
    if algorithm == "local":
        assert all(r["bytes_up"] == 0 and r["bytes_down"] == 0 for r in document["rounds"])
    else:
        assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in document["rounds"])
    # personalized or not, the digits of two classes per client are learnt well above chance (10%)
    assert results.rounds[-1].test_accuracy["mean"] > 0.3


def test_aggregate_equals_the_server_strategy_and_a_weighted_mean(tiny_npz, tmp_path):
    """Round 1 rebuilt by hand: every client from the initial tensors, then the server's FedPer on the uploads."""
    from edgepfl.datasets.images import load_dataset
    from edgepfl.datasets.partition import make_partition
    from edgepfl.device_runtime.algorithms import run_client_round, upload_tensors
    from edgepfl.manifest import load_manifest
    from edgepfl.server.strategies import make_strategy
    from edgepfl.server.strategy import AcceptedUpdate
    from edgepfl.simulate.bundle import initial_tensors
    from edgepfl.simulate.loop import _make_client, round_settings
    from edgepfl.simulate.torch_engine import TorchEngine

    config = tiny_config(tiny_npz, tmp_path / "run", rounds=1, fraction=0.75)
    run_simulation(config)
    simulated = final_global_base(tmp_path / "run")

    bundle = tmp_path / "run" / "bundle"
    manifest = load_manifest(bundle)
    initial = initial_tensors(bundle)
    dataset = load_dataset(config.data.dataset, config.data.data_root)
    parts = make_partition(config.data.partition, dataset.y_train, dataset.y_test, 4, config.seed, config.data.split)
    settings = round_settings(config)
    sampled = sample_devices(config.seed, 1, [f"client-{i:03d}" for i in range(4)], 0.75, 1)
    assert len(sampled) == 3
    updates = []
    for number, part in enumerate(parts):
        client = _make_client(number, part, dataset, manifest, config.seed, initial, tmp_path / "residuals")
        if client.name not in sampled:
            continue
        engine = TorchEngine(bundle, manifest, initial)
        result = run_client_round(engine, settings, client.train, client.seed, 1)
        updates.append(AcceptedUpdate(client.name, result.num_samples, upload_tensors(engine, settings)))
    specs = manifest.shared(False)
    assert {s.name for s in specs} == set(simulated) == set(manifest.names("base"))
    strategy = make_strategy("fedper", specs, settings)
    expected = strategy.aggregate(1, iter(updates), {n: initial[n] for n in simulated})
    total = sum(u.num_samples for u in updates)
    for name, value in simulated.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)
        by_hand = sum(u.num_samples * u.base_tensors[name].astype(np.float64) for u in updates) / total
        np.testing.assert_allclose(value, by_hand, rtol=1e-5, atol=1e-6)
    assert not np.allclose(simulated[specs[0].name], initial[specs[0].name]), "round 1 changed the base"


@pytest.mark.slow
def test_resume_continues_from_the_last_completed_round(tiny_npz, tmp_path):
    straight = run_simulation(tiny_config(tiny_npz, tmp_path / "straight", rounds=3))
    run_simulation(tiny_config(tiny_npz, tmp_path / "resumed", rounds=1))
    seen: list[int] = []
    resumed = run_simulation(
        tiny_config(tiny_npz, tmp_path / "resumed", rounds=3), progress=lambda r, done, n: seen.append(r)
    )
    assert sorted(set(seen)) == [2, 3], "round 1 is not trained again"
    assert [r.round for r in resumed.rounds] == [1, 2, 3]
    for a, b in zip(straight.rounds, resumed.rounds):
        assert a.test_accuracy["per_client"] == b.test_accuracy["per_client"]
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-6)
    first, second = state_of(tmp_path / "straight"), state_of(tmp_path / "resumed")
    first.update(final_global_base(tmp_path / "straight"))
    second.update(final_global_base(tmp_path / "resumed"))
    for name in first:
        np.testing.assert_allclose(first[name], second[name], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_finished_local_run_resumes_to_more_rounds(tiny_npz, tmp_path):
    """`local` keeps no server state: resuming it was refused ("its server is elsewhere")."""
    straight = run_simulation(tiny_config(tiny_npz, tmp_path / "straight", algorithm="local", rounds=2))
    run_simulation(tiny_config(tiny_npz, tmp_path / "resumed", algorithm="local", rounds=1))
    resumed = run_simulation(tiny_config(tiny_npz, tmp_path / "resumed", algorithm="local", rounds=2))
    assert [r.round for r in resumed.rounds] == [1, 2]
    assert resumed.rounds[-1].test_accuracy["per_client"] == straight.rounds[-1].test_accuracy["per_client"]


def test_a_different_experiment_in_the_same_folder_is_refused(tiny_npz, tmp_path):
    from edgepfl.errors import StateError

    run_simulation(tiny_config(tiny_npz, tmp_path / "run", rounds=1))
    with pytest.raises(StateError, match="different lr"):
        run_simulation(tiny_config(tiny_npz, tmp_path / "run", rounds=1, lr=0.1))


def test_sampling_is_the_servers_rule():
    names = [f"d{i}" for i in range(10)]
    assert sample_devices(0, 1, names, 1.0, 2) == sorted(names)
    assert len(sample_devices(0, 1, names, 0.25, 2)) == 3  # ceil(2.5)
    assert len(sample_devices(0, 1, names, 0.05, 2)) == 2  # min_clients
    assert sample_devices(7, 4, names, 0.3, 1) == sample_devices(7, 4, list(reversed(names)), 0.3, 1)
    assert sample_devices(7, 4, names, 0.3, 1) != sample_devices(7, 5, names, 0.3, 1)


def _per_client_losses(results) -> list[float]:
    return [r.train_loss for r in results.rounds]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("onnx_engine", "model", "fields"),
    [
        ("ort-training", "cnn", {"norm": "batch", "kp": 1}),
        ("portable", "cnn", {"norm": "batch", "kp": 1}),
    ],
)
def test_torch_engine_agrees_with_the_onnx_engine(tiny_npz, tmp_path, onnx_engine, model, fields):
    """Same seed, same bundle weights, BatchNorm models: losses and accuracies agree within float tolerance."""
    runs = {}
    for engine in ("torch", onnx_engine):
        config = tiny_config(tiny_npz, tmp_path / engine, model=model, engine=engine, algorithm="fedalt", **fields)
        runs[engine] = run_simulation(config)
    torch_run, onnx_run = runs["torch"], runs[onnx_engine]
    assert onnx_run.info["engine"] == onnx_engine and torch_run.info["engine"] == "torch"
    np.testing.assert_allclose(_per_client_losses(torch_run), _per_client_losses(onnx_run), rtol=2e-3)
    for a, b in zip(torch_run.rounds, onnx_run.rounds):
        # an argmax may flip on a near-tie after float drift: allow one sample per client
        for x, y in zip(a.test_accuracy["per_client"], b.test_accuracy["per_client"]):
            assert abs(x - y) <= 1 / 20 + 1e-9
    torch_state, onnx_state = state_of(tmp_path / "torch"), state_of(tmp_path / onnx_engine)
    for name, value in torch_state.items():
        np.testing.assert_allclose(value, onnx_state[name], rtol=1e-2, atol=2e-3, err_msg=name)


@pytest.mark.slow
def test_config_file_form_and_cli(tiny_npz, tmp_path):
    from typer.testing import CliRunner

    from edgepfl.cli import app

    config = tiny_config(tiny_npz, tmp_path / "from-file", rounds=1).to_json()
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({**config, "rounds": 5}))
    runner = CliRunner()
    result = runner.invoke(app, ["simulate", "--config", str(path), "--rounds", "1"])
    assert result.exit_code == 0, result.output
    assert "last" in result.output and "best" in result.output
    assert (tmp_path / "from-file" / "accuracy.png").stat().st_size > 1000
    assert json.loads((tmp_path / "from-file" / "results.json").read_text())["config"]["rounds"] == 1
    assert config_from_json(config).same_experiment(config_from_json({**config, "rounds": 9})) == []

    plotted = runner.invoke(app, ["plot", str(tmp_path / "from-file"), "--out", str(tmp_path / "both.png")])
    assert plotted.exit_code == 0 and (tmp_path / "both.png").is_file()

    path.write_text(json.dumps({**config, "colour": "red"}))
    bad = runner.invoke(app, ["simulate", "--config", str(path)])
    assert bad.exit_code == 2 and "unknown key 'colour'" in bad.output and "Traceback" not in bad.output
    bad = runner.invoke(app, ["simulate", "--out", str(tmp_path / "x"), "--algorithm", "fedprox"])
    assert bad.exit_code == 2 and "--algorithm 'fedprox' is unknown" in bad.output
    missing = runner.invoke(app, ["plot", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "does not exist" in missing.output


@pytest.mark.slow
def test_one_hostile_client_does_not_take_the_others_accuracy(tiny_npz, tmp_path, monkeypatch):
    """Client 0 uploads values of 1e30 claiming 10M samples every round: the server's bounds keep the others' model."""
    from edgepfl.device_runtime import round as device_round

    honest_encode = device_round.upload_body
    uploads = []

    def hostile_encode(tensors, received, settings, meta, *rest):
        uploads.append(meta)
        if len(uploads) % 4 == 1:  # all four clients upload each round, in name order: client-000 first
            tensors = {name: np.full_like(value, 1e30) for name, value in tensors.items()}
            meta = dataclasses.replace(meta, num_samples=10_000_000)
        return honest_encode(tensors, received, settings, meta, *rest)

    monkeypatch.setattr(device_round, "upload_body", hostile_encode)
    results = run_simulation(tiny_config(tiny_npz, tmp_path / "run", algorithm="fedper", rounds=3))
    honest = results.rounds[-1].test_accuracy["per_client"][1:]
    assert all(math.isfinite(a) for a in honest) and min(honest) > 0.3, honest  # chance is 10%


@pytest.mark.slow
def test_the_export_runs_in_a_child_and_its_refusal_is_one_line(tiny_npz, tmp_path):
    import subprocess
    import sys

    from edgepfl.errors import UsageError

    with pytest.raises(UsageError, match=r"--kp 5 is outside 0\.\.2 for mlp \(choose 0"):
        run_simulation(tiny_config(tiny_npz, tmp_path / "bad", kp=5))
    # the driver never loads the exporter's libraries: a run with the torch engine imports no onnx
    code = (
        "import sys, json; from edgepfl.simulate.loop import run_simulation; "
        "from edgepfl.simulate.config import SimulateConfig; "
        "run_simulation(SimulateConfig.model_validate(json.loads(sys.argv[1]))); "
        "print(sorted(m for m in ('onnx', 'onnxscript', 'torch.onnx') if m in sys.modules))"
    )
    config = tiny_config(tiny_npz, tmp_path / "run", rounds=1, engine="torch").model_dump(mode="json")
    child = subprocess.run([sys.executable, "-c", code, json.dumps(config)], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().splitlines()[-1] == "[]", child.stdout


@pytest.mark.slow
def test_the_export_child_imports_this_edgepfl_not_one_in_the_working_folder(tiny_npz, tmp_path, monkeypatch):
    """From a folder that holds another `edgepfl` (a source checkout run against an installed wheel, as on the
    GPU machine) the export child imported that one and failed; it must import the package the driver runs."""
    decoy = tmp_path / "checkout" / "edgepfl"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy edgepfl in the working folder was imported')\n")
    monkeypatch.chdir(decoy.parent)
    results = run_simulation(tiny_config(tiny_npz, tmp_path / "run", rounds=1))
    assert len(results.rounds) == 1


def run_killed_in_round_two(monkeypatch, config: SimulateConfig) -> None:
    """Run a 4-client `config` until round 2's first upload is accepted, then stop it as a kill would."""
    from edgepfl.server.engine import RoundEngine

    honest_upload = RoundEngine.accept_update
    uploads = []

    def killed(self, name, round_id, payload):
        uploads.append(round_id)
        if len(uploads) == 6:  # round 2, after client 0's upload was accepted
            raise KeyboardInterrupt
        honest_upload(self, name, round_id, payload)

    monkeypatch.setattr(RoundEngine, "accept_update", killed)
    with pytest.raises(KeyboardInterrupt):
        run_simulation(config)
    monkeypatch.undo()
    assert uploads[-1] == 2


@pytest.mark.slow
def test_int8_uploads_cost_a_quarter_and_an_interrupted_run_resumes_to_the_same_result(tiny_npz, tmp_path, monkeypatch):
    """int8 deltas with stochastic rounding and error feedback: a kill mid-round re-encodes the same bytes."""
    fp32 = run_simulation(tiny_config(tiny_npz, tmp_path / "fp32", rounds=1))
    straight = run_simulation(tiny_config(tiny_npz, tmp_path / "straight", rounds=3, upload_encoding="int8-sr"))
    assert all(r.bytes_up <= 0.27 * fp32.rounds[0].bytes_up for r in straight.rounds)
    assert straight.rounds[-1].test_accuracy["mean"] > 0.5  # chance is 10%
    config = tiny_config(tiny_npz, tmp_path / "resumed", rounds=3, upload_encoding="int8-sr")
    run_killed_in_round_two(monkeypatch, config)
    resumed = run_simulation(config)
    for a, b in zip(straight.rounds, resumed.rounds, strict=True):
        assert a.test_accuracy["per_client"] == b.test_accuracy["per_client"] and a.bytes_up == b.bytes_up
    first, second = final_global_base(tmp_path / "straight"), final_global_base(tmp_path / "resumed")
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])


@pytest.mark.slow
def test_a_run_killed_mid_round_resumes_when_training_does_not_repeat_its_bytes(tiny_npz, tmp_path, monkeypatch):
    """A GPU's training is not bit-reproducible: resumed, the interrupted round's clients upload different bytes.

    The uploads the killed run left in the open round are withdrawn and the round is trained again; before this
    the engine refused client 0's second upload as a different update for the same round.
    """
    from edgepfl.simulate.torch_engine import TorchEngine

    honest_step = TorchEngine.train_step
    run_killed_in_round_two(monkeypatch, tiny_config(tiny_npz, tmp_path / "run", rounds=3))

    # other bytes from the same state, as a GPU gives: the learning rate moves by one part in a thousand
    def other_bytes(self, x, y, lr, **kw):
        return honest_step(self, x, y, lr * 1.001, **kw)

    monkeypatch.setattr(TorchEngine, "train_step", other_bytes)
    resumed = run_simulation(tiny_config(tiny_npz, tmp_path / "run", rounds=3))
    assert [r.round for r in resumed.rounds] == [1, 2, 3] and all(r.sampled == 4 for r in resumed.rounds)
    assert resumed.rounds[-1].test_accuracy["mean"] > 0.5  # chance is 10%


@pytest.mark.slow
@pytest.mark.parametrize("kill_point", ["before_close", "before_evaluation"])
def test_a_run_killed_between_its_uploads_and_its_record_resumes_to_the_same_result(
    tiny_npz, tmp_path, monkeypatch, kill_point
):
    """Killed after round 2's uploads: before the server closed the round, or after it closed it and before the
    round was scored. The second resumed through `_evaluate` without the round's settings (a TypeError, seen on
    a GPU run stopped by its time limit)."""
    from edgepfl.server.engine import RoundEngine
    from edgepfl.simulate import loop

    straight = run_simulation(tiny_config(tiny_npz, tmp_path / "straight", rounds=3))
    honest_close, honest_evaluate = RoundEngine.close_round, loop._evaluate

    def close_round(self, round_id, at_deadline=False):
        if round_id == 2 and kill_point == "before_close":
            raise KeyboardInterrupt
        return honest_close(self, round_id, at_deadline)

    def evaluate(engine, clients, server, global_base, round_id, *rest):
        if round_id == 2 and kill_point == "before_evaluation":
            raise KeyboardInterrupt
        return honest_evaluate(engine, clients, server, global_base, round_id, *rest)

    monkeypatch.setattr(RoundEngine, "close_round", close_round)
    monkeypatch.setattr(loop, "_evaluate", evaluate)
    config = tiny_config(tiny_npz, tmp_path / "resumed", rounds=3)
    with pytest.raises(KeyboardInterrupt):
        run_simulation(config)
    monkeypatch.undo()
    resumed = run_simulation(config)
    assert [r.round for r in resumed.rounds] == [1, 2, 3]
    for a, b in zip(straight.rounds, resumed.rounds, strict=True):
        assert a.test_accuracy["per_client"] == b.test_accuracy["per_client"]
        assert a.trained_test_accuracy["per_client"] == b.trained_test_accuracy["per_client"]


@pytest.mark.slow
def test_a_dp_run_reports_epsilon_and_stops_before_its_target(tiny_npz, tmp_path):
    pytest.importorskip("dp_accounting")
    from typer.testing import CliRunner

    from edgepfl.cli import app
    from edgepfl.privacy import PrivacyLedger
    from edgepfl.simulate.results import load_results, results_table

    ledger = PrivacyLedger(1.0, 1e-5, "fixed")
    one, two = ledger.record_round(4, 2), ledger.record_round(4, 2).record_round(4, 2)
    target = (one.epsilon() + two.epsilon()) / 2
    dp = dict(dp_noise_multiplier=1.0, dp_clip=1.0, fraction=0.5, rounds=3, upload_encoding="int8")
    results = run_simulation(tiny_config(tiny_npz, tmp_path / "dp", **dp, dp_target_epsilon=target))
    assert [r.round for r in results.rounds] == [1] and results.rounds[0].epsilon == pytest.approx(one.epsilon())
    assert "--dp-target-epsilon" in results.stopped and "before round 2" in results.stopped
    document = json.loads((tmp_path / "dp" / "results.json").read_text())
    assert document["rounds"][0]["epsilon"] == results.rounds[0].epsilon and document["summary"]["stopped"]
    assert load_results(tmp_path / "dp").stopped == results.stopped
    table = results_table(results)
    assert "ε" in [column.header for column in table.columns]
    again = run_simulation(tiny_config(tiny_npz, tmp_path / "dp", **dp, dp_target_epsilon=target))
    assert [r.round for r in again.rounds] == [1] and again.stopped == results.stopped
    bad = CliRunner().invoke(
        app,
        [
            "simulate",
            "--out",
            str(tmp_path / "x"),
            "--dp-noise-multiplier",
            "1",
            "--dp-clip",
            "1",
            "--algorithm",
            "pfedla",
        ],
    )
    assert bad.exit_code == 2 and "differential privacy cannot run with --algorithm pfedla" in bad.output
    assert "use --algorithm fedavg or fedper with DP" in bad.output
    assert bad.output.count("\n") == 1


@pytest.mark.slow
def test_a_device_the_machine_lacks_or_an_onnx_engine_on_a_gpu_is_one_line(tiny_npz, tmp_path):
    """--device: cuda without a visible GPU, cuda with an ONNX engine and a non-device are refused in one line."""
    import torch
    from typer.testing import CliRunner

    from edgepfl.cli import app

    runner = CliRunner()
    base = ["simulate", "--out", str(tmp_path / "gpu"), "--model", "mlp", "--dataset", str(tiny_npz)]
    base += ["--data-root", str(tiny_npz.parent), "--clients", "4", "--rounds", "1", "--partition", "classes:2"]
    onnx = runner.invoke(app, [*base, "--engine", "portable", "--device", "cuda"])
    assert onnx.exit_code == 2 and "--device cuda applies to --engine torch" in onnx.output
    assert "Traceback" not in onnx.output
    bad = runner.invoke(app, [*base, "--device", "tpu"])
    assert bad.exit_code == 2 and "--device" in bad.output and "Traceback" not in bad.output
    if not torch.cuda.is_available():
        missing = runner.invoke(app, [*base, "--device", "cuda"])
        assert missing.exit_code == 2 and "this torch sees no CUDA GPU" in missing.output, missing.output
        assert "Traceback" not in missing.output and not (tmp_path / "gpu" / "state.safetensors").exists()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (never in CI)")
def test_a_gpu_run_matches_the_cpu_run(tiny_npz, tmp_path):
    """--device cuda trains the same model as the CPU within float tolerance (cuDNN is not bit-reproducible)."""
    runs = {}
    for device in ("cpu", "cuda"):
        config = tiny_config(tiny_npz, tmp_path / device, model="cnn", norm="batch", device=device)
        runs[device] = run_simulation(config)
    np.testing.assert_allclose(_per_client_losses(runs["cpu"]), _per_client_losses(runs["cuda"]), rtol=2e-3)
    cpu_state, gpu_state = state_of(tmp_path / "cpu"), state_of(tmp_path / "cuda")
    for name, value in cpu_state.items():
        np.testing.assert_allclose(value, gpu_state[name], rtol=1e-2, atol=2e-3, err_msg=name)
