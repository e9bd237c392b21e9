"""The device against a poisoned base or a diverging learning rate, and unreadable data: nothing bad is kept.

A refused round is one line naming the problem and the fix; the last good model stays and the state folder
stays usable (test_device_replies.py covers replies that are not what the protocol says).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import REPO
from test_device_e2e import device_command
from test_device_runtime import (
    DEVICE_BUNDLE,
    NUM_CLASSES,
    ScriptedServer,
    _open_device,
    local_data,
    save_npz,
)
from typer.testing import CliRunner

from edgepfl.device_runtime.algorithms import TrainingDiverged, divergence, train_locally
from edgepfl.device_runtime.cli import device_app
from edgepfl.device_runtime.client import ServerClient
from edgepfl.device_runtime.engine import open_engine
from edgepfl.device_runtime.options import DeviceOptions, TrainOptions
from edgepfl.device_runtime.runner import DeviceEvents, run_device
from edgepfl.device_runtime.state import StateFolder
from edgepfl.errors import StateError
from edgepfl.protocol import RoundSettings, Task
from edgepfl.wire import encode_tensors, nonfinite_names


@pytest.fixture(scope="module")
def mlp_bundle(bundle_factory) -> Path:
    return bundle_factory(**DEVICE_BUNDLE)


class Recorder(DeviceEvents):
    """Messages and, per finished round, the tensors the device saved."""

    def __init__(self, state: StateFolder):
        self.state = state
        self.messages: list[str] = []
        self.saved: dict[int, dict[str, np.ndarray]] = {}
        self.started: list[int] = []

    def message(self, text: str) -> None:
        self.messages.append(text)

    def round_started(self, round_id, settings, total_steps) -> None:
        self.started.append(round_id)

    def round_finished(self, round_id, result, upload) -> None:
        saved = self.state.load_tensors()
        assert saved is not None
        self.saved[round_id] = saved


class PoisoningServer(ScriptedServer):
    """A ScriptedServer whose `poisoned` round hands out `base_fill` values or `lr`, then moves on unasked."""

    def __init__(self, *args, poisoned: int, base_fill: float | None = None, lr: float = 0.1, **kwargs):
        super().__init__(*args, **kwargs)
        self.poisoned, self.base_fill, self.lr = poisoned, base_fill, lr
        self.poison_served = False

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if self.round_id == self.poisoned:
            if path == "/v1/task" and self.poison_served:
                self.round_id += 1  # the round closed without this device (its deadline passed)
            elif path == "/v1/task" and self.base_fill is None:
                self.poison_served = True
                settings = RoundSettings(batch_size=16, lr=self.lr)
                task = Task(
                    "train", self.manifest.base_layout_hash, self.round_id, settings, f"/v1/rounds/{self.round_id}/base"
                )
                return httpx.Response(200, json=task.to_json())
            elif path.endswith("/base") and self.base_fill is not None:
                self.poison_served = True
                poisoned = {name: np.full_like(value, self.base_fill) for name, value in self.base.items()}
                return httpx.Response(200, content=encode_tensors(poisoned))
        return super().handle(request)


@pytest.mark.parametrize(
    "poison, message",
    [
        ({"base_fill": 1e30}, "training diverged in round 2 (loss"),
        ({"base_fill": math.nan}, "the base of round 2 holds NaN or Inf in"),
        ({"lr": 1e6}, "training diverged in round 2 (loss"),
    ],
    ids=["base-1e30", "base-nan", "lr-1e6"],
)
def test_a_poisoned_round_is_skipped_and_the_last_good_state_kept(mlp_bundle, tmp_path, poison, message):
    engine, data, state, _ = _open_device(mlp_bundle, tmp_path)
    server = PoisoningServer(engine.manifest, engine.tensors_by_role("base"), rounds=3, poisoned=2, **poison)
    client = ServerClient("http://device.test", "t", transport=server.transport(), sleep=pytest.fail)
    events = Recorder(state)
    personal = engine.manifest.names("personal")
    at_round_3: dict[str, np.ndarray] = {}

    def round_started(round_id, settings, total_steps):
        events.started.append(round_id)
        if round_id == 3:
            at_round_3.update(engine.get_tensors(personal))

    events.round_started = round_started
    summary = run_device(engine, data, state, client, DeviceOptions(poll_interval=0.01), events, sleep=lambda s: None)
    assert summary.finished and summary.rounds_trained == 2
    assert [round_id for round_id, _ in server.uploads] == [1, 3]  # nothing of round 2 left the device
    refused = [m for m in events.messages if message in m]
    assert len(refused) == 1, events.messages
    assert "kept the state of round 1 and skipped the round" in refused[0] and "ask the operator" in refused[0]
    assert "\n" not in refused[0]
    # round 3 started from round 1's personal part, not from what round 2 made of it
    for name in personal:
        np.testing.assert_array_equal(at_round_3[name], events.saved[1][name])
    assert [h["round"] for h in state.state.history if not h.get("final")] == [1, 3]
    state.close()

    # the next run on the same folder works: it loads the state and trains the next round
    engine = open_engine(mlp_bundle, "portable")
    state = StateFolder(tmp_path / "state", engine.manifest, engine.name)
    saved = state.load_tensors()
    assert saved is not None and not nonfinite_names(saved)
    later = ScriptedServer(engine.manifest, engine.tensors_by_role("base"), rounds=4)
    later.round_id = 4
    client = ServerClient("http://device.test", "t", transport=later.transport(), sleep=pytest.fail)
    again = run_device(engine, local_data(engine.manifest), state, client, DeviceOptions(), sleep=pytest.fail)
    assert again.finished and again.rounds_trained == 1 and again.final_accuracy is not None
    assert state.state.last_completed_round == 4
    state.close()


def test_a_poisoned_final_base_is_not_taken(mlp_bundle, tmp_path):
    engine, data, state, server = _open_device(mlp_bundle, tmp_path, server_rounds=1)
    good_base = server.base

    def handle(request: httpx.Request) -> httpx.Response:
        if server.round_id > server.rounds and request.url.path.endswith("/base"):
            server.base = {name: np.full_like(value, 1e30) for name, value in good_base.items()}
        return server.handle(request)

    client = ServerClient("http://device.test", "t", transport=httpx.MockTransport(handle), sleep=pytest.fail)
    events = Recorder(state)
    summary = run_device(engine, data, state, client, DeviceOptions(), events, sleep=pytest.fail)
    assert summary.finished and summary.final_accuracy is not None and summary.final_accuracy > 0.25
    assert any(
        "the final base gives a held-out loss" in m and "kept the state of round 1" in m for m in events.messages
    )
    saved = state.load_tensors()
    assert saved is not None
    for name, value in events.saved[1].items():
        np.testing.assert_array_equal(saved[name], value)


def test_the_state_folder_refuses_to_save_nan(mlp_bundle, tmp_path):
    engine = open_engine(mlp_bundle, "portable")
    state = StateFolder(tmp_path / "state", engine.manifest, engine.name)
    poisoned = {**engine.get_tensors(), "hidden.bias": np.full_like(engine.get_tensors()["hidden.bias"], np.inf)}
    with pytest.raises(StateError, match="refused to save a model holding NaN or Inf in 'hidden.bias'"):
        state.commit(poisoned, {"note": "x"})
    assert not (tmp_path / "state" / "state.json").exists() and state.load_tensors() is None


def test_divergence_names_the_reason():
    tensors = {"w": np.ones(3, np.float32)}
    assert divergence([1.2, 0.4], tensors, NUM_CLASSES) is None
    assert divergence([math.nan], tensors, NUM_CLASSES) == "loss NaN"
    assert divergence([0.5, 3.4e33], tensors, NUM_CLASSES) == "loss 3.4e+33"
    assert divergence([math.inf], tensors, NUM_CLASSES) == "loss inf"
    assert divergence([1.0], {"w": np.array([1.0, np.nan], np.float32)}, NUM_CLASSES) == "NaN or Inf in 'w'"


# `device train` with a learning rate that diverges


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != ".lock"}


def test_device_train_with_a_diverging_lr_keeps_the_saved_state(mlp_bundle, tmp_path):
    data = save_npz(tmp_path / "d.npz", (0, 1, 2), 90)
    state = tmp_path / "state"
    common = ["--bundle", mlp_bundle, "--data", data, "--state", state, "--engine", "portable", "--json"]

    def device(*args: str | Path) -> subprocess.CompletedProcess:
        return subprocess.run(device_command("device", *args), capture_output=True, text=True, timeout=120, cwd=REPO)

    first = device("train", *common, "--lr", "0.1")
    assert first.returncode == 0, first.stderr[-3000:]
    before = _folder_bytes(state)
    diverged = device("train", *common, "--lr", "1e6")
    assert diverged.returncode == 2 and diverged.stderr.count("\n") == 1 and not diverged.stdout, diverged.stderr
    assert diverged.stderr.startswith("error: training diverged (loss ")
    assert "kept the saved state (lower --lr, e.g. --lr 100000)" in diverged.stderr
    assert _folder_bytes(state) == before
    evaluated = device("eval", *common)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout)["accuracy"] == json.loads(first.stdout)["val_accuracy"]


def test_local_training_refuses_a_diverged_result_and_records_a_sane_one(mlp_bundle):
    """`device train`'s step (algorithms.train_locally): a blown-up lr is one line naming what is kept and the fix."""
    engine = open_engine(mlp_bundle, "portable")
    data = local_data(engine.manifest)
    record = train_locally(engine, data, TrainOptions(lr=0.1), seed=0, kept="the saved state")
    assert record["steps"] > 0 and record["val_samples"] == data.num_val and record["engine"] == engine.name
    with pytest.raises(TrainingDiverged, match=r"training diverged \(loss .*\): kept the saved state") as refused:
        train_locally(engine, data, TrainOptions(lr=1e6), seed=0, kept="the saved state")
    assert refused.value.fix == "lower --lr, e.g. --lr 100000"


@pytest.mark.parametrize("content", [b"", b"not a zip"], ids=["empty", "garbage"])
def test_an_unreadable_data_file_is_one_line(mlp_bundle, tmp_path, content):
    data = tmp_path / "d.npz"
    data.write_bytes(content)
    result = CliRunner().invoke(
        device_app, ["train", "--bundle", str(mlp_bundle), "--data", str(data), "--state", str(tmp_path / "s")]
    )
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {data} is not a readable .npz file"), result.output
    assert "numpy.savez" in lines[0] and not (tmp_path / "s" / "state.json").exists()
