"""edgepfl in Flower: the strategy runs edgepfl's round engine, the ClientApp is the device runtime.

A Flower simulation (Ray backend) of 3 nodes x 2 rounds ends with edgepfl simulate's global base and
every client's tensors, bit for bit; replies are checked as `edgepfl serve` checks uploads; the ClientApp
trains without torch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import run_without_torch
from test_simulate import state_of, tiny_config, tiny_npz  # noqa: F401  (tiny_npz is a fixture)

pytest.importorskip("torch")  # the reference run exports its bundle with torch
pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from edgepfl.device_runtime.state import StateFolder  # noqa: E402
from edgepfl.errors import UsageError  # noqa: E402
from edgepfl.flower.client_app import make_client_app  # noqa: E402
from edgepfl.flower.config import node_config, server_config  # noqa: E402
from edgepfl.flower.messages import BASE, UPLOAD  # noqa: E402
from edgepfl.flower.strategy import EdgePFLStrategy  # noqa: E402
from edgepfl.manifest import load_manifest  # noqa: E402
from edgepfl.server.strategies import strategy_options  # noqa: E402
from edgepfl.simulate.bundle import initial_tensors  # noqa: E402
from edgepfl.simulate.loop import run_simulation  # noqa: E402
from edgepfl.simulate.rounds import final_global_base, open_server  # noqa: E402

NODES = {11: "client-000", 12: "client-001", 13: "client-002"}


def flower_run_config(config, root) -> dict:
    """The Flower run config that asks for the same run as an edgepfl simulate config (its bundle, data, seed)."""
    return {
        "bundle": str(root / "sim" / "bundle"),
        "out": str(root / "flower"),
        "strategy": config.plan.strategy,
        "rounds": config.rounds,
        "nodes": config.data.clients,
        "min-clients": config.min_clients,
        "fraction": config.fraction,
        "seed": config.seed,
        "algorithm": config.plan.client,
        "epochs": config.round.epochs,
        "batch-size": config.round.batch_size,
        "lr": config.round.lr,
        **({"hn-lr": config.strategy_knobs.hn_lr} if config.plan.strategy in ("pfedla", "heurpfedla") else {}),
        "engine": config.engine,
        "threads": 1,
        "dataset": config.data.dataset,
        "data-root": config.data.data_root,
        "partition": config.data.partition,
        "clients": config.data.clients,
        "state-root": str(root / "devices"),
        # a round's deadline: the simulations below start Ray and three nodes, which on a loaded 2-core
        # machine took longer than 120 s (both simulations ended without a global base)
        "timeout": 600,
    }


@pytest.fixture
def task_identity():
    """Messages made outside a Flower runtime need the identity a ServerApp process has (set back afterwards)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@pytest.fixture(scope="module")
def reference(tiny_npz, tmp_path_factory):  # noqa: F811
    """A one-round edgepfl simulate run of 3 portable clients: its config and folder (its bundle is the Flower one)."""
    root = tmp_path_factory.mktemp("flower")
    config = tiny_config(tiny_npz, root / "sim", clients=3, engine="portable", rounds=1)
    run_simulation(config)
    return config, root


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedper", "pfedla"])
def test_a_flower_simulation_ends_as_edgepfl_simulate(tiny_npz, tmp_path, algorithm):  # noqa: F811
    from flwr.simulation import run_simulation as run_flower_simulation

    from edgepfl.flower.server_app import make_server_app

    config = tiny_config(tiny_npz, tmp_path / "sim", clients=3, engine="portable", algorithm=algorithm)
    run_simulation(config)
    run_config = flower_run_config(config, tmp_path)
    run_flower_simulation(
        make_server_app(run_config),
        make_client_app(run_config),
        num_supernodes=3,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0}, "init_args": {"num_cpus": 2}},
    )
    expected, got = final_global_base(tmp_path / "sim"), final_global_base(tmp_path / "flower")
    assert expected and expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # each node kept its whole model (personal tensors included) in its state folder: the simulated client's
    manifest, clients = load_manifest(tmp_path / "sim" / "bundle"), state_of(tmp_path / "sim")
    for device in NODES.values():
        state = StateFolder(tmp_path / "devices" / device, manifest, "portable")
        kept = state.load_tensors()
        state.close()
        assert kept is not None and state.state.last_completed_round == 2
        for name, value in kept.items():
            np.testing.assert_array_equal(value, clients[f"{device}/{name}"], err_msg=f"{device} {name}")


def run_round(reference, tmp_path, tamper=None, strategy_name="fedper", run_options=None):
    """One round through EdgePFLStrategy with replies made by the ClientApp in-process; `tamper` changes one.

    Returns the strategy, the aggregate, the round's metrics, the devices whose update was stored, the
    manifest and the train messages sent.
    """
    config, root = reference
    run_config = {**flower_run_config(config, root), "out": str(tmp_path), "state-root": str(tmp_path / "devices")}
    run_config.update(run_options or {})
    server_options = server_config(run_config)
    bundle = server_options.bundle
    fields = {
        "strategy": strategy_options(strategy_name),
        "round": server_options.round,
        "rounds": 2,
        "seed": 0,
        "fraction": 1.0,
        "min_clients": 1,
        "bundle": bundle,
        "round_timeout": 60.0,
    }
    server = open_server(tmp_path, sorted(NODES.values()), initial_tensors(bundle), fields, fresh=True)
    client_app = make_client_app(run_config)
    try:
        strategy = EdgePFLStrategy(server, NODES)
        messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid=None))
        assert sorted(m.metadata.dst_node_id for m in messages) == sorted(NODES)
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            context = Context(1, node, {"partition-id": node - 11}, RecordDict(), {})
            replies.append(client_app(message, context))
        if tamper is not None:  # edits the first reply in place, or replaces it
            replies[0] = tamper(replies[0], messages[0]) or replies[0]
        arrays, metrics = strategy.aggregate_train(1, replies)
        stored = [update.device for update in server.store.updates(1)]
        return strategy, arrays, metrics, stored, load_manifest(bundle), messages
    finally:
        server.close()


@pytest.mark.slow
def test_encoded_delta_replies_are_decoded_as_served_uploads(reference, tmp_path, task_identity):
    """A node speaks the round's upload encoding: its reply carries the int8 delta, scales and header metadata."""
    from edgepfl.server.store import Store
    from edgepfl.simulate.rounds import SERVER_DIR
    from edgepfl.wire import decode_metadata

    _, arrays, metrics, stored, _, _ = run_round(reference, tmp_path, run_options={"upload-encoding": "int8-block64"})
    assert arrays is not None and sorted(stored) == sorted(NODES.values()) and metrics["accepted"] == len(NODES)
    store = Store(tmp_path / SERVER_DIR)
    try:
        for update in store.updates(1):
            assert decode_metadata(store.blobs.read(update.blob_sha))["encoding"] == "int8-block64"
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize("strategy_name", ["fedper", "median", "trimmed-mean", "pfedla", "heurpfedla"])
def test_replies_are_accepted_and_aggregated(reference, tmp_path, task_identity, strategy_name):
    from edgepfl.flower.messages import round_of

    strategy, arrays, metrics, stored, manifest, messages = run_round(reference, tmp_path, None, strategy_name)
    assert strategy.refusals == [] and stored == sorted(NODES.values())
    assert sorted(arrays) == sorted(manifest.names("base"))  # the global base: never a personal tensor
    assert all(np.isfinite(array.numpy()).all() for array in arrays.values())
    assert metrics["accepted"] == 3 and 0.0 <= metrics["val-accuracy"] <= 1.0
    for message in messages:  # each device's planned base: the shared tensors but those it keeps (heurpfedla)
        _, settings, _ = round_of(message.content)
        assert (len(settings.kept_on_device) > 0) == (strategy_name == "heurpfedla")
        expected = set(manifest.names("base")) - set(settings.kept_on_device)
        assert set(message.content[BASE]) == expected
    for device in NODES.values():  # personal tensors stayed on the node, in its durable state folder
        state = StateFolder(tmp_path / "devices" / device, manifest, "portable")
        kept = state.load_tensors()
        state.close()
        assert kept is not None and set(manifest.names("personal")) <= set(kept)


def _add_personal(reply: Message, manifest) -> None:
    name = manifest.names("personal")[0]
    spec = next(spec for spec in manifest.tensors if spec.name == name)
    reply.content[BASE][name] = Array(np.zeros(spec.shape, dtype=spec.dtype))


def _poison(reply: Message, manifest) -> None:
    name = next(iter(reply.content[BASE]))
    value = reply.content[BASE][name].numpy().copy()
    value.flat[0] = np.nan
    reply.content[BASE][name] = Array(value)


def _reshape(reply: Message, manifest) -> None:
    name = next(iter(reply.content[BASE]))
    reply.content[BASE][name] = Array(reply.content[BASE][name].numpy().reshape(-1)[:3].copy())


def _retype(reply: Message, manifest) -> None:
    name = next(iter(reply.content[BASE]))
    reply.content[BASE][name] = Array(reply.content[BASE][name].numpy().astype(np.float64))


def _other_layout(reply: Message, manifest) -> None:
    reply.content[UPLOAD]["base_layout_hash"] = "0" * 64


def _absurd_samples(reply: Message, manifest) -> None:
    reply.content[UPLOAD]["num_samples"] = "-5"


def _drop_tensor(reply: Message, manifest) -> None:
    del reply.content[BASE][next(iter(reply.content[BASE]))]


@pytest.mark.parametrize(
    ("tamper", "refusal"),
    [
        (_add_personal, "personal tensor"),
        (_poison, "NaN"),
        (_reshape, "shape"),
        (_retype, "dtype"),
        (_other_layout, "base_layout_hash"),
        (_absurd_samples, "num_samples"),
        (_drop_tensor, "lacks tensor"),
    ],
)
def test_a_bad_reply_is_refused_as_serve_refuses_the_upload(reference, tmp_path, task_identity, tamper, refusal):
    manifest = load_manifest(reference[1] / "sim" / "bundle")
    strategy, arrays, metrics, stored, *_ = run_round(reference, tmp_path, lambda reply, _: tamper(reply, manifest))
    assert len(strategy.refusals) == 1
    round_id, device, why = strategy.refusals[0]
    assert round_id == 1 and device in NODES.values() and refusal in why
    assert device not in stored and len(stored) == 2  # the round closed at its deadline with the two good replies
    assert arrays is not None and metrics["accepted"] == 2


def test_a_node_that_failed_is_refused_in_one_line(reference, tmp_path, task_identity):
    def failed(reply: Message, message: Message) -> Message:
        return Message(Error(2, "round 1 is already trained on this device"), reply_to=message)

    strategy, _, _, stored, *_ = run_round(reference, tmp_path, failed)
    why = "the device could not train: round 1 is already trained on this device (see the node's log)"
    assert [refusal[2] for refusal in strategy.refusals] == [why]
    assert len(stored) == 2


class LocalGrid(Grid):
    """A Grid without a SuperLink: each message goes to its node's handler in this process (None: no reply)."""

    def __init__(self, handlers: dict[int, Callable[[Message], Message | None]]):
        self.handlers = handlers

    def get_node_ids(self) -> list[int]:
        return list(self.handlers)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        replies = [self.handlers[message.metadata.dst_node_id](message) for message in messages]
        return [reply for reply in replies if reply is not None]

    def set_run(self, run):
        raise NotImplementedError

    def run(self):
        raise NotImplementedError

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError


def node_handler(client_app, node: int, partition: int) -> Callable[[Message], Message]:
    """The edgepfl ClientApp of a node that trains client `partition`."""
    return lambda message: client_app(message, Context(1, node, {"partition-id": partition}, RecordDict(), {}))


def test_the_server_app_enrols_the_right_nodes_and_runs_its_rounds(reference, tmp_path, task_identity, caplog):
    """Three good nodes; one with another bundle, one claiming a taken name, one silent: each left out in one line."""
    from edgepfl.flower.messages import DEVICE
    from edgepfl.flower.server_app import make_server_app

    config, root = reference
    run_config = {**flower_run_config(config, root), "out": str(tmp_path), "state-root": str(tmp_path / "devices")}
    client_app = make_client_app(run_config)

    def other_bundle(message: Message) -> Message:
        identity = {"name": "client-009", "base_layout_hash": "f" * 64}
        return Message(RecordDict({DEVICE: ConfigRecord(identity)}), reply_to=message)

    handlers = {node: node_handler(client_app, node, node - 11) for node in NODES}
    handlers |= {21: other_bundle, 22: node_handler(client_app, 22, 0), 23: lambda message: None}
    with caplog.at_level("INFO", logger="flwr"):
        make_server_app(run_config)(LocalGrid(handlers), Context(1, 1, {}, RecordDict(), {}))
    lines = [record.getMessage() for record in caplog.records]
    assert "edgepfl: 3 device(s) enrolled: client-000, client-001, client-002" in lines
    assert any(line.startswith("node 21 is left out: its bundle has base layout ffffffffffff") for line in lines)
    assert (
        "node 22 is left out: another node is already device 'client-000' (give each node its own "
        "device-name/partition-id)" in lines
    )
    assert "node 23 is left out: it did not answer within 600 s (is its ClientApp edgepfl's?)" in lines
    assert final_global_base(tmp_path)  # the rounds ran: the engine closed them
    assert not [line for line in lines if "refused" in line and "refused-so-far" not in line]


def test_a_server_app_error_is_one_line(reference, tmp_path, task_identity, caplog):
    from edgepfl.flower.server_app import make_server_app

    config, root = reference
    run_config = {**flower_run_config(config, root), "out": str(tmp_path), "nodes": 5, "timeout": 0.5}
    client_app = make_client_app(run_config)
    grid = LocalGrid({node: node_handler(client_app, node, node - 11) for node in NODES})
    with caplog.at_level("INFO", logger="flwr"):
        make_server_app(run_config)(grid, Context(1, 1, {}, RecordDict(), {}))
        make_server_app({**run_config, "epoch": 1})(grid, Context(1, 1, {}, RecordDict(), {}))
    errors = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert errors[0].startswith("edgepfl: 3 of 5 SuperNodes connected within 0.5 s (start the SuperNodes")
    assert errors[1].startswith("edgepfl: the Flower run config has unknown key 'epoch' (use one of: ")
    assert len(errors) == 2


def test_a_node_with_its_own_data_trains_under_its_own_name(reference, tmp_path, task_identity, tiny_npz):  # noqa: F811
    from edgepfl.flower.messages import DEVICE, DEVICE_QUERY, train_content
    from edgepfl.protocol import RoundSettings

    config, root = reference
    with np.load(tiny_npz) as digits:
        np.savez(tmp_path / "phone.npz", x=digits["x_train"][:64], y=digits["y_train"][:64])
    bundle = root / "sim" / "bundle"
    manifest = load_manifest(bundle)
    client_app = make_client_app({"bundle": str(bundle), "engine": "portable", "state-root": str(tmp_path / "devices")})
    own = {"device-name": "phone-1", "data": str(tmp_path / "phone.npz"), "persfl-teacher": True}
    hello = client_app(Message(RecordDict(), 5, DEVICE_QUERY), Context(1, 5, own, RecordDict(), {}))
    assert hello.content[DEVICE]["name"] == "phone-1"
    base = {name: value for name, value in initial_tensors(bundle).items() if name in manifest.names("base")}
    local = train_content(1, RoundSettings(algorithm="local"), base, manifest.base_layout_hash)
    refused = client_app(Message(local, 5, "train"), Context(1, 5, own, RecordDict(), {}))
    assert refused.error.reason.startswith("the local algorithm uploads nothing, so a Flower round would get no reply")
    poisoned = {name: np.full_like(value, np.nan) for name, value in base.items()}
    nan_round = train_content(1, RoundSettings(), poisoned, manifest.base_layout_hash)
    refused_nan = client_app(Message(nan_round, 5, "train"), Context(1, 5, own, RecordDict(), {}))
    assert refused_nan.error.reason.startswith("the base of round 1 holds NaN or Inf in ")
    assert not (tmp_path / "devices" / "phone-1" / "state.json").exists()  # refused before anything was trained
    content = train_content(1, RoundSettings(epochs=1, batch_size=16, lr=0.05), base, manifest.base_layout_hash)
    reply = client_app(Message(content, 5, "train"), Context(1, 5, own, RecordDict(), {}))
    assert not reply.has_error() and sorted(reply.content[BASE]) == sorted(manifest.names("base"))
    assert (tmp_path / "devices" / "phone-1" / "state.json").is_file()
    from edgepfl.device_runtime.persfl import TeacherStore

    teacher = TeacherStore(tmp_path / "devices" / "phone-1", manifest).record  # PersFL stage 1 ran on the node
    assert teacher is not None and teacher.round_id == 1
    nameless = client_app(
        Message(RecordDict(), 6, DEVICE_QUERY), Context(1, 6, {"data": own["data"]}, RecordDict(), {})
    )
    assert (
        nameless.error.reason == "a node with its own data needs a name (set --node-config 'device-name=NAME data=...')"
    )


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["portable", "ort-training"])
def test_the_client_app_trains_without_torch(reference, tmp_path, engine):
    """Handshake and one round on a node where `import torch` fails, on either engine; the reply carries the base."""
    from edgepfl.device_runtime.engine import training_build_installed

    config, root = reference
    if engine == "ort-training":
        if not training_build_installed():
            pytest.skip("onnxruntime-training is not installed here")
        config = config.updated(out=str(tmp_path / "sim"), engine="ort-training")  # exports ort-training only
        run_simulation(config)
        root = tmp_path
    run_config = {**flower_run_config(config, root), "state-root": str(tmp_path / "devices"), "engine": engine}
    manifest = load_manifest(root / "sim" / "bundle")
    assert (root / "sim" / "bundle" / engine).is_dir() or engine == "portable"
    code = f"""
import json
from flwr.supercore.task_identity import TaskIdentity
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
from flwr.app import Context, Message, RecordDict
from edgepfl.flower.client_app import app
from edgepfl.flower.messages import BASE, DEVICE, DEVICE_QUERY, train_content
from edgepfl.protocol import RoundSettings
from edgepfl.simulate.bundle import initial_tensors
run_config = json.loads({json.dumps(json.dumps(run_config))})
context = Context(1, 7, {{"partition-id": 2}}, RecordDict(), run_config)
hello = app(Message(RecordDict(), dst_node_id=7, message_type=DEVICE_QUERY), context)
print("device", hello.content[DEVICE]["name"])
base = {{k: v for k, v in initial_tensors(run_config["bundle"]).items() if k in {manifest.names("base")!r}}}
settings = RoundSettings(epochs=1, batch_size=32, lr=0.05)
message = Message(train_content(1, settings, base, {manifest.base_layout_hash!r}), dst_node_id=7, message_type="train")
reply = app(message, context)
assert not reply.has_error(), reply.error.reason
print("sent", sorted(reply.content[BASE]))
again = app(message, context)
print("again", again.error.reason)
import sys; print("torch", sys.modules.get("torch"))
"""
    done = run_without_torch(code)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "device client-002" in lines
    assert f"sent {sorted(manifest.names('base'))}" in lines
    assert (
        "again round 1 is already trained on this device (last trained: round 1) (a round is never trained "
        "twice: the server goes on with the next one)" in lines
    )
    assert "torch None" in lines


def test_bad_flower_config_is_one_line(reference, tmp_path, task_identity):
    with pytest.raises(UsageError, match="the Flower run config has unknown key 'epoch'"):
        server_config({"bundle": "b", "epoch": 2})
    with pytest.raises(UsageError, match="the Flower run config: lr -1"):
        server_config({"bundle": "b", "lr": -1})
    with pytest.raises(UsageError, match="the node config has unknown key 'partitionid'"):
        node_config({"bundle": "b"}, {"partitionid": 1})
    config, root = reference
    client_app = make_client_app({"bundle": str(root / "sim" / "bundle"), "state-root": str(tmp_path)})
    query = Message(RecordDict(), dst_node_id=3, message_type="query.edgepfl_device")
    reply = client_app(query, Context(1, 3, {}, RecordDict(), {}))
    assert reply.has_error() and reply.error.reason.startswith("this node has no data (set --node-config")


def test_edgepfl_and_its_cli_do_not_import_flower():
    code = "import sys, edgepfl, edgepfl.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'flwr'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flower"
LOOPBACK = "127.0.0.1"  # every process of the deployment test listens here only
QUIET = {"FLWR_DISABLE_UPDATE_CHECK": "1"}  # Flower's processes ask no server outside about new releases


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{process.args[0]} exited with {process.returncode}"
        with socket.socket() as probe:
            if probe.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on {LOOPBACK}:{port} after {timeout:g} s")


def _descendants(pids: list[int]) -> set[int]:
    """Every process below `pids` (Linux /proc), found by walking parent ids."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal(pids: set[int], signum: int) -> None:
    """Send `signum` to each of `pids` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _run_config_overrides(reference, tmp_path) -> str:
    """`flwr run --run-config` for 3 nodes x 2 rounds of the reference run's bundle and data (keys of the example)."""
    config, root = reference
    run_config = {
        "bundle": str(root / "sim" / "bundle"),
        "out": str(tmp_path / "run"),
        "state-root": str(tmp_path / "devices"),
        "dataset": config.data.dataset,
        "data-root": config.data.data_root,
        "partition": config.data.partition,
        "clients": 3,
        "engine": "portable",
        "rounds": 2,
        "nodes": 3,
        "timeout": 120.0,
    }
    return " ".join(f"{key}={json.dumps(value)}" for key, value in run_config.items())


def _closed_rounds(folder: Path) -> list[tuple[int, str]]:
    """(round, state) of every round a run's engine state folder holds."""
    from edgepfl.server.store import Store

    store = Store(folder)
    try:
        return [(record.round_id, record.state) for record in store.rounds()]
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="walks /proc for the processes it started")
def test_a_loopback_deployment_trains_two_rounds_and_stops_cleanly(reference, tmp_path):
    """One SuperLink and three SuperNodes on 127.0.0.1 (insecure: loopback only), `flwr run` of examples/flower."""
    bin_dir = Path(sys.executable).parent
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text(f'[superlink.loopback]\naddress = "{LOOPBACK}:{port}"\ninsecure = true\n')
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FLWR_HOME": str(home), **QUIET}
    logs = tmp_path / "logs"
    logs.mkdir()
    processes: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        log_file = open(logs / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process below)
        process = subprocess.Popen(
            [str(bin_dir / args[0]), *args[1:]],
            env=env,
            cwd=tmp_path,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log_file.close()
        processes.append(process)
        return process

    overrides = _run_config_overrides(reference, tmp_path)
    stopped: dict[int, int | None] = {}
    lingering: set[int] = set()
    try:
        superlink = start(
            "superlink",
            "flower-superlink",
            "--insecure",
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
        )
        _wait_for_port(port, superlink, 60)
        for number in range(3):
            node_port = _free_port()
            node = start(
                f"supernode-{number}",
                "flower-supernode",
                "--insecure",
                "--superlink",
                f"{LOOPBACK}:{port}",
                "--host",
                LOOPBACK,
                "--port",
                str(node_port),
                "--node-config",
                f"partition-id={number} num-partitions=3",
            )
            _wait_for_port(node_port, node, 60)
        run = subprocess.run(
            [str(bin_dir / "flwr"), "run", str(EXAMPLE), "loopback", "--stream", "--run-config", overrides],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        output = run.stdout + run.stderr
        assert run.returncode == 0, output[-3000:]
        assert "edgepfl: 3 device(s) enrolled: client-000, client-001, client-002" in output, output[-3000:]
        assert "[ROUND 2/2]" in output and "refused-so-far': 0" in output.replace('"', "'")
        assert _closed_rounds(tmp_path / "run" / "server") == [(1, "closed"), (2, "closed")]
        assert "'accepted': 3" in output
    finally:
        below = _descendants([process.pid for process in processes])
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                stopped[process.pid] = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                stopped[process.pid] = None
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        deadline = time.monotonic() + 30  # helpers watch their parent (--parent-pid) and leave after it
        while time.monotonic() < deadline and any(_alive(pid) for pid in below):
            time.sleep(0.5)
        lingering = {pid for pid in below if _alive(pid)}
        _signal(lingering, signal.SIGKILL)
    assert None not in stopped.values(), f"not stopped by SIGTERM within 30 s: {stopped}"
    assert not lingering, f"processes left behind: {sorted(lingering)}"


def _processes_mentioning(text: str) -> set[int]:
    """Processes whose command line holds `text` (e.g. this test's own FLWR_HOME), from Linux /proc."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace") and _alive(int(cmdline.parent.name)):
                found.add(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="walks /proc for the processes it started")
def test_flwr_run_of_the_example_in_the_local_simulation(reference, tmp_path):
    """`flwr run examples/flower local`: Flower's own local SuperLink in simulation mode (Ray backend), 3 nodes."""
    bin_dir = Path(sys.executable).parent
    home = tmp_path / "flwr-home"  # the local SuperLink `flwr` starts keeps its state and log here
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FLWR_HOME": str(home),
        **QUIET,
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()),
    }
    overrides = _run_config_overrides(reference, tmp_path)
    command = [str(bin_dir / "flwr"), "run", str(EXAMPLE), "local", "--stream"]
    try:
        run = subprocess.run(
            [*command, "--federation-config", "num-supernodes=3", "--run-config", overrides],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        output = run.stdout + run.stderr
        assert run.returncode == 0, output[-3000:]
        assert "edgepfl: 3 device(s) enrolled: client-000, client-001, client-002" in output, output[-3000:]
        assert "[ROUND 2/2]" in output
        assert _closed_rounds(tmp_path / "run" / "server") == [(1, "closed"), (2, "closed")]
    finally:  # the local SuperLink outlives `flwr run` by design: stop it and what it started
        started = _processes_mentioning(str(home))
        started |= _descendants(sorted(started))
        _signal(started, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(pid) for pid in started):
            time.sleep(0.5)
        _signal({pid for pid in started if _alive(pid)}, signal.SIGKILL)


def test_without_flower_the_package_says_how_to_install_it():
    code = "import sys\nsys.modules['flwr'] = None\ntry:\n    import edgepfl.flower.client_app\n"
    code += "except Exception as error:\n    print(error)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == (
        "edgepfl.flower needs Flower (flwr) (pip install 'edgepfl[flower]' (on Python 3.11 or later))"
    ), done.stderr[-2000:]
