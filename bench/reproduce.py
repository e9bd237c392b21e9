"""Reproduce the seed papers' comparisons with `edgepfl simulate`; prints one JSON line per run, writes RESULTS.md.

Settings (issue 6):
  persfl-mnist   PersFL Tables 2-3 on MNIST: 10 users, 60/20/20, DS-1 (classes:4) / DS-2 (dirichlet:0.9) / DS-3,
                 `mlp`, FedAvg vs FedPer vs Local
  persfl-cifar   the same on CIFAR-10 with `cnn`
  fedper-k       FedPer's CIFAR-10 setting with `mobilenet`: FedAvg vs FedPer for classes:k, k in {4, 8, 10}
  fedper-kp      FedPer with K_P in {1, 2, 3, 4} at classes:4
  fedalt         FedAlt vs FedSim (= fedper) on the fedper-k setting at classes:4

Every run is a folder under --out holding results.json; rerunning resumes. `--report` reads every
results.json under --out and writes the markdown (our numbers only come from those files).
Usage: python bench/reproduce.py persfl-mnist --data-root ../shared/data --rounds 20 --out runs/bench
       python bench/reproduce.py --report --out runs/bench --figures bench/figures > RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from edgepfl.simulate.config import SimulateConfig
from edgepfl.simulate.loop import run_simulation
from edgepfl.simulate.results import load_results

PERSFL_PARTITIONS = {"DS-1": "classes:4", "DS-2": "dirichlet:0.9", "DS-3": "ds3"}
# PersFL (Tables 2-3), mean per-user accuracy in %, as quoted in issue 6
PAPER = {
    ("persfl-cifar", "fedavg"): {"DS-1": 45.0, "DS-2": 48.7, "DS-3": 46.6},
    ("persfl-cifar", "fedper"): {"DS-1": 78.2, "DS-2": 55.1, "DS-3": 79.2},
    ("persfl-mnist", "fedavg"): {"DS-1": 92.0, "DS-2": 85.5, "DS-3": 96.4},
    ("persfl-mnist", "fedper"): {"DS-1": 98.3, "DS-2": 85.5, "DS-3": 99.4},
}


def plan(setting: str, base: SimulateConfig) -> list[tuple[str, SimulateConfig]]:
    """(label, config) of every run of one setting."""
    runs = []
    if setting in ("persfl-mnist", "persfl-cifar"):
        model, dataset = ("mlp", "mnist") if setting == "persfl-mnist" else ("cnn", "cifar10")
        for name, partition in PERSFL_PARTITIONS.items():
            for algorithm in ("fedavg", "fedper", "local"):
                config = replace(base, model=model, dataset=dataset, partition=partition, algorithm=algorithm, kp=1)
                runs.append((f"{setting}/{name}/{algorithm}", config))
    elif setting == "fedper-k":
        for k in (4, 8, 10):
            for algorithm in ("fedavg", "fedper"):
                config = replace(
                    base, model=base.model, dataset="cifar10", partition=f"classes:{k}", algorithm=algorithm
                )
                runs.append((f"{setting}/k{k}/{algorithm}", config))
    elif setting == "fedper-kp":
        for kp in (1, 2, 3, 4):
            config = replace(
                base, model=base.model, dataset="cifar10", partition="classes:4", algorithm="fedper", kp=kp
            )
            runs.append((f"{setting}/kp{kp}/fedper", config))
    elif setting == "fedalt":
        for algorithm in ("fedalt", "fedper"):
            config = replace(base, model=base.model, dataset="cifar10", partition="classes:4", algorithm=algorithm)
            runs.append((f"{setting}/k4/{algorithm}", config))
    else:
        raise SystemExit(f"unknown setting {setting!r}")
    return runs


def run(args: argparse.Namespace) -> None:
    base = SimulateConfig(
        data_root=args.data_root,
        clients=10,
        rounds=args.rounds,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        width=args.width,
        model=args.model,
        engine="torch",
        threads=args.threads,
    )
    for seed in args.seeds:
        for label, config in plan(args.setting, replace(base, seed=seed)):
            out = Path(args.out) / label / f"seed{seed}"
            started = time.perf_counter()
            results = run_simulation(replace(config, out=str(out)))
            summary = results.summary()
            line = {"run": label, "seed": seed, "seconds": round(time.perf_counter() - started, 1), **summary}
            print(json.dumps(line), flush=True)


def report(out: Path, figures: Path | None = None) -> str:
    """Markdown tables from every results.json under `out`: mean ± std over clients and seeds.

    With `figures`, one accuracy plot per setting and partition (seed 0 of each run) is written there
    and linked from the markdown.
    """
    groups: dict[str, list] = {}
    for path in sorted(out.rglob("results.json")):
        results = load_results(path)
        if not results.rounds:
            continue  # started, no round completed yet
        label = str(path.parent.parent.relative_to(out))
        groups.setdefault(label, []).append(results)
    lines = [
        "# Reproduction results",
        "",
        "Written by `bench/reproduce.py --report` from the results.json files of the runs below; no number is",
        "typed by hand. Accuracy: each client's model (final shared base + its own personal part) on its own",
        "test split; mean ± std across clients and seeds. *Best* is the round with the highest mean",
        "validation accuracy (never chosen on the test split). Models are edgepfl's zoo models and the",
        "hyper-parameters are ours (stated per section), not necessarily the papers'; runs marked with fewer",
        "rounds than configured were still running or cut short for time.",
        "",
    ]
    settings = sorted({label.split("/")[0] for label in groups})
    for setting in settings:
        lines += [f"## {setting}", ""]
        first = next(r for label, rs in groups.items() if label.startswith(setting + "/") for r in rs)
        config = first.config
        lines.append(
            f"Config: `{config.model}`{f' width {config.width}' if config.model == 'mobilenet' else ''} "
            f"(K_P {config.kp} for fedper/fedalt; fedavg K_P 0; local keeps the whole model) on "
            f"{first.info.get('dataset', config.dataset)}, {first.info.get('clients')} clients, split "
            f"{'/'.join(str(int(100 * s)) for s in config.split)}, {config.rounds} rounds x {config.epochs} local "
            f"epoch(s), batch {config.batch_size}, lr {config.lr}, fraction {config.fraction}, engine {config.engine}."
        )
        lines += [
            "",
            "| run | seeds | rounds done | last round | best round (by validation) | paper (PersFL) |",
            "|---|---|---|---|---|---|",
        ]
        for label in sorted(k for k in groups if k.startswith(setting + "/")):
            runs = groups[label]
            _, part, algorithm = label.split("/")
            paper = PAPER.get((setting, algorithm), {}).get(part)
            last = [v for r in runs for v in r.rounds[-1].test_accuracy["per_client"] if v is not None]
            best = []
            for r in runs:
                chosen = r.summary()["best"]["round"]
                best += [v for v in r.rounds[chosen - 1].test_accuracy["per_client"] if v is not None]
            done = ",".join(str(len(r.rounds)) for r in runs)
            lines.append(
                f"| {label} | {len(runs)} | {done} | {_pm(last)} | {_pm(best)} | {'' if paper is None else paper} |"
            )
        lines.append("")
        if figures is not None:
            from edgepfl.simulate.plots import plot_runs

            parts = sorted({label.split("/")[1] for label in groups if label.startswith(setting + "/")})
            for part in parts:
                labels = sorted(k for k in groups if k.startswith(f"{setting}/{part}/"))
                path = figures / f"{setting}-{part}.png"
                plot_runs([groups[k][0] for k in labels], path, labels=[k.split("/")[2] for k in labels])
                lines += [f"![{setting} {part}]({path.as_posix()})", ""]
    return "\n".join(lines)


def _pm(values: list[float]) -> str:
    array = 100 * np.asarray(values, dtype=np.float64)
    return f"{array.mean():.1f} ± {array.std():.1f}" if len(array) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "setting", nargs="?", choices=["persfl-mnist", "persfl-cifar", "fedper-k", "fedper-kp", "fedalt"]
    )
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--data-root", default="../shared/data")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--model", default="mobilenet", help="fedper-k, fedper-kp, fedalt: the model (reduced: cnn)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--report", action="store_true", help="print RESULTS.md from the runs under --out")
    parser.add_argument("--figures", default=None, help="with --report: folder for the accuracy plots")
    args = parser.parse_args()
    if args.report:
        sys.stdout.write(report(Path(args.out), Path(args.figures) if args.figures else None))
        return
    if args.setting is None:
        parser.error("name a setting or pass --report")
    run(args)


if __name__ == "__main__":
    main()
