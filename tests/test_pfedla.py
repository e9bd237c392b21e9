"""pFedLA: mixing weights, θ̄ by hand, the hypernetwork step against autograd, durability, a real 2-round run."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # pFedLA's hypernetworks are torch modules

from server_helpers import DeviceClient, LiveServer, enroll, make_bundle, upload_body, wait_status  # noqa: E402
from test_simulate import tiny_config, tiny_npz  # noqa: E402, F401 (tiny_npz: the simulator tests' data fixture)

from edgepfl.errors import StateError, UsageError  # noqa: E402
from edgepfl.manifest import TensorSpec  # noqa: E402
from edgepfl.options import validated  # noqa: E402
from edgepfl.server.config import ServerConfig  # noqa: E402
from edgepfl.server.engine import create_engine  # noqa: E402
from edgepfl.server.errors import Refused  # noqa: E402
from edgepfl.server.http_errors import status_of  # noqa: E402
from edgepfl.server.strategies import make_strategy, strategy_options  # noqa: E402
from edgepfl.server.strategies.pfedla import PFedLA, normalise  # noqa: E402
from edgepfl.server.strategy import AcceptedUpdate  # noqa: E402
from edgepfl.wire import decode_tensors  # noqa: E402

SPECS = [
    TensorSpec("a.weight", (2, 3), "float32", "base", 0),
    TensorSpec("b.bias", (4,), "float32", "base", 1),
    TensorSpec("bn.num_batches_tracked", (), "int64", "buffer", 0),
]


def _strategy(clients: int = 3, hn_lr: float = 5e-3, seed: int = 0) -> PFedLA:
    return make_strategy(strategy_options("pfedla", pfedla_clients=clients, hn_lr=hn_lr), SPECS, seed=seed)


def _tensors(rng: np.random.Generator, shift: float = 0.0) -> dict[str, np.ndarray]:
    return {
        "a.weight": (rng.normal(size=(2, 3)) + shift).astype(np.float32),
        "b.bias": (rng.normal(size=4) + shift).astype(np.float32),
        "bn.num_batches_tracked": np.array(int(rng.integers(0, 100)), dtype=np.int64),
    }


def configure(strategy: PFedLA, round_id: int, device: str, base: dict[str, np.ndarray]) -> tuple:
    """One device's plan: settings and θ̄ (configure_round for a round that samples only `device`)."""
    return strategy.configure_round(round_id, [device], base)[device]


def _distinct_clients(strategy: PFedLA, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """Give every slot its own latest tensors (round 1 starts them all equal, which hides the mixing)."""
    rng = np.random.default_rng(seed)
    strategy.client_tensors = [
        {k: np.asarray(v, dtype=np.float64) for k, v in _tensors(rng, shift=3.0 * slot).items()}
        for slot in range(strategy.num_clients)
    ]
    return [{k: v.copy() for k, v in client.items()} for client in strategy.client_tensors]


def _force_alphas(strategy: PFedLA, slot: int, biases: list[float]) -> None:
    """Heads with zero weights and these biases: α = ReLU(biases) / sum, for every tensor."""
    net = strategy.hypernetwork(slot)
    with torch.no_grad():
        for head in net.heads:
            head.weight.zero_()
            head.bias.copy_(torch.tensor(biases))


def test_mixing_weights_are_non_negative_and_sum_to_one_per_tensor() -> None:
    strategy = _strategy(clients=4)
    for slot in range(4):
        alphas = strategy.mixing_weights(slot)
        assert sorted(alphas) == ["a.weight", "b.bias"]  # integer buffers are not mixed
        for alpha in alphas.values():
            assert alpha.shape == (4,) and (alpha >= 0).all()
            assert alpha.sum() == pytest.approx(1.0, abs=1e-6)
    assert not np.allclose(strategy.mixing_weights(0)["a.weight"], strategy.mixing_weights(1)["a.weight"])
    matrix = strategy.alpha_matrix("b.bias")
    assert matrix.shape == (4, 4)
    np.testing.assert_allclose(matrix[2], strategy.mixing_weights(2)["b.bias"])
    with pytest.raises(UsageError, match="not a mixed tensor"):
        strategy.alpha_matrix("bn.num_batches_tracked")


def test_a_zero_sum_falls_back_to_the_clients_own_one_hot() -> None:
    np.testing.assert_array_equal(normalise(torch.zeros(3), 2).numpy(), [0.0, 0.0, 1.0])
    np.testing.assert_allclose(normalise(torch.tensor([1.0, 0.0, 3.0]), 0).numpy(), [0.25, 0.0, 0.75])
    strategy = _strategy()
    start = _tensors(np.random.default_rng(0))
    configure(strategy, 1, "x", start)
    configure(strategy, 1, "y", start)
    clients = _distinct_clients(strategy)
    _force_alphas(strategy, 1, [-1.0, -2.0, -0.5])  # every ReLU output is zero
    _, payload = configure(strategy, 2, "y", start)
    for name, value in clients[1].items():
        np.testing.assert_allclose(payload[name], value, rtol=1e-6)


def test_theta_bar_matches_a_hand_computation() -> None:
    strategy = _strategy()
    start = _tensors(np.random.default_rng(0))
    assert configure(strategy, 1, "x", start)[1]["a.weight"].dtype == np.float32
    clients = _distinct_clients(strategy)
    _force_alphas(strategy, 0, [1.0, 3.0, -5.0])  # α = (0.25, 0.75, 0)
    _, payload = configure(strategy, 2, "x", start)
    for name in ("a.weight", "b.bias"):
        expected = 0.25 * clients[0][name] + 0.75 * clients[1][name]
        np.testing.assert_allclose(payload[name], expected, rtol=1e-6)
    assert payload["bn.num_batches_tracked"] == clients[0]["bn.num_batches_tracked"]  # kept, not mixed


def test_hypernetwork_update_equals_autograd_of_the_mix() -> None:
    lr = 0.05
    strategy = _strategy(hn_lr=lr)
    start = _tensors(np.random.default_rng(0))
    for device in ("x", "y", "z"):
        configure(strategy, 1, device, start)
    clients = _distinct_clients(strategy)
    sent = configure(strategy, 2, "y", start)[1]
    trained = {k: (v + np.random.default_rng(5).normal(size=v.shape)).astype(v.dtype) for k, v in sent.items()}

    reference = copy.deepcopy(strategy.hypernetwork(1))  # an independent autograd computation of the same step
    alphas = reference(1)
    objective = torch.zeros((), dtype=torch.float64)
    for name in ("a.weight", "b.bias"):
        stacked = torch.tensor(np.stack([client[name] for client in clients]))  # (N, ...)
        mixed = torch.tensordot(alphas[name].double(), stacked, dims=1)  # θ̄ as a torch function of φ
        minus_delta = torch.tensor(sent[name], dtype=torch.float64) - torch.tensor(trained[name], dtype=torch.float64)
        objective = objective + (mixed * minus_delta).sum()  # ⟨θ̄(φ), −Δθ⟩: its gradient is the VJP
    objective.backward()
    expected = {
        key: (value if value.grad is None else value - lr * value.grad).detach()
        for key, value in reference.named_parameters()
    }

    strategy.aggregate(2, [AcceptedUpdate("y", 10, trained)], start)
    updated = dict(strategy.hypernetwork(1).named_parameters())
    changed = 0
    for key, value in expected.items():
        torch.testing.assert_close(updated[key].detach(), value, rtol=1e-4, atol=1e-6)
        changed += int(not torch.equal(value, reference.state_dict()[key]))
    assert changed >= 2  # the step moved the embedding/network, not a no-op
    for name, value in trained.items():
        np.testing.assert_allclose(strategy.client_tensors[1][name], value, rtol=1e-6)  # θᵢ is stored


def test_uniform_alpha_is_fedavg_and_one_hot_self_is_local_training() -> None:
    rng = np.random.default_rng(3)
    start = _tensors(rng)
    strategy = _strategy(hn_lr=1e-12)  # α stays where it is forced
    for slot, device in enumerate(("x", "y", "z")):
        configure(strategy, 1, device, start)
        _force_alphas(strategy, slot, [1.0, 1.0, 1.0])
    uploads = {device: _tensors(rng, shift=i) for i, device in enumerate(("x", "y", "z"))}
    strategy.aggregate(1, [AcceptedUpdate(d, 10, t) for d, t in uploads.items()], start)
    fedavg = make_strategy("fedavg", SPECS[:2])
    average = fedavg.aggregate(1, [AcceptedUpdate(d, 10, t) for d, t in uploads.items()], start)
    for device in ("x", "y", "z"):
        _, payload = configure(strategy, 2, device, start)
        for name in ("a.weight", "b.bias"):
            np.testing.assert_allclose(payload[name], average[name], rtol=1e-6)

    strategy = _strategy()
    for slot, device in enumerate(("x", "y", "z")):
        configure(strategy, 1, device, start)
        _force_alphas(strategy, slot, [-1.0] * slot + [2.0] + [-1.0] * (2 - slot))
    strategy.aggregate(1, [AcceptedUpdate(d, 10, t) for d, t in uploads.items()], start)
    for device, upload in uploads.items():
        _, payload = configure(strategy, 2, device, start)
        for name, value in upload.items():
            np.testing.assert_array_equal(payload[name], value)  # each client continues from its own model


def test_options_and_slots_are_checked(monkeypatch) -> None:
    with pytest.raises(UsageError, match="--pfedla-clients"):
        _strategy(clients=0)
    with pytest.raises(UsageError, match=r"--hn-lr 0\.0: input should be greater than 0 \(pass e\.g\. --hn-lr"):
        validated(ServerConfig, {"bundle": ".", "state": ".", "strategy": "pfedla", "hn_lr": 0.0})
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "torch", None)
        with pytest.raises(UsageError, match="needs torch"):
            _strategy()
    strategy = _strategy(clients=2)
    start = _tensors(np.random.default_rng(0))
    configure(strategy, 1, "x", start)
    configure(strategy, 1, "y", start)
    with pytest.raises(UsageError, match="mixes 2 clients"):
        configure(strategy, 1, "z", start)
    with pytest.raises(StateError, match="3 clients"):
        _strategy(clients=2).load_state(_strategy(clients=3).state_bytes() or _started(_strategy(clients=3)))


def _started(strategy: PFedLA) -> bytes:
    configure(strategy, 1, "x", _tensors(np.random.default_rng(0)))
    return strategy.state_bytes()


# through the round engine and the real server


@pytest.fixture
def engine_setup(tmp_path: Path):
    manifest = make_bundle(tmp_path / "bundle")
    config = ServerConfig(
        bundle=tmp_path / "bundle",
        state=tmp_path / "state",
        strategy=strategy_options("pfedla", pfedla_clients=3, hn_lr=0.05),
        min_clients=3,
        round_timeout=100,
        rounds=5,
    )
    enroll(config.state, "d0", "d1", "d2")
    return manifest, config


class Clock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _play_round(engine, manifest, round_id: int, shift: float) -> list[AcceptedUpdate]:
    """Every device trains (adds a device-specific shift to its base) and uploads; returns what they uploaded."""
    uploads = []
    for number, device in enumerate(("d0", "d1", "d2")):
        assert engine.task(device).action == "train"
        sent = decode_tensors(engine.base_for(device, round_id)[0])
        new = {k: v + np.float32(shift * (number + 1)) for k, v in sent.items()}
        engine.accept_update(device, round_id, upload_body(new, manifest, num_samples=10))
        uploads.append(AcceptedUpdate(device, 10, new))
    return uploads


def _assert_same_state(first: bytes, second: bytes) -> None:
    one, two = decode_tensors(first), decode_tensors(second)
    assert sorted(one) == sorted(two)
    for key, value in one.items():
        np.testing.assert_allclose(two[key], value, rtol=1e-5, atol=1e-7, err_msg=key)


def test_restart_keeps_the_strategy_state_and_a_failed_close_does_not_step_twice(engine_setup) -> None:
    manifest, config = engine_setup
    clock = Clock()
    engine = create_engine(config, clock)
    reference = make_strategy(config.strategy, engine.specs, config.settings, config.seed)
    start = decode_tensors(engine.store.blobs.read(engine.store.get_meta("initial_base_sha")))
    for device in ("d0", "d1", "d2"):
        engine.task(device)
        configure(reference, 1, device, start)
    reference.aggregate(1, _play_round(engine, manifest, 1, 0.5), start)
    engine.tick()
    assert engine.store.round(1).state == "closed"
    saved = engine.strategy.state_bytes()
    _assert_same_state(saved, reference.state_bytes())
    restarted = create_engine(config, clock)  # as after kill -9: only the state folder survives
    assert restarted.strategy.state_bytes() == saved
    for device in ("d0", "d1", "d2"):
        engine.task(device)
    uploads = _play_round(engine, manifest, 2, -0.25)
    reference.aggregate(2, uploads, start)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # dies between the aggregation (which stepped the hypernetworks) and the commit

    finish_round = engine.store.finish_round
    engine.store.finish_round = crash
    with pytest.raises(KeyboardInterrupt):
        engine.tick()
    engine.store.finish_round = finish_round
    assert engine.store.round(2).state == "open"
    engine.tick()  # the strategy was brought back to its saved state: closing again steps once
    assert engine.store.round(2).state == "closed"
    _assert_same_state(engine.strategy.state_bytes(), reference.state_bytes())
    restarted = create_engine(config, clock)
    assert restarted.strategy.state_bytes() == engine.strategy.state_bytes() != saved


@pytest.mark.slow
def test_two_rounds_through_the_real_server_match_the_strategy_in_process(tmp_path: Path) -> None:
    manifest = make_bundle(tmp_path / "bundle")
    tokens = enroll(tmp_path / "state", "a", "b", "c")
    options = ("--strategy", "pfedla", "--pfedla-clients", "3", "--min-clients", "3", "--rounds", "2")
    options += ("--poll-interval", "0.2")
    server = LiveServer(tmp_path / "bundle", tmp_path / "state", *options).start()
    reference = make_strategy(strategy_options("pfedla", pfedla_clients=3), manifest.shared(False))
    initial = decode_tensors((tmp_path / "bundle" / "portable" / "initial.safetensors").read_bytes())
    start = {name: initial[name] for name in manifest.names("base")}
    try:
        devices = {name: DeviceClient(server.url, token) for name, token in tokens.items()}
        for device in devices.values():
            device.task()
        for round_id in (1, 2):
            updates = []
            for shift, (name, device) in zip((0.5, -1.0, 2.0), devices.items()):
                task = device.wait_for_train()
                assert task["round"] == round_id
                base = device.base(round_id)
                expected = configure(reference, round_id, name, start)[1]
                assert sorted(base) == sorted(manifest.names("base"))  # the personal head never travels
                for tensor, value in expected.items():
                    np.testing.assert_allclose(base[tensor], value, rtol=1e-5, atol=1e-6)
                new = {k: v + np.float32(shift * round_id) for k, v in base.items()}
                assert device.upload(round_id, upload_body(new, manifest, num_samples=10)).status_code == 200
                updates.append(AcceptedUpdate(name, 10, new))
            wait_status(server.url, tokens["a"], lambda s, r=round_id: s["rounds_completed"] == r)
            reference.aggregate(round_id, updates, start)
        bases = [devices[name].base(2)["mid.weight"] for name in ("a", "b", "c")]
        assert not np.allclose(bases[0], bases[1])  # personalised: round 2 sent each device its own mix
        assert devices["a"].task()["action"] == "done"
    finally:
        server.kill()


@pytest.mark.slow
def test_strategy_state_survives_a_kill_between_rounds_of_the_real_server(tmp_path: Path) -> None:
    manifest = make_bundle(tmp_path / "bundle")
    tokens = enroll(tmp_path / "state", "a", "b")
    options = ("--strategy", "pfedla", "--pfedla-clients", "2", "--min-clients", "2", "--rounds", "3")
    options += ("--poll-interval", "0.2")
    reference = make_strategy(strategy_options("pfedla", pfedla_clients=2), manifest.shared(False))
    initial = decode_tensors((tmp_path / "bundle" / "portable" / "initial.safetensors").read_bytes())
    start = {name: initial[name] for name in manifest.names("base")}
    server = LiveServer(tmp_path / "bundle", tmp_path / "state", *options).start()
    try:
        for round_id in (1, 2, 3):
            devices = {name: DeviceClient(server.url, token) for name, token in tokens.items()}
            for device in devices.values():
                device.task()
            updates = []
            for shift, (name, device) in zip((1.0, -2.0), devices.items()):
                assert device.wait_for_train()["round"] == round_id
                base = device.base(round_id)
                expected = configure(reference, round_id, name, start)[1]
                for tensor, value in expected.items():
                    np.testing.assert_allclose(base[tensor], value, rtol=1e-5, atol=1e-6)
                new = {k: v + np.float32(shift) for k, v in base.items()}
                assert device.upload(round_id, upload_body(new, manifest, num_samples=10)).status_code == 200
                updates.append(AcceptedUpdate(name, 10, new))
            wait_status(server.url, tokens["a"], lambda s, r=round_id: s["rounds_completed"] == r)
            reference.aggregate(round_id, updates, start)
            server.kill()  # kill -9 after every round: the next round's mixes need the saved hypernetworks
            server = LiveServer(tmp_path / "bundle", tmp_path / "state", *options).start()
    finally:
        server.kill()


# the simulator


@pytest.mark.slow
@pytest.mark.parametrize("kp", [0, 1])  # kp=0: the paper's pFedLA; kp=1: it mixes the base, the head stays
def test_simulate_pfedla_runs_two_rounds_and_keeps_each_clients_model(tiny_npz, tmp_path: Path, kp: int) -> None:  # noqa: F811
    from edgepfl.server.store import Store
    from edgepfl.simulate.loop import STATE_FILE, run_simulation
    from edgepfl.simulate.rounds import SERVER_DIR, final_global_base
    from edgepfl.wire import decode_metadata

    out = tmp_path / "pfedla"
    results = run_simulation(tiny_config(tiny_npz, out, algorithm="pfedla", hn_lr=0.01, kp=kp))
    document = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in document["rounds"]] == [1, 2] and document["info"]["strategy"] == "pfedla"
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in document["rounds"])
    assert results.rounds[-1].test_accuracy["mean"] > 0.3  # two classes per client: well above chance (10%)
    state = decode_tensors((out / STATE_FILE).read_bytes())
    store = Store(out / SERVER_DIR)  # the served round engine's state: simulate aggregates through it
    payload = store.blobs.read(store.get_meta("strategy_state_sha"))
    store.close()
    slots = json.loads(decode_metadata(payload)["pfedla"])["slots"]
    assert sorted(slots) == [f"client-{i:03d}" for i in range(4)]
    stored = decode_tensors(payload)
    base_names = list(final_global_base(out))
    client_names = [k.removeprefix("client-000/") for k in state if k.startswith("client-000/")]
    assert document["info"]["kp"] == kp and (set(base_names) == set(client_names)) == (kp == 0)
    for client, slot in slots.items():  # the server side holds what each client trained (all are sampled)
        for name in base_names:
            np.testing.assert_allclose(stored[f"client/{slot}/{name}"], state[f"{client}/{name}"], rtol=1e-6)
    assert not np.allclose(state[f"client-000/{base_names[0]}"], state[f"client-001/{base_names[0]}"])


@pytest.mark.slow
def test_simulate_pfedla_resumes_with_its_hypernetworks(tiny_npz, tmp_path: Path) -> None:  # noqa: F811
    from edgepfl.simulate.loop import run_simulation

    fields = {"algorithm": "pfedla", "hn_lr": 0.05}
    straight = run_simulation(tiny_config(tiny_npz, tmp_path / "straight", rounds=3, **fields))
    run_simulation(tiny_config(tiny_npz, tmp_path / "resumed", rounds=2, **fields))
    resumed = run_simulation(tiny_config(tiny_npz, tmp_path / "resumed", rounds=3, **fields))
    for a, b in zip(straight.rounds, resumed.rounds):
        np.testing.assert_allclose(a.test_accuracy["per_client"], b.test_accuracy["per_client"], atol=1e-6)
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-6)
    assert resumed.alpha == straight.alpha


@pytest.mark.slow
def test_rerunning_a_finished_pfedla_run_keeps_its_mixing_weights(tiny_npz, tmp_path: Path) -> None:  # noqa: F811
    """A finished run started again (bench/reproduce.py resumes every run) rewrote results.json without alpha."""
    from edgepfl.simulate.loop import run_simulation
    from edgepfl.simulate.results import load_results

    config = tiny_config(tiny_npz, tmp_path / "run", rounds=2, algorithm="heurpfedla", hn_lr=0.05)
    finished = run_simulation(config)
    assert finished.alpha
    again = run_simulation(config)
    assert again.alpha == finished.alpha
    assert load_results(tmp_path / "run").alpha == finished.alpha


# HeurpFedLA


def test_heurpfedla_leaves_the_top_self_weight_tensors_out_both_ways() -> None:
    strategy = make_strategy(strategy_options("heurpfedla", pfedla_clients=2, retain_top_k=1, hn_lr=0.05), SPECS)
    start = _tensors(np.random.default_rng(0))
    configure(strategy, 1, "x", start)
    configure(strategy, 1, "y", start)
    clients = _distinct_clients(strategy)
    net = strategy.hypernetwork(0)
    with torch.no_grad():  # self-weight 0.9 for b.bias, 0.5 for a.weight
        for head, biases in zip(net.heads, ([1.0, 1.0], [9.0, 1.0])):
            head.weight.zero_()
            head.bias.copy_(torch.tensor(biases))
    assert strategy.retained("x") == ["b.bias"]
    _, payload = configure(strategy, 2, "x", start)
    assert sorted(payload) == ["a.weight", "bn.num_batches_tracked"]
    np.testing.assert_allclose(payload["a.weight"], 0.5 * clients[0]["a.weight"] + 0.5 * clients[1]["a.weight"])
    heads_before = [head.weight.detach().clone() for head in net.heads]
    trained = {name: value + np.float32(1.0) if name == "a.weight" else value for name, value in payload.items()}
    strategy.aggregate(2, [AcceptedUpdate("x", 10, trained)], start)
    np.testing.assert_allclose(strategy.client_tensors[0]["a.weight"], trained["a.weight"], rtol=1e-6)
    np.testing.assert_array_equal(strategy.client_tensors[0]["b.bias"], clients[0]["b.bias"])  # stale, as not sent
    assert not torch.equal(net.heads[0].weight, heads_before[0])  # a.weight's head learnt
    assert torch.equal(net.heads[1].weight, heads_before[1])  # b.bias's head had nothing to learn from
    with pytest.raises(UsageError, match="k=3"):
        make_strategy(strategy_options("heurpfedla", pfedla_clients=2, retain_top_k=3), SPECS)


def test_served_heurpfedla_names_the_kept_tensors_and_refuses_uploads_that_carry_them(engine_setup) -> None:
    """The device is told what it keeps; its base lacks those tensors, and an upload holding one is a 422."""
    manifest, config = engine_setup
    options = strategy_options("heurpfedla", **config.strategy.model_dump(exclude={"name"}), retain_top_k=1)
    engine = create_engine(config.model_copy(update=dict(strategy=options)), Clock())
    for device in ("d0", "d1", "d2"):
        task = engine.task(device)
    shared = {spec.name for spec in manifest.shared(False)}
    for device in ("d0", "d1", "d2"):
        task = engine.task(device)
        assert task.action == "train"
        kept = set(task.settings.kept_on_device)
        assert len(kept) == 1 and kept < shared
        assert engine.strategy.retained(device) == list(task.settings.kept_on_device)
        base = decode_tensors(engine.base_for(device, task.round_id)[0])
        assert set(base) == shared - kept
        whole = {**base, **{name: np.zeros(manifest.tensor(name).shape, np.float32) for name in kept}}
        with pytest.raises(Refused) as refused:
            engine.accept_update(device, task.round_id, upload_body(whole, manifest))
        assert status_of(refused.value) == 422 and refused.value.error == "bad_tensors"
        assert next(iter(kept)) in refused.value.problem
        assert engine.accept_update(device, task.round_id, upload_body(base, manifest))["accepted"]


def test_round_settings_carry_kept_tensors_over_the_wire() -> None:
    from edgepfl.errors import WireError
    from edgepfl.protocol import RoundSettings, Task

    settings = RoundSettings(kept_on_device=("a.weight",))
    task = Task("train", "hash", 3, settings, "/v1/rounds/3/base", 1.0)
    assert Task.from_json(json.loads(json.dumps(task.to_json()))).settings == settings
    assert [spec.name for spec in settings.travelling(SPECS)] == ["b.bias", "bn.num_batches_tracked"]
    malformed = {**task.to_json(), "settings": {**settings.to_json(), "kept_on_device": "a.weight"}}
    with pytest.raises(WireError, match="kept_on_device"):
        Task.from_json(malformed)


@pytest.mark.slow
def test_simulate_heurpfedla_never_sends_the_retained_tensors(tiny_npz, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    from edgepfl.server.strategies.heurpfedla import HeurPFedLA
    from edgepfl.simulate.loop import run_simulation

    sent: dict[tuple[int, str], tuple[set, set]] = {}
    uploaded: list[tuple[int, str, set]] = []
    configure_round, aggregate = HeurPFedLA.configure_round, HeurPFedLA.aggregate

    def spy_configure(self, round_id, sampled, global_base):
        plans = configure_round(self, round_id, sampled, global_base)
        for device, (_, payload) in plans.items():
            sent.setdefault((round_id, device), (set(payload), set(self.retained(device))))
        return plans

    def spy_aggregate(self, round_id, updates, global_base):
        updates = list(updates)
        uploaded.extend((round_id, u.device, set(u.base_tensors)) for u in updates)
        return aggregate(self, round_id, updates, global_base)

    monkeypatch.setattr(HeurPFedLA, "configure_round", spy_configure)
    monkeypatch.setattr(HeurPFedLA, "aggregate", spy_aggregate)
    heur = run_simulation(tiny_config(tiny_npz, tmp_path / "heur", algorithm="heurpfedla", retain_top_k=1))
    plain = run_simulation(tiny_config(tiny_npz, tmp_path / "plain", algorithm="pfedla"))
    assert len(uploaded) == 8  # 4 clients x 2 rounds
    for round_id, device, names in uploaded:
        payload, retained = sent[(round_id, device)]
        assert len(retained) == 1 and not names & retained and names == payload
    for mine, theirs in zip(heur.rounds, plain.rounds):
        assert mine.bytes_kept > 0 and theirs.bytes_kept == 0
        assert mine.bytes_up < theirs.bytes_up and mine.bytes_down < theirs.bytes_down
    assert heur.rounds[-1].test_accuracy["mean"] > 0.3


@pytest.mark.slow
def test_device_processes_run_two_pfedla_rounds_against_a_real_server(bundle_factory, tmp_path: Path) -> None:
    """`edgepfl device run` processes (torch blocked) and `edgepfl serve --strategy pfedla` on loopback."""
    import subprocess

    from conftest import REPO
    from test_device_e2e import device_command, finish, run_args, stored_updates
    from test_device_runtime import DEVICE_BUNDLE, save_npz

    from edgepfl.manifest import load_manifest
    from edgepfl.server.store import Store

    bundle = bundle_factory(**{**DEVICE_BUNDLE, "engines": ("portable",)})
    manifest = load_manifest(bundle)
    names = ("a", "b", "c")
    tokens = enroll(tmp_path / "server", *names)
    options = ("--strategy", "pfedla", "--pfedla-clients", "3", "--min-clients", "3", "--rounds", "2", "--lr", "0.1")
    options += ("--poll-interval", "0.2", "--batch-size", "16", "--round-timeout", "120")
    server = LiveServer(bundle, tmp_path / "server", *options).start()
    try:
        processes = {}
        for index, name in enumerate(names):
            data = save_npz(tmp_path / f"{name}.npz", (index, index + 1), 120, seed=index)
            args = run_args(bundle, data, server, tokens[name], tmp_path / name, "--engine", "portable")
            processes[name] = subprocess.Popen(
                device_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
            )
        results = {name: finish(process) for name, process in processes.items()}
    finally:
        server.stop()
    for result in results.values():
        assert result["finished"] and result["rounds_trained"] == 2, result
    updates = stored_updates(tmp_path / "server")
    assert sorted(updates) == [1, 2]
    for by_device in updates.values():
        assert sorted(by_device) == list(names)
        for tensors in by_device.values():  # pFedLA mixes the base only: the personal block never left a device
            assert sorted(tensors) == sorted(manifest.names("base"))
    store = Store(tmp_path / "server")
    try:
        sent = {name: decode_tensors(store.blobs.read(store.assignment(2, name).base_sha)) for name in names}
        assert store.get_meta("strategy_state_sha") is not None
    finally:
        store.close()
    first = manifest.names("base")[0]
    assert not np.allclose(sent["a"][first], sent["b"][first])  # round 2: each device got its own mix


class RecordingTransport:
    """An httpx transport that keeps every request body and response body a device exchanged."""

    def __init__(self) -> None:
        import httpx

        self.inner = httpx.HTTPTransport()
        self.exchanges: list[tuple[str, str, bytes, bytes]] = []  # method, path, request body, response body

    def handle_request(self, request):
        response = self.inner.handle_request(request)
        response.read()
        self.exchanges.append((request.method, request.url.path, request.read(), response.content))
        return response

    def close(self) -> None:
        self.inner.close()


@pytest.mark.slow
def test_heurpfedla_devices_never_send_or_receive_the_tensors_they_keep(bundle_factory, tmp_path: Path) -> None:
    """`edgepfl serve --strategy heurpfedla`, two device processes and one in-process device whose HTTP is recorded."""
    import subprocess

    from conftest import REPO
    from test_device_e2e import device_command, finish, run_args, stored_updates
    from test_device_runtime import DEVICE_BUNDLE, save_npz

    from edgepfl.data import load_device_data
    from edgepfl.device_runtime.client import RetryPolicy, ServerClient
    from edgepfl.device_runtime.engine import open_engine
    from edgepfl.device_runtime.options import DeviceOptions
    from edgepfl.device_runtime.runner import run_device
    from edgepfl.device_runtime.state import StateFolder
    from edgepfl.manifest import load_manifest
    from edgepfl.protocol import RoundSettings
    from edgepfl.server.store import Store

    bundle = bundle_factory(**{**DEVICE_BUNDLE, "engines": ("portable",)})
    manifest = load_manifest(bundle)
    base_names = set(manifest.names("base"))
    names = ("a", "b", "c")
    tokens = enroll(tmp_path / "server", *names)
    options = ("--strategy", "heurpfedla", "--retain-top-k", "1", "--pfedla-clients", "3", "--min-clients", "3")
    options += ("--rounds", "2", "--lr", "0.1", "--poll-interval", "0.2", "--batch-size", "16")
    server = LiveServer(bundle, tmp_path / "server", *options).start()
    recorder = RecordingTransport()
    try:
        processes = {}
        for index, name in enumerate(names[:2]):
            data = save_npz(tmp_path / f"{name}.npz", (index, index + 1), 120, seed=index)
            args = run_args(bundle, data, server, tokens[name], tmp_path / name, "--engine", "portable")
            processes[name] = subprocess.Popen(
                device_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
            )
        engine = open_engine(bundle, "portable")
        data = load_device_data(save_npz(tmp_path / "c.npz", (2, 3), 120, seed=2), manifest, 0.2, 0)
        state = StateFolder(tmp_path / "c", manifest, engine.name)
        initial = engine.get_tensors()
        client = ServerClient(server.url, tokens["c"], RetryPolicy(attempts=3), transport=recorder)
        summary = run_device(engine, data, state, client, DeviceOptions(poll_interval=0.1))
        results = {name: finish(process) for name, process in processes.items()}
    finally:
        server.stop()
    assert summary.finished and summary.rounds_trained == 2
    for result in results.values():
        assert result["finished"] and result["rounds_trained"] == 2, result
    kept_by_round = {}
    for method, path, _, body in recorder.exchanges:
        if method == "GET" and path == "/v1/task" and json.loads(body)["action"] == "train":
            task = json.loads(body)
            kept_by_round[task["round"]] = set(RoundSettings.from_json(task["settings"]).kept_on_device)
    assert sorted(kept_by_round) == [1, 2] and all(len(kept) == 1 for kept in kept_by_round.values())
    bases = uploads = 0
    for _, path, sent, received in recorder.exchanges:
        if path.endswith("/base"):
            round_id = int(path.split("/")[3])
            assert set(decode_tensors(received)) == base_names - kept_by_round[round_id]  # never received
            bases += 1
        elif path.endswith("/update"):
            round_id = int(path.split("/")[3])
            assert set(decode_tensors(sent)) == base_names - kept_by_round[round_id]  # never sent
            uploads += 1
    assert bases == 2 and uploads == 2
    kept = next(iter(kept_by_round[2]))  # the device trained its own copy of what it kept
    assert not np.array_equal(engine.get_tensors([kept])[kept], initial[kept])
    store = Store(tmp_path / "server")
    try:  # the other devices' stored uploads leave out what each was told to keep
        for round_id, by_device in stored_updates(tmp_path / "server").items():
            for device, tensors in by_device.items():
                told = RoundSettings.from_json(json.loads(store.assignment(round_id, device).settings))
                assert set(tensors) == base_names - set(told.kept_on_device) and told.kept_on_device
    finally:
        store.close()


def test_a_device_beyond_the_clients_pfedla_mixes_gets_one_409_and_the_others_train(engine_setup) -> None:
    """A fourth device where pfedla mixes three: the round opens for three, the fourth is told it cannot join."""
    _, config = engine_setup
    enroll(config.state, "d3")
    clock = Clock()
    engine = create_engine(config, clock)
    for device in ("d3", "d0", "d1", "d2"):  # four available, three places: the round waits for no one
        assert engine.task(device).action == "wait"
    clock.now += config.poll_interval
    assert engine.task("d0").action == "train"
    assert engine.store.open_round().sampled == ("d0", "d1", "d2")
    with pytest.raises(Refused) as refused:
        engine.task("d3")
    assert status_of(refused.value) == 409 and refused.value.error == "cannot_join"
    assert "'d3'" in refused.value.problem and "--pfedla-clients" in refused.value.fix
    assert engine.task("d1").action == engine.task("d2").action == "train"


def test_pfedla_admits_newcomers_only_into_free_places() -> None:
    strategy = _strategy(clients=2)
    assert strategy.admissible(["a", "b", "c"]) == ["a", "b"]
    configure(strategy, 1, "b", _tensors(np.random.default_rng(0)))
    assert strategy.admissible(["a", "b", "c"]) == ["a", "b"]  # b holds a place; one is free, for a
    configure(strategy, 1, "c", _tensors(np.random.default_rng(0)))
    assert strategy.admissible(["a", "b", "c"]) == ["b", "c"]
    strategy.check_device("b")
    with pytest.raises(UsageError, match="all 2 places"):
        strategy.check_device("a")


def test_serve_refuses_more_min_clients_than_pfedla_clients(engine_setup) -> None:
    _, config = engine_setup
    with pytest.raises(UsageError, match="--min-clients 4 is more than the 3 clients"):
        ServerConfig.model_validate({**dict(config), "min_clients": 4})


# issue 18: the lost clients


def test_every_client_starts_with_a_positive_weight_on_every_client() -> None:
    """With PyTorch's default head init about half the αˡʲ started at 0, own weights included, and ReLU never let
    them back (a client mixed only from others lost its classes); the heads now start every weight positive."""
    strategy = _strategy(clients=10)
    for tensor in strategy.mixed:
        matrix = strategy.alpha_matrix(tensor)
        assert (matrix > 0.02).all(), f"{tensor}: a client starts without weight on some client"
        assert matrix.diagonal().min() > 0.02


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_pfedla_leaves_no_client_below_chance_on_a_two_class_split(tiny_npz, tmp_path: Path, seed: int) -> None:  # noqa: F811
    """6 clients holding 2 classes each, each round's held model (the client's own mix θ̄ᵢ) on its test split.

    Before issue 18's head initialisation a client could start with no weight on itself and never regain it
    (with this budget the run then ended in NaN mixes). The budget is one at which the hypernetworks move within
    a test's few rounds (5 local epochs, hn_lr 100x the default): at the default budget the mix stays near
    uniform, FedAvg-like, for tens of rounds (bench/results/NOTES-issue18.md), and FedAvg itself leaves clients
    of such a split at 0% early on. Chance for the 10-class model is 10%; the bound is three times that.
    """
    from edgepfl.simulate.loop import run_simulation

    config = tiny_config(
        tiny_npz, tmp_path / "run", algorithm="pfedla", kp=0, clients=6, rounds=5, epochs=5, hn_lr=0.5, seed=seed
    )
    results = run_simulation(config)
    worst = [min(record.test_accuracy["per_client"]) for record in results.rounds]
    assert worst[-1] >= 0.3, worst
    assert worst[-1] > worst[0], worst  # the mixes personalise: the worst client gains round on round


@pytest.mark.slow
def test_pfedla_refuses_a_model_that_shares_nothing(tiny_npz, tmp_path: Path) -> None:  # noqa: F811
    """mlp has 2 blocks: --kp 2 made every tensor personal, and pfedla silently ran local training."""
    from edgepfl.simulate.loop import run_simulation

    buffers_only = [TensorSpec("bn.num_batches_tracked", (), "int64", "buffer", 0)]
    with pytest.raises(UsageError, match="shares none"):
        make_strategy(strategy_options("pfedla", pfedla_clients=2), buffers_only)
    with pytest.raises(UsageError, match="shares none"):
        run_simulation(tiny_config(tiny_npz, tmp_path / "run", algorithm="pfedla", kp=2))
