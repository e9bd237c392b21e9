"""PersFL through the real processes: `device run --persfl-teacher` against `edgepfl serve`, then `device distill`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from server_helpers import LiveServer, enroll
from test_device_e2e import DEVICE_CLI, device_command, run_args
from test_device_runtime import DEVICE_BUNDLE, save_npz

# the real CLI in a process where `import torch` fails, as on a device
ROUNDS = 2


@pytest.fixture(scope="module")
def bundle(bundle_factory) -> Path:
    # K_P = 0: PersFL's stage 1 runs during FedAvg
    return bundle_factory(**{**DEVICE_BUNDLE, "kp": 0, "engines": ("portable",), "distill": True})


def device(*args: str | Path, timeout: float = 120) -> dict:
    process = subprocess.run(
        [sys.executable, "-c", DEVICE_CLI, *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=timeout
    )
    assert process.returncode == 0, process.stderr[-3000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_devices_keep_teachers_during_fedavg_and_distil_afterwards(bundle, tmp_path):
    names = ("a", "b")
    tokens = enroll(tmp_path / "server", *names)
    server = LiveServer(
        bundle,
        tmp_path / "server",
        "--min-clients",
        "2",
        "--rounds",
        str(ROUNDS),
        "--poll-interval",
        "0.2",
        "--lr",
        "0.1",
        "--batch-size",
        "16",
        "--round-timeout",
        "120",
    ).start()
    data = {name: save_npz(tmp_path / f"{name}.npz", (2 * i, 2 * i + 1), 120, seed=i) for i, name in enumerate(names)}
    try:
        processes = {
            name: subprocess.Popen(
                device_command(
                    *run_args(bundle, data[name], server, tokens[name], tmp_path / name, "--engine", "portable"),
                    "--persfl-teacher",
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            for name in names
        }
        results = {}
        for name, process in processes.items():
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, err[-3000:]
            results[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        server.stop()

    for name in names:
        assert results[name]["finished"] and results[name]["rounds_trained"] == ROUNDS
        state = tmp_path / name
        history = json.loads((state / "state.json").read_text())["history"]
        # the held-out loss of every global model the device saw: received at the start of each round, and the final one
        seen = {h["round"]: h["start_val_loss"] for h in history if not h.get("final")}
        final = next(h for h in history if h.get("final"))
        seen[final["round"] + 1] = final["val_loss"]
        teacher = json.loads((state / "persfl" / "teacher.json").read_text())["teacher"]
        assert teacher["round_id"] == min(seen, key=seen.get), (teacher, seen)
        assert teacher["val_loss"] == pytest.approx(seen[teacher["round_id"]], rel=1e-5)

        result = device(
            "device",
            "distill",
            "--bundle",
            bundle,
            "--data",
            data[name],
            "--state",
            state,
            "--lambdas",
            "0.1,0.9",
            "--temperatures",
            "1,4",
            "--epochs",
            "2",
            "--json",
        )
        assert result["teacher_round"] == teacher["round_id"] and result["engine"] == "portable"
        assert result["student_lambda"] in (0.1, 0.9) and result["student_T"] in (1.0, 4.0)
        assert result["student_val_accuracy"] >= result["teacher_val_accuracy"]
        saved = json.loads((state / "state.json").read_text())["history"][-1]
        assert saved["persfl_distill"] and len(saved["grid"]) == 4
        evaluated = device("device", "eval", "--bundle", bundle, "--data", data[name], "--state", state, "--json")
        assert evaluated["engine"] == "portable"


def test_distill_without_a_teacher_is_one_line(bundle, tmp_path):
    data = save_npz(tmp_path / "d.npz", (0, 1), 60)
    process = subprocess.run(
        [
            sys.executable,
            "-c",
            DEVICE_CLI,
            "device",
            "distill",
            "--bundle",
            str(bundle),
            "--data",
            str(data),
            "--state",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert process.returncode != 0
    lines = [line for line in process.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "holds no PersFL teacher" in lines[0], process.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-c",
            DEVICE_CLI,
            "device",
            "distill",
            "--bundle",
            str(bundle),
            "--data",
            str(data),
            "--state",
            str(tmp_path / "state"),
            "--lambdas",
            "0.1,x",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert bad.returncode != 0 and "--lambdas 'x': input should be a valid number" in bad.stderr, bad.stderr
