"""`edgepfl device` as real processes with torch blocked, against a real `edgepfl serve` on loopback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_without_torch
from server_helpers import LiveServer, enroll
from test_device_runtime import DEVICE_BUNDLE, save_npz

from edgepfl.manifest import load_manifest
from edgepfl.ortbuild import training_build_installed
from edgepfl.server.store import Store
from edgepfl.wire import decode_tensors

# the real CLI in a process where `import torch` fails, as on a device
DEVICE_CLI = "import sys; sys.modules['torch'] = None; sys.argv[0] = 'edgepfl'; from edgepfl.cli import app; app()"

# the same CLI, stalled in round 2 until it is killed (a marker file says so): at step 3 of local training,
# or after round 2 is trained and saved but before its upload is sent
STALLING_CLI = """
import pathlib, sys, time
sys.modules['torch'] = None
marker, where = pathlib.Path(sys.argv.pop(1)), sys.argv.pop(1)
import edgepfl.device_runtime.client as client
import edgepfl.device_runtime.progress as progress

def stall(what):
    marker.write_text(what)
    time.sleep(600)

class Stalling(progress.RichEvents):
    round_id = 0

    def round_started(self, round_id, settings, total_steps):
        self.round_id = round_id
        super().round_started(round_id, settings, total_steps)

    def step(self, phase, done, total, loss):
        super().step(phase, done, total, loss)
        if where == 'training' and self.round_id == 2 and done == 3:
            stall('training round 2')

upload = client.ServerClient.upload

def stalling_upload(self, round_id, payload):
    if where == 'upload' and round_id == 2:
        stall('uploading round 2')
    return upload(self, round_id, payload)

progress.RichEvents = Stalling
client.ServerClient.upload = stalling_upload
sys.argv[0] = 'edgepfl'
from edgepfl.cli import app
app()
"""

# what `--engine auto` picks here: ort-training only where its build is installed (none on ARM or Python 3.13)
AUTO_ENGINE = "ort-training" if training_build_installed() else "portable"

SERVER_OPTIONS = (
    "--rounds",
    "3",
    "--poll-interval",
    "0.2",
    "--lr",
    "0.1",
    "--batch-size",
    "16",
    "--round-timeout",
    "120",
)


@pytest.fixture(scope="module")
def bundle(bundle_factory) -> Path:
    return bundle_factory(**DEVICE_BUNDLE)


def device_command(*args: str | Path, code: str = DEVICE_CLI) -> list[str]:
    return [sys.executable, "-c", code, *map(str, args)]


def run_args(bundle: Path, data: Path, server: LiveServer, token: str, state: Path, *extra: str) -> list[str]:
    return [
        "device",
        "run",
        "--bundle",
        str(bundle),
        "--data",
        str(data),
        "--server",
        server.url,
        "--token",
        token,
        "--state",
        str(state),
        "--poll-interval",
        "0.1",
        "--retries",
        "3",
        "--json",
        *extra,
    ]


def finish(process: subprocess.Popen, timeout: float = 60) -> dict:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def stored_updates(state: Path) -> dict[int, dict[str, dict]]:
    """Round -> device -> the tensors the server stored for that device's update."""
    store = Store(state)
    try:
        return {
            record.round_id: {
                u.device: decode_tensors(store.blobs.read(u.blob_sha)) for u in store.updates(record.round_id)
            }
            for record in store.rounds()
        }
    finally:
        store.close()


def history(state: Path) -> list[dict]:
    return json.loads((state / "state.json").read_text())["history"]


def test_three_devices_complete_three_rounds_and_personalize(bundle, tmp_path):
    manifest = load_manifest(bundle)
    names = ("a", "b", "c")
    tokens = enroll(tmp_path / "server", *names)
    server = LiveServer(bundle, tmp_path / "server", "--min-clients", "3", *SERVER_OPTIONS).start()
    try:
        processes = {}
        for index, name in enumerate(names):
            data = save_npz(tmp_path / f"{name}.npz", (index, index + 1), 120, seed=index)
            engine = ("--engine", "portable") if name == "c" else ()
            args = run_args(bundle, data, server, tokens[name], tmp_path / name, *engine)
            processes[name] = subprocess.Popen(
                device_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
            )
        results = {name: finish(process) for name, process in processes.items()}
    finally:
        server.stop()
    for name, result in results.items():
        assert result["finished"] and result["rounds_trained"] == 3 and result["last_completed_round"] == 3, result
        assert result["engine"] == ("portable" if name == "c" else AUTO_ENGINE)
        rounds = [h for h in history(tmp_path / name) if not h.get("final")]
        assert [(h["round"], h["upload"]) for h in rounds] == [(1, "delivered"), (2, "delivered"), (3, "delivered")]
        final = history(tmp_path / name)[-1]
        assert final["final"] and final["val_accuracy"] == result["final_accuracy"]
        assert rounds[-1]["val_accuracy"] >= rounds[0]["start_val_accuracy"] + 0.3, rounds  # it learned its classes
    store = Store(tmp_path / "server")  # the server's status quotes each device's held accuracy as it sent it
    try:
        for name in names:
            sent = {h["round"]: h["start_val_accuracy"] for h in history(tmp_path / name) if not h.get("final")}
            quoted = {r: next(u for u in store.updates(r) if u.device == name).start_val_accuracy for r in sent}
            assert quoted == sent
    finally:
        store.close()
    updates = stored_updates(tmp_path / "server")
    assert sorted(updates) == [1, 2, 3]
    for by_device in updates.values():
        assert sorted(by_device) == list(names)
        for tensors in by_device.values():  # only the base ever left a device
            assert sorted(tensors) == sorted(manifest.names("base"))


@pytest.mark.parametrize("where", ["training", "upload"])
def test_kill_9_mid_round_resumes_without_a_second_upload(bundle, tmp_path, where):
    tokens = enroll(tmp_path / "server", "a", "b")
    server = LiveServer(bundle, tmp_path / "server", "--min-clients", "2", *SERVER_OPTIONS).start()
    data_a = save_npz(tmp_path / "a.npz", (0, 1), 400, seed=1)
    data_b = save_npz(tmp_path / "b.npz", (2, 3), 120, seed=2)
    try:
        refused = subprocess.run(
            device_command(*run_args(bundle, data_a, server, "not-a-token", tmp_path / "x")),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith("error: server refused GET /v1/task (401") and "tokens add" in refused.stderr

        marker = tmp_path / "stalled"
        stalling_args = run_args(bundle, data_a, server, tokens["a"], tmp_path / "a")
        stalled = subprocess.Popen(
            device_command(marker, where, *stalling_args, code=STALLING_CLI),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        other = subprocess.Popen(
            device_command(*run_args(bundle, data_b, server, tokens["b"], tmp_path / "b")),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert stalled.poll() is None and time.monotonic() < deadline, stalled.stderr.read()[-3000:]
            time.sleep(0.05)
        stalled.send_signal(signal.SIGKILL)
        stalled.wait(timeout=10)

        saved = json.loads((tmp_path / "a" / "state.json").read_text())  # whole: the last commit, no later
        assert (tmp_path / "a" / saved["tensors_file"]).is_file() and saved["last_uploaded_round"] == 1
        if where == "training":  # round 2 is lost and will be trained again
            assert saved["last_completed_round"] == 1 and saved["pending_upload"] is None
        else:  # round 2 is saved with its upload body, which the restart sends instead of training again
            assert saved["last_completed_round"] == 2 and saved["pending_upload"]["round_id"] == 2
            assert (tmp_path / "a" / saved["pending_upload"]["file"]).is_file()

        resumed = subprocess.Popen(
            device_command(*run_args(bundle, data_a, server, tokens["a"], tmp_path / "a")),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        result_a, result_b = finish(resumed), finish(other)
    finally:
        server.stop()
    trained_after_restart = 2 if where == "training" else 1
    assert result_a["finished"] and result_a["rounds_trained"] == trained_after_restart
    assert result_a["last_completed_round"] == 3
    assert result_b["finished"] and result_b["rounds_trained"] == 3
    rounds = [(h["round"], h["upload"]) for h in history(tmp_path / "a") if not h.get("final")]
    assert rounds == [(1, "delivered"), (2, "delivered"), (3, "delivered")]  # round 2 trained once
    updates = stored_updates(tmp_path / "server")
    assert {r: sorted(by_device) for r, by_device in updates.items()} == {r: ["a", "b"] for r in (1, 2, 3)}
    leftovers = [p.name for p in (tmp_path / "a").iterdir() if p.name.endswith(".tmp")]
    assert not leftovers


def test_train_and_eval_work_without_torch(bundle, tmp_path):
    data = save_npz(tmp_path / "d.npz", (0, 1, 2), 90)
    common = f"'--bundle', {str(bundle)!r}, '--data', {str(data)!r}, '--state', {str(tmp_path / 'state')!r}, '--json'"
    code = f"""
import json, sys
from typer.testing import CliRunner
from edgepfl.device_runtime.cli import device_app
runner = CliRunner()
train = runner.invoke(device_app, ['train', {common}, '--epochs', '3', '--trainable', 'personal', '--lr', '0.1',
                                   '--engine', 'portable'])
assert train.exit_code == 0, train.output
evaluation = runner.invoke(device_app, ['eval', {common}, '--engine', 'portable'])
assert evaluation.exit_code == 0, evaluation.output
assert 'torch' not in {{name.split('.')[0] for name, module in sys.modules.items() if module is not None}}
print(json.dumps([json.loads(train.output), json.loads(evaluation.output)]))
"""
    done = run_without_torch(code)
    assert done.returncode == 0, done.stderr[-3000:]
    trained, evaluated = json.loads(done.stdout.strip().splitlines()[-1])
    assert trained["steps"] == 9 and trained["engine"] == "portable"  # 72 samples, batch 32, 3 epochs
    assert evaluated["accuracy"] == trained["val_accuracy"] and evaluated["val_samples"] == 18
    assert trained["val_accuracy"] > trained["start_val_accuracy"]
