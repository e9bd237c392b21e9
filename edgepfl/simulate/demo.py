"""`edgepfl demo`: FedPer next to FedAvg with a real server and four real device processes on loopback.

Nothing is downloaded: the digits are a 4,000-sample MNIST subset shipped in the package
(`edgepfl/simulate/data/README.md` says where they come from). Each device holds three digit classes
(`classes:3`), so a shared model is a compromise and personal layers pay off. The demo exports
MobileNet-v1 (width 0.25, 28x28 grey, GroupNorm) twice, K_P=2 for FedPer and K_P=0 for FedAvg, and for each runs
`edgepfl serve` and four `edgepfl device run` processes, exactly as a user would on real hardware.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field

from edgepfl.errors import EdgePFLError
from edgepfl.options import titled
from edgepfl.server.launch import LocalServer, last_line

DEMO_DATA = "mnist-demo.npz"
DEVICES = 4
DEMO_PARTITION = "classes:3"
DEMO_SETTINGS = ("--epochs", "2", "--batch-size", "32", "--lr", "0.05")
START_TIMEOUT = 60.0


class DemoOptions(BaseModel):
    """What `edgepfl demo` was told; its flags are made from these fields."""

    model_config = titled("Demo")

    rounds: Annotated[int, Field(ge=1, le=100, description="federated rounds per run (3-5 recommended)")] = 4
    workdir: Annotated[
        Path | None, Field(description="folder for bundles, server state and logs (default: a temp folder)")
    ] = None
    port: Annotated[int, Field(ge=0, le=65535, description="loopback port of the demo server (0: pick a free one)")] = 0
    keep: Annotated[bool, Field(description="keep the work folder")] = False
    round_timeout: Annotated[float, Field(gt=0.0, description="seconds a round may stay open")] = 300.0


@dataclass(frozen=True)
class DeviceOutcome:
    """One device's result in one federated run."""

    name: str
    classes: list[int]
    samples: int
    accuracy: float | None
    rounds_trained: int


def run_demo(options: DemoOptions, echo=print) -> dict[str, list[DeviceOutcome]]:
    """Export, serve, run the devices for FedPer then FedAvg, print the comparison; returns the outcomes."""
    workdir = Path(options.workdir) if options.workdir else Path(tempfile.mkdtemp(prefix="edgepfl-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        device_files = _write_device_data(workdir / "data")
        outcomes = {}
        for label, strategy, kp in (("FedPer", "fedper", 2), ("FedAvg", "fedavg", 0)):
            echo(f"[{time.perf_counter() - started:5.1f}s] {label}: exporting mobilenet (width 0.25) with K_P={kp}")
            bundle = _export(workdir / f"bundle-kp{kp}", kp)
            echo(f"[{time.perf_counter() - started:5.1f}s] {label}: {options.rounds} round(s), {DEVICES} devices")
            outcomes[label] = _federate(workdir / strategy, bundle, strategy, device_files, options)
        _print_comparison(outcomes, options.rounds, time.perf_counter() - started)
        return outcomes
    finally:
        if not options.keep and options.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        elif options.keep or options.workdir is not None:
            echo(f"work folder kept: {workdir}")


def demo_dataset():
    """The shipped MNIST subset as an `edgepfl.datasets.images.Dataset`."""
    from edgepfl.datasets.images import load_npz

    with resources.as_file(resources.files("edgepfl.simulate").joinpath("data", DEMO_DATA)) as path:
        return load_npz(path, name="mnist-demo", description="MNIST subset shipped with edgepfl (4,000 digits)")


def _write_device_data(folder: Path) -> list[tuple[Path, list[int], int]]:
    """One .npz (x, y) per device: its classes:3 share of the subset; the device holds out its own 20%."""
    from edgepfl.datasets.partition import make_partition

    dataset = demo_dataset()
    parts = make_partition(DEMO_PARTITION, dataset.y_train, dataset.y_test, DEVICES, seed=0)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for number, part in enumerate(parts):
        indices = part.indices
        labels = dataset.targets(indices)
        path = folder / f"device-{number}.npz"
        np.savez(path, x=dataset.images(indices), y=labels)
        files.append((path, sorted(int(c) for c in np.unique(labels)), len(indices)))
    return files


def _export(folder: Path, kp: int) -> Path:
    """Export the demo model (ORT training artifacts where installed) plus its initial tensors for the server."""
    import torch

    from edgepfl.device_runtime.engine import training_build_installed
    from edgepfl.export.bundle import ExportOptions, export_bundle
    from edgepfl.export.models import ModelSpec
    from edgepfl.simulate.bundle import initial_file, initial_tensors
    from edgepfl.wire import save_tensors

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    engines = ("ort-training",) if training_build_installed() else ("portable",)
    # GroupNorm: with 28x28 inputs MobileNet's last blocks see 1x1 feature maps, where BatchNorm's running
    # statistics lag the fast-moving weights of a few short rounds and evaluation collapses to one class
    spec = ModelSpec(name="mobilenet", width=0.25, input_size=28, in_channels=1, num_classes=10, norm="group")
    export_bundle(spec, kp, folder, ExportOptions(engines=engines, seed=0, force=True))
    save_tensors(initial_file(folder), initial_tensors(folder))
    return folder


def _federate(
    folder: Path, bundle: Path, strategy: str, device_files: list, options: DemoOptions
) -> list[DeviceOutcome]:
    """One real federation: tokens, `edgepfl serve`, four `edgepfl device run`, then stop the server."""
    state, logs = folder / "server-state", folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = [f"device-{number}" for number in range(len(device_files))]
    tokens = [_edgepfl(["serve", "tokens", "add", name, "--state", str(state)], logs / "tokens.log") for name in names]
    server = LocalServer(
        bundle,
        state,
        *("--strategy", strategy, "--rounds", str(options.rounds), "--min-clients", str(len(names))),
        *("--fraction", "1.0", "--round-timeout", str(options.round_timeout)),
        *("--init", str(bundle.parent / f"{bundle.name}-initial.safetensors")),
        *("--poll-interval", "0.5", *DEMO_SETTINGS),
        log=logs / "server.log",
        port=options.port or None,
        env=_env(),
        name="the demo server",
    )
    devices: list[subprocess.Popen] = []
    try:
        url = server.start(timeout=START_TIMEOUT).url
        for number, (name, token, (data, _, _)) in enumerate(zip(names, tokens, device_files)):
            command = [
                "device",
                "run",
                *("--bundle", str(bundle), "--data", str(data), "--server", url, "--token", token),
                *("--state", str(folder / name), "--seed", str(number), "--threads", "1"),
                *("--poll-interval", "0.5", "--json"),
            ]
            devices.append(_start(command, logs / f"{name}.log"))
        deadline = time.monotonic() + options.round_timeout * options.rounds + START_TIMEOUT
        outcomes = []
        for name, process, (_, classes, samples) in zip(names, devices, device_files):
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            log = logs / f"{name}.log"
            if code != 0:
                raise EdgePFLError(f"{name} stopped with exit code {code}: {last_line(log)}", f"see {log}")
            result = _json_result(log)
            outcomes.append(
                DeviceOutcome(name, classes, samples, result.get("final_accuracy"), int(result["rounds_trained"]))
            )
        return outcomes
    except subprocess.TimeoutExpired:
        raise EdgePFLError("the demo devices did not finish in time", f"see the logs in {logs}") from None
    finally:
        for process in devices:
            _stop(process)
        server.stop(grace=15)


def _print_comparison(outcomes: dict[str, list[DeviceOutcome]], rounds: int, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"held-out accuracy after {rounds} round(s): the final shared base + each device's own part")
    for column in ("device", "digits it holds", "samples", "FedPer (K_P=2)", "FedAvg"):
        table.add_column(column, justify="left" if column in ("device", "digits it holds") else "right")
    fedper, fedavg = outcomes["FedPer"], outcomes["FedAvg"]
    for per, avg in zip(fedper, fedavg):
        table.add_row(
            per.name, " ".join(map(str, per.classes)), str(per.samples), _pct(per.accuracy), _pct(avg.accuracy)
        )
    table.add_row("mean", "", "", _pct(_mean(fedper)), _pct(_mean(fedavg)), style="bold")
    console = Console()
    console.print(table)
    console.print(
        f"{len(fedper)} `edgepfl device run` processes per strategy against a real `edgepfl serve` on loopback; "
        f"each device evaluates on 20% of its own data it never trained on. Took {seconds:.0f}s."
    )


def _edgepfl(arguments: list[str], log: Path) -> str:
    """Run an edgepfl command to completion; its stdout's last line (e.g. a token)."""
    done = subprocess.run(_command(arguments), capture_output=True, text=True, timeout=120, env=_env())
    with log.open("a", encoding="utf-8") as handle:
        handle.write(done.stderr)
    if done.returncode != 0:
        raise EdgePFLError(f"edgepfl {' '.join(arguments[:3])} failed: {done.stderr.strip()[-300:]}", f"see {log}")
    return done.stdout.strip().splitlines()[-1]


def _start(arguments: list[str], log: Path) -> subprocess.Popen:
    handle = log.open("w", encoding="utf-8")
    try:
        return subprocess.Popen(_command(arguments), stdout=handle, stderr=subprocess.STDOUT, env=_env())
    finally:
        handle.close()  # the child keeps its own descriptor


def _command(arguments: list[str]) -> list[str]:
    return [sys.executable, "-m", "edgepfl.cli", *arguments]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["COLUMNS"] = "120"
    env.pop("EDGEPFL_TOKEN", None)
    return env


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _json_result(log: Path) -> dict:
    for line in reversed(log.read_text(encoding="utf-8", errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    raise EdgePFLError(f"{log} holds no JSON result of edgepfl device run", "see the log")


def _mean(outcomes: list[DeviceOutcome]) -> float | None:
    values = [o.accuracy for o in outcomes if o.accuracy is not None]
    return float(np.mean(values)) if values else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
