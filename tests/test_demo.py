"""`edgepfl demo --rounds 1`: a real server and four real device processes on loopback, FedPer and FedAvg."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

pytest.importorskip("torch")


def test_shipped_demo_digits_are_the_documented_subset():
    from edgepfl.simulate.demo import demo_dataset

    data = demo_dataset()
    assert (data.num_train, len(data.y_test), data.num_classes) == (3000, 1000, 10)
    assert np.bincount(data.y_train).tolist() == [292, 348, 295, 295, 262, 300, 283, 301, 312, 312]
    assert (REPO / "edgepfl" / "simulate" / "data" / "mnist-demo.npz").stat().st_size < 2 * 1024 * 1024


@pytest.mark.slow
def test_demo_one_round_completes(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "edgepfl.cli", "demo", "--rounds", "1", "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={"COLUMNS": "160", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("│ device-")]
    assert len(rows) == 4
    for row in rows:
        cells = [cell.strip() for cell in row.strip("│").split("│")]
        assert cells[3].endswith("%") and cells[4].endswith("%"), row  # FedPer and FedAvg accuracies
    for strategy in ("fedper", "fedavg"):
        logs = tmp_path / "demo" / strategy / "logs"
        assert sum(1 for _ in logs.glob("device-*.log")) == 4
        assert '"finished": true' in (logs / "device-0.log").read_text()


def test_demo_refuses_bad_rounds():
    from typer.testing import CliRunner

    from edgepfl.cli import app

    result = CliRunner().invoke(app, ["demo", "--rounds", "0"])
    assert result.exit_code == 2 and "--rounds 0: input should be greater than or equal to 1" in result.output
