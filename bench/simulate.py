"""Wall time per round and peak memory of `edgepfl simulate`, with `--workers 1` and with Ray actors.

Settings (issue 17): MNIST from --data-root, 10 clients x 2 classes (`classes:2`), `mlp`, 10 rounds x 1 epoch,
batch 32, lr 0.01, fedper, torch engine, one thread per engine; the same with 100 clients; and a
compute-bound setting for the speed-up from `--workers 2` (`cnn` on CIFAR-10, 10 clients x 2 classes,
3 rounds). Each run is a fresh process: its driver's peak RSS is its own, and the Ray actors' peak RSS
(VmHWM of every `ray::_Actor` process, sampled every 0.2 s while the run goes) is reported beside it.
Seconds per round are the mean of the rounds' `seconds` in results.json (training, uploads and the
aggregation, without the start-up: data loading, export, Ray's start).

Targets (issue 17): with `--workers 1`, at most 0.3x FL-bench's 4.0-5.2 s per round and at most 0.5x its
1.33 GB on this 2-core machine, and a speed-up of at least 1.6x from `--workers 2` on the compute-bound model.
Runners are a table keyed by name. `flower` runs the MNIST setting through Flower's simulation engine (Ray
backend, `flwr.simulation.run_simulation`) with edgepfl's ServerApp and ClientApp: every client is a virtual
SuperNode whose ClientApp is the device runtime (ort-training engine, one thread: nodes never use torch), and
two Ray actors run the ClientApps (`workers` 2). Its seconds per round are the `seconds` metric of each
round (planning, messages, training, acceptance, aggregation); its memory is the driver's (ServerApp and
Flower's simulation runtime) and the `ray::ClientAppActor` processes'.

Prints JSON on stdout and a table on stderr; writes bench/out/simulate.png.
Usage: python bench/simulate.py [--data-root ../shared/data] [--quick] [--only flower]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLBENCH_SECONDS, FLBENCH_BYTES = (4.0, 5.2), 1.33e9
TARGET_TIME, TARGET_MEMORY, TARGET_SPEEDUP = 0.3, 0.5, 1.6
MNIST = {"model": "mlp", "dataset": "mnist", "rounds": 10, "clients": 10}
CIFAR = {"model": "cnn", "dataset": "cifar10", "rounds": 3, "clients": 10, "norm": "batch"}


def settings(quick: bool) -> list[tuple[str, dict, int, str]]:
    """(label, config changes, workers, runner) of every run."""
    mnist = {**MNIST, "rounds": 3} if quick else MNIST
    runs = [("mnist-mlp-10", mnist, 1, "edgepfl"), ("mnist-mlp-10", mnist, 2, "edgepfl")]
    runs += [("mnist-mlp-100", {**mnist, "clients": 100}, w, "edgepfl") for w in (1, 2)]
    cifar = {**CIFAR, "rounds": 1} if quick else CIFAR
    runs += [("cifar10-cnn-10", cifar, 1, "edgepfl"), ("cifar10-cnn-10", cifar, 2, "edgepfl")]
    return runs + [("mnist-mlp-10", mnist, 2, "flower")]


def run_edgepfl(changes: dict, workers: int, data_root: str, out: str) -> dict:
    """One `edgepfl simulate` run in this process (the child): seconds per round and peak memory."""
    from edgepfl.simulate.config import SimulateConfig
    from edgepfl.simulate.loop import run_simulation
    from edgepfl.simulate.workers import peak_rss

    config = SimulateConfig(
        out=out,
        data_root=data_root,
        partition="classes:2",
        epochs=1,
        batch_size=32,
        lr=0.01,
        algorithm="fedper",
        kp=1,
        engine="torch",
        threads=1,
        seed=0,
        workers=workers,
        **changes,
    )
    actors: dict[int, int] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_actors, args=(actors, stop), daemon=True)
    sampler.start()
    started = time.perf_counter()
    results = run_simulation(config)
    wall = time.perf_counter() - started
    stop.set()
    sampler.join()
    seconds = [record.seconds for record in results.rounds]
    return {
        "seconds_per_round": sum(seconds) / len(seconds),
        "wall_seconds": wall,
        "driver_peak_bytes": peak_rss(),
        "worker_peak_bytes": sorted(actors.values()),
        "last_accuracy": results.rounds[-1].test_accuracy["mean"],
    }


def run_flower(changes: dict, workers: int, data_root: str, out: str) -> dict:
    """The same setting through Flower's simulation engine with edgepfl's ServerApp and ClientApp (the child)."""
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation as run_flower_simulation

    from edgepfl.flower.client_app import make_client_app
    from edgepfl.flower.config import server_config
    from edgepfl.flower.server_app import run_federation
    from edgepfl.simulate.bundle import ensure_bundle
    from edgepfl.simulate.config import SimulateConfig
    from edgepfl.simulate.loop import load_partition
    from edgepfl.simulate.workers import peak_rss

    config = SimulateConfig(
        out=out,
        data_root=data_root,
        partition="classes:2",
        epochs=1,
        batch_size=32,
        lr=0.01,
        algorithm="fedper",
        kp=1,
        engine="ort-training",
        threads=1,
        seed=0,
        **changes,
    )
    dataset, _ = load_partition(config)
    ensure_bundle(config, Path(out) / "bundle", dataset.sample_shape, dataset.num_classes)
    run_config = {
        "bundle": str(Path(out) / "bundle"),
        "out": str(Path(out) / "flower"),
        "strategy": "fedper",
        "rounds": config.rounds,
        "nodes": config.clients,
        "min-clients": 1,
        "seed": 0,
        "epochs": 1,
        "batch-size": 32,
        "lr": 0.01,
        "engine": "ort-training",
        "threads": 1,
        "dataset": config.dataset,
        "data-root": data_root,
        "partition": "classes:2",
        "clients": config.clients,
        "state-root": str(Path(out) / "devices"),
    }
    results = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid, context) -> None:
        results.append(run_federation(grid, server_config(run_config)))

    actors: dict[int, int] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_actors, args=(actors, stop), daemon=True)
    sampler.start()
    started = time.perf_counter()
    run_flower_simulation(
        server_app,
        make_client_app(run_config),
        num_supernodes=config.clients,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0}, "init_args": {"num_cpus": workers}},
    )
    wall = time.perf_counter() - started
    stop.set()
    sampler.join()
    if not results:
        raise SystemExit("the Flower run did not finish (see its log above)")
    seconds = [float(metrics["seconds"]) for metrics in results[0].train_metrics_clientapp.values()]
    return {
        "seconds_per_round": sum(seconds) / len(seconds),
        "wall_seconds": wall,
        "driver_peak_bytes": peak_rss(),
        "worker_peak_bytes": sorted(actors.values()),
        "rounds": len(seconds),
    }


RUNNERS = {"edgepfl": run_edgepfl, "flower": run_flower}
ACTOR_TITLES = (b"ray::_Actor", b"ray::ClientAppActor")  # edgepfl simulate's workers, Flower's ClientApp actors


def _sample_actors(peaks: dict[int, int], stop: threading.Event) -> None:
    """Keep the largest VmHWM seen of every Ray actor process (their proctitles: ACTOR_TITLES)."""
    while not stop.wait(0.2):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if not (entry / "cmdline").read_bytes().startswith(ACTOR_TITLES):
                    continue
                for line in (entry / "status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        kib = int(line.split()[1])
                        peaks[int(entry.name)] = max(peaks.get(int(entry.name), 0), kib * 1024)
            except (OSError, ValueError):
                continue  # the process ended meanwhile


def measure(label: str, changes: dict, workers: int, data_root: str, runner: str = "edgepfl") -> dict:
    """One run in a fresh Python process, so that its peak memory is its own."""
    with tempfile.TemporaryDirectory() as out:
        request = json.dumps(
            {"runner": runner, "changes": changes, "workers": workers, "data_root": data_root, "out": out}
        )
        child = subprocess.run(
            [sys.executable, __file__, "--child", request],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    if child.returncode != 0:
        sys.exit(f"{label} workers={workers} failed:\n{child.stderr[-2000:]}")
    return {"setting": label, "runner": runner, "workers": workers, **json.loads(child.stdout.splitlines()[-1])}


def summarise(rows: list[dict]) -> dict:
    """The issue's targets, read off the rows."""
    one = next(r for r in rows if r["setting"] == "mnist-mlp-10" and r["workers"] == 1)
    cifar = {r["workers"]: r for r in rows if r["setting"] == "cifar10-cnn-10"}
    return {
        "time_vs_flbench": [one["seconds_per_round"] / s for s in FLBENCH_SECONDS],
        "time_target": TARGET_TIME,
        "memory_vs_flbench": one["driver_peak_bytes"] / FLBENCH_BYTES,
        "memory_target": TARGET_MEMORY,
        "speedup_workers_2": cifar[1]["seconds_per_round"] / cifar[2]["seconds_per_round"],
        "speedup_model": "cnn (batch norm) on CIFAR-10, one thread per engine",
        "speedup_target": TARGET_SPEEDUP,
    }


def plot(rows: list[dict], path: Path) -> None:
    """Seconds per round and peak memory per setting, one bar per worker count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({r["setting"] for r in rows}, key=[r["setting"] for r in rows].index)
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for offset, workers in ((-0.2, 1), (0.2, 2)):
        chosen = [next(r for r in rows if r["setting"] == label and r["workers"] == workers) for label in labels]
        xs = [i + offset for i in range(len(labels))]
        left.bar(xs, [r["seconds_per_round"] for r in chosen], width=0.4, label=f"--workers {workers}")
        memory = [(r["driver_peak_bytes"] + sum(r["worker_peak_bytes"])) / 1e9 for r in chosen]
        right.bar(xs, memory, width=0.4, label=f"--workers {workers}")
    left.axhspan(FLBENCH_SECONDS[0], FLBENCH_SECONDS[1], color="grey", alpha=0.3, label="FL-bench (mnist)")
    right.axhline(FLBENCH_BYTES / 1e9, color="grey", label="FL-bench (mnist)")
    for axis, title in ((left, "seconds per round"), (right, "peak GB (driver + actors)")):
        axis.set_xticks(range(len(labels)), labels)
        axis.set_title(title)
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run of the script)")
    parser.add_argument("--only", choices=sorted(RUNNERS), help="run this runner's rows only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        request = json.loads(args.child)
        runner = RUNNERS[request["runner"]]
        print(json.dumps(runner(request["changes"], request["workers"], request["data_root"], request["out"])))
        return
    rows = []
    for label, changes, workers, runner in settings(args.quick):
        if args.only in (None, runner):
            print(f"running {runner} {label} --workers {workers} ...", file=sys.stderr)
            rows.append(measure(label, changes, workers, args.data_root, runner))
    complete = args.only is None
    result = {
        "rows": rows,
        "summary": summarise(rows) if complete else None,
        "cores": os.cpu_count(),
        "quick": args.quick,
    }
    print(json.dumps(result, indent=2))
    print(
        f"{'runner':8} {'setting':16} {'workers':>7} {'s/round':>8} {'driver MB':>9} {'actors MB':>10}", file=sys.stderr
    )
    for r in rows:
        actors = "+".join(f"{b / 1e6:.0f}" for b in r["worker_peak_bytes"]) or "-"
        print(
            f"{r['runner']:8} {r['setting']:16} {r['workers']:>7} {r['seconds_per_round']:>8.2f} "
            f"{r['driver_peak_bytes'] / 1e6:>9.0f} {actors:>10}",
            file=sys.stderr,
        )
    if complete:
        plot([r for r in rows if r["runner"] == "edgepfl"], ROOT / "bench" / "out" / "simulate.png")


if __name__ == "__main__":
    main()
