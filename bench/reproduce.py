"""Reproduce the seed papers' comparisons with `edgepfl simulate`; prints one JSON line per run, writes RESULTS.md.

Settings (issue 6):
  persfl-mnist   PersFL Tables 2-3 on MNIST: 10 users, 60/20/20, DS-1 (classes:4) / DS-2 (dirichlet:0.9) / DS-3,
                 `mlp`, FedAvg vs FedPer vs Local
  persfl-cifar   the same on CIFAR-10 with `cnn`
  fedper-k       FedPer's CIFAR-10 setting with `mobilenet`: FedAvg vs FedPer for classes:k, k in {4, 8, 10}, and
                 Local at k = 4 (issue 18)
  fedper-kp      FedPer with K_P in {1, 2, 3, 4} at classes:4
  fedper-budget  FedPer vs Local of fedper-k at classes:4, run for more rounds (--rounds; issue 18: the budget at
                 which FedPer reaches Local); copying fedper-k/k4/{fedper,local} here first resumes them
  fedper-paper   FedPer's CIFAR-10 MobileNet setting at the paper's per-round budget (issue 18): width 1.0, 4 local
                 epochs, batch 128, lr 0.01 (--rounds: the paper's 100): k=4 FedAvg vs FedPer vs Local, then k=10
                 FedAvg vs FedPer, then K_P in {1, 3, 4} at k=4 (K_P 2 is the k=4 FedPer run); meant for a GPU
                 (--device cuda)
  fedalt         FedAlt vs FedSim (= fedper) on the fedper-k setting at classes:4
  pfedla         pFedLA Table 1 (issue 7): CIFAR-10, 10 clients, classes:4, `cnn` with BatchNorm: FedAvg, Local,
                 FedRep (= fedalt with K_P 1: the head first, then the body), pFedLA, HeurpFedLA; writes the
                 alpha heat map of the paper's Fig. 6
  pfedla-hn      the pfedla table's pFedLA and HeurpFedLA at larger hypernetwork learning rates (issue 18: their
                 mixing weights hardly move at the default 5e-3 in 30 rounds), beside its FedAvg, Local and FedRep
  pfedla-mnist   issue 18's MNIST setting: 10 clients, classes:2, 75/25 train/test, `mlp`: FedAvg, Local, FedPer
                 (K_P 1), pFedLA, HeurpFedLA (K_P 0)
  fedalt-text    FedAlt's StackOverflow table (issue 38) on `shakespeare` (a client per speaking role, the
                 --clients largest roles): a `transformer` (--width) next-word model, FedAvg and Local, then FedAlt
                 and FedSim with the input layer, the output layer (output:1) or adapters (adapters:16) personal;
                 FedAvg followed by local fine-tuning is FedAvg's "after local training" column, shown as its own
                 row; and FedAlt with each part at the personal learning rates of TEXT_PERSONAL_LRS (issue 53: with
                 adapters its personal phase at the shared lr ended near chance)
  fedalt-text-rare
                 fedalt-text with a quarter of the roles drawn each round (issue 53: a role then trains its personal
                 part as rarely as FedAlt's devices do, against the overfitting of every role in every round):
                 FedAvg, then FedSim and FedAlt (personal lr of TEXT_PERSONAL_LRS) with each part personal
  har            issue 38's sensor table: UCI HAPT (a client per subject, all 30), `har-cnn`, FedAvg, Local, FedPer
                 (FedSim) and FedAlt with the output layer personal
The persfl-* settings also run PersFL (issue 7): FedAvg with teacher selection, then distillation.

Every run is a folder under --out holding results.json; rerunning resumes. `--report` reads every
results.json under --out and writes the markdown (our numbers only come from those files).
Usage: python bench/reproduce.py persfl-mnist --data-root ../shared/data --rounds 20 --out bench/results
       python bench/reproduce.py fedper-k --only k4/ --seeds 1 ...   (a subset of a setting's runs)
       python bench/reproduce.py --report --out bench/results --figures bench/figures > RESULTS.md
bench/results keeps only the results.json files under git, so RESULTS.md can be rebuilt from what is committed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import paired

from edgepfl.simulate.config import SimulateConfig
from edgepfl.simulate.loop import run_simulation
from edgepfl.simulate.results import load_results

PERSFL_PARTITIONS = {"DS-1": "classes:4", "DS-2": "dirichlet:0.9", "DS-3": "ds3"}
# PersFL (Tables 2-3), mean per-user accuracy in %, as quoted in issue 6
PAPER = {
    ("persfl-cifar", "fedavg"): {"DS-1": 45.0, "DS-2": 48.7, "DS-3": 46.6},
    ("persfl-cifar", "fedper"): {"DS-1": 78.2, "DS-2": 55.1, "DS-3": 79.2},
    ("persfl-cifar", "persfl"): {"DS-1": 81.9, "DS-2": 59.6, "DS-3": 82.3},  # issue 7
    ("persfl-mnist", "fedavg"): {"DS-1": 92.0, "DS-2": 85.5, "DS-3": 96.4},
    ("persfl-mnist", "fedper"): {"DS-1": 98.3, "DS-2": 85.5, "DS-3": 99.4},
    ("persfl-mnist", "persfl"): {"DS-1": 98.6, "DS-2": 88.0, "DS-3": 99.4},  # issue 7
    # pFedLA Table 1 (CIFAR-10, 10 clients, 4 classes each), as quoted in issue 7; FedRep is our fedalt K_P 1
    ("pfedla", "fedavg"): {"k4": 48.57},
    ("pfedla", "local"): {"k4": 59.44},
    ("pfedla", "fedrep"): {"k4": 58.01},
    ("pfedla", "pfedla"): {"k4": 61.43},
    ("pfedla", "heurpfedla"): {"k4": 60.02},
    # FedAlt's StackOverflow table (Pillutla et al. 2022), mean accuracy, seed 1, as quoted in issue 38
    ("fedalt-text", "fedavg"): {"none": 23.82},
    ("fedalt-text", "fedalt"): {"input": 24.47, "output": 25.04, "adapters16": 24.81},
    ("fedalt-text", "fedsim"): {"input": 24.78, "output": 24.77, "adapters16": 24.40},
}
PAPER_SOURCE = {
    "persfl-cifar": "PersFL",
    "persfl-mnist": "PersFL",
    "pfedla": "pFedLA",
    "fedalt-text": "FedAlt, StackOverflow, its transformer",
}
NOTES_FILE = "NOTES.md"  # under --out: appended to the report
# rows whose config is identical to another setting's run: read from (and run into) that run's folder
SAME_RUN = {
    "fedper-kp/kp2/fedper": "fedper-k/k4/fedper",
    "fedalt/k4/fedper": "fedper-k/k4/fedper",
    "fedper-paper/kp2/fedper": "fedper-paper/k4/fedper",
    **{f"pfedla-hn/k4/{label}": f"pfedla/k4/{label}" for label in ("fedavg", "local", "fedrep", "pfedla")},
}
# pfedla-hn's hypernetwork learning rates (the default, 5e-3, is the pfedla table's)
PFEDLA_HN_RATES = (0.05, 0.5)
# fedalt-text's personal parts (issue 38): FedAlt's input, output and adapter-16 rows
TEXT_PERSONAL = {"input": "input", "output": "output:1", "adapters16": "adapters:16"}
# fedalt-text's data: the --clients largest roles, 2,000 words (FedAlt's: 10,000; two cores), 20-token windows
TEXT_DATA = {"dataset": "shakespeare", "partition": "natural", "vocab_size": 2000, "seq_len": 20}
FINETUNED = "fedavg+ft"  # the text settings' row read from FedAvg's "after local training" scores
TEXT_SETTINGS = ("fedalt-text", "fedalt-text-rare")  # the settings with a FINETUNED row
PAIRED_SETTINGS = (*TEXT_SETTINGS, "har")  # held against FedAvg client by client (bench/paired.py)
# issue 53's experiment: FedAlt's personal part trained in its personal phase at its own learning rate (--personal-lr)
TEXT_PERSONAL_LRS = (0.05,)
TEXT_RARE_FRACTION = 0.25  # fedalt-text-rare: the share of the roles drawn each round
SCALED_MODELS = ("mobilenet", "transformer", "lstm", "har-cnn")  # the zoo models --width scales
# FedPer's paper budget per round (issue 18): MobileNet width 1.0, 4 local epochs, batch 128, lr 0.01
FEDPER_PAPER = {"width": 1.0, "epochs": 4, "batch_size": 128, "lr": 0.01}


def plan(setting: str, base: SimulateConfig) -> list[tuple[str, SimulateConfig]]:
    """(label, config) of every run of one setting."""
    runs = []
    if setting in ("persfl-mnist", "persfl-cifar"):
        model, dataset = ("mlp", "mnist") if setting == "persfl-mnist" else ("cnn", "cifar10")
        for name, partition in PERSFL_PARTITIONS.items():
            for algorithm in ("fedavg", "fedper", "local", "persfl"):
                config = base.updated(model=model, dataset=dataset, partition=partition, algorithm=algorithm, kp=1)
                runs.append((f"{setting}/{name}/{algorithm}", config))
    elif setting == "fedper-k":
        for k in (4, 8, 10):
            for algorithm in ("fedavg", "fedper", "local") if k == 4 else ("fedavg", "fedper"):
                config = base.updated(dataset="cifar10", partition=f"classes:{k}", algorithm=algorithm)
                runs.append((f"{setting}/k{k}/{algorithm}", config))
    elif setting == "fedper-kp":
        for kp in (1, 2, 3, 4):
            config = base.updated(dataset="cifar10", partition="classes:4", algorithm="fedper", kp=kp)
            runs.append((f"{setting}/kp{kp}/fedper", config))
    elif setting == "fedper-budget":
        for algorithm in ("fedper", "local"):
            config = base.updated(dataset="cifar10", partition="classes:4", algorithm=algorithm)
            runs.append((f"{setting}/k4/{algorithm}", config))
    elif setting == "fedper-paper":
        paper = base.updated(model="mobilenet", dataset="cifar10", **FEDPER_PAPER)
        for label, algorithm, k, kp in (
            ("k4/fedavg", "fedavg", 4, 2),
            ("k4/fedper", "fedper", 4, 2),
            ("k4/local", "local", 4, 2),
            ("k10/fedavg", "fedavg", 10, 2),
            ("k10/fedper", "fedper", 10, 2),
            ("kp1/fedper", "fedper", 4, 1),
            ("kp3/fedper", "fedper", 4, 3),
            ("kp4/fedper", "fedper", 4, 4),
        ):
            runs.append((f"{setting}/{label}", paper.updated(partition=f"classes:{k}", algorithm=algorithm, kp=kp)))
    elif setting == "fedalt":
        for algorithm in ("fedalt", "fedper"):
            config = base.updated(model=base.model, dataset="cifar10", partition="classes:4", algorithm=algorithm)
            runs.append((f"{setting}/k4/{algorithm}", config))
    elif setting == "pfedla":
        cnn = base.updated(model="cnn", norm="batch", dataset="cifar10", partition="classes:4")
        for label, algorithm, kp in (
            ("fedavg", "fedavg", 0),
            ("local", "local", 0),
            ("fedrep", "fedalt", 1),
            ("pfedla", "pfedla", 0),
            ("heurpfedla", "heurpfedla", 0),
        ):
            runs.append((f"{setting}/k4/{label}", cnn.updated(algorithm=algorithm, kp=kp)))
    elif setting == "pfedla-hn":
        table = dict(plan("pfedla", base))
        for label in ("fedavg", "local", "fedrep", "pfedla"):
            runs.append((f"{setting}/k4/{label}", table[f"pfedla/k4/{label}"]))
        for hn_lr in PFEDLA_HN_RATES:
            for algorithm in ("pfedla", "heurpfedla"):
                config = table[f"pfedla/k4/{algorithm}"].updated(hn_lr=hn_lr)
                runs.append((f"{setting}/k4/{algorithm}-hn{hn_lr:g}", config))
    elif setting == "pfedla-mnist":
        mlp = base.updated(model="mlp", dataset="mnist", partition="classes:2", split=(0.75, 0.0, 0.25))
        for label, algorithm, kp in (
            ("fedavg", "fedavg", 0),
            ("local", "local", 0),
            ("fedper", "fedper", 1),
            ("pfedla", "pfedla", 0),
            ("heurpfedla", "heurpfedla", 0),
        ):
            runs.append((f"{setting}/c2/{label}", mlp.updated(algorithm=algorithm, kp=kp)))
    elif setting == "fedalt-text":
        text = base.updated(model="transformer", **TEXT_DATA)
        runs += [
            (f"{setting}/none/{algorithm}", text.updated(algorithm=algorithm)) for algorithm in ("fedavg", "local")
        ]
        for part, spec in TEXT_PERSONAL.items():
            for algorithm in ("fedalt", "fedsim"):
                runs.append((f"{setting}/{part}/{algorithm}", text.updated(algorithm=algorithm, personal=spec)))
        runs += _personal_lr_runs(setting, text)
    elif setting == "fedalt-text-rare":
        rare = base.updated(model="transformer", fraction=TEXT_RARE_FRACTION, **TEXT_DATA)
        runs.append((f"{setting}/none/fedavg", rare.updated(algorithm="fedavg")))
        for part, spec in TEXT_PERSONAL.items():
            runs.append((f"{setting}/{part}/fedsim", rare.updated(algorithm="fedsim", personal=spec)))
        runs += _personal_lr_runs(setting, rare)
    elif setting == "har":
        har = base.updated(model="har-cnn", width=1.0, dataset="har", partition="natural", clients=None)
        runs += [
            (f"{setting}/subjects/{algorithm}", har.updated(algorithm=algorithm)) for algorithm in ("fedavg", "local")
        ]
        for algorithm in ("fedsim", "fedalt"):
            runs.append((f"{setting}/subjects/{algorithm}", har.updated(algorithm=algorithm, personal="output:1")))
    else:
        raise SystemExit(f"unknown setting {setting!r}")
    return runs


def _personal_lr_runs(setting: str, text: SimulateConfig) -> list[tuple[str, SimulateConfig]]:
    """FedAlt with each part of TEXT_PERSONAL personal, its personal phase at each of TEXT_PERSONAL_LRS (issue 53)."""
    return [
        (f"{setting}/{part}/fedalt-plr{lr:g}", text.updated(algorithm="fedalt", personal=spec, personal_lr=lr))
        for lr in TEXT_PERSONAL_LRS
        for part, spec in TEXT_PERSONAL.items()
    ]


def run(args: argparse.Namespace) -> None:
    base = SimulateConfig(
        data_root=args.data_root,
        clients=args.clients,
        rounds=args.rounds,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        personal_lr=args.personal_lr,
        width=args.width,
        model=args.model,
        engine="torch",
        threads=args.threads,
        device=args.device,
    )
    for seed in args.seeds:
        for label, config in plan(args.setting, base.updated(seed=seed)):
            if args.only and not any(part in label for part in args.only):
                continue
            out = Path(args.out) / SAME_RUN.get(label, label) / f"seed{seed}"
            started = time.perf_counter()
            results = run_simulation(config.updated(out=str(out)))
            summary = results.summary()
            line = {"run": label, "seed": seed, "seconds": round(time.perf_counter() - started, 1), **summary}
            print(json.dumps(line), flush=True)


def report(out: Path, figures: Path | None = None) -> str:
    """Markdown tables from every results.json under `out`: mean ± std over clients and seeds.

    With `figures`, one accuracy plot per setting and partition (seed 0 of each run) is written there
    and linked from the markdown, and for pFedLA the mixing-weight heat map.
    """
    groups: dict[str, list] = {}
    stale: dict[str, set[int]] = {}  # label: seeds whose run scored BatchNorm before issue 18's re-estimation
    for path in sorted(out.rglob("results.json")):
        results = load_results(path)
        if not results.rounds:
            continue  # started, no round completed yet
        label = str(path.parent.parent.relative_to(out))
        groups.setdefault(label, []).append(results)
        receives = results.config.algorithm != "local"  # local training receives no base: nothing to re-estimate
        if receives and _has_batchnorm(results.config) and "recompute_bn" not in json.loads(path.read_text())["config"]:
            stale.setdefault(label, set()).add(results.config.seed)
    for label, same in SAME_RUN.items():  # a row of a series (kp1, kp3, ...) that is another row's run
        setting = label.split("/")[0]
        series = {k for k in groups if k.split("/")[0] == setting and _series(k) == _series(label)}
        if same in groups and series:
            groups[label] = groups[same]
            if same in stale:
                stale[label] = stale[same]
    lines = [
        "# Reproduction results",
        "",
        "Written by `bench/reproduce.py --report` from the results.json files under `bench/results/`; no number",
        "is typed by hand. Accuracy: every method is scored by one protocol (`device_runtime/evaluation.py`, issue",
        "18), on each client's own test split. The headline number is the model each device holds and uses after",
        "the round: its own personal part as the round left it, with the shared part it receives after the round",
        "(the new global base; for pFedLA its own mix θ̄ᵢ for the next round; nothing for local training) and its",
        "BatchNorm statistics re-estimated on its training data under that base, as a device does when a base",
        "arrives (runs marked † predate that). *After local training* is the same device's model right after the",
        "round's local training, before it receives anything (written by runs made since issue 18; '-' where a run",
        "predates it).",
        "Mean ± std across clients and seeds. *Best* is the round with the highest mean",
        "validation accuracy (never chosen on the test split); *mean per seed* gives each seed's mean over its",
        "clients, in seed order. For PersFL the accuracy is the distilled student's",
        "(its (λ, T) chosen on each client's validation split), after the FedAvg rounds. Models are edgepfl's zoo",
        "models and the hyper-parameters are ours (stated per section), not necessarily the papers'.",
        "",
    ]
    settings = sorted({label.split("/")[0] for label in groups})
    for setting in settings:
        lines += [f"## {setting}", ""]
        labels = sorted((k for k in groups if k.startswith(setting + "/")), key=_natural)
        config = groups[labels[0]][0].config
        info = groups[labels[0]][0].info
        norm = f", norm {config.norm}" if config.norm else ""
        lines.append(
            f"Config: `{config.model}`{f' width {config.width}' if config.model in SCALED_MODELS else ''}{norm} on "
            f"{info.get('dataset', config.data.dataset)}, {info.get('clients')} clients, split "
            f"{'/'.join(str(int(100 * s)) for s in config.data.split)}, {config.rounds} rounds x "
            f"{config.round.epochs} local epoch(s), batch {config.round.batch_size}, lr {config.round.lr}, fraction "
            f"{config.fraction}, engine {config.engine}."
        )
        source = f" ({PAPER_SOURCE[setting]})" if setting in PAPER_SOURCE else ""
        lines += [
            "",
            f"| run | personal | seeds | rounds done | last round | last round, mean per seed | last round, 10th "
            f"percentile per seed | last round, after local training | best round (by validation) | paper{source} |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label in labels:
            runs = groups[label]
            _, part, algorithm = label.split("/")
            paper = PAPER.get((setting, algorithm), {}).get(part)
            kp = _personal(runs[0])
            done = ",".join(str(len(r.rounds)) for r in runs)
            same = f" (= {SAME_RUN[label]})" if label in SAME_RUN else ""
            same += _dagger(stale.get(label, set()), {r.config.seed for r in runs})
            if runs[0].persfl is not None:  # the student is the result; the teacher is the chosen global model
                clients = [r.persfl["clients"] for r in runs if r.persfl is not None]  # None: stage 2 not done
                students = [[c["student"]["test_accuracy"] for c in run if "student" in c] for run in clients]
                teachers = [[c["teacher"]["test_accuracy"] for c in run if "teacher" in c] for run in clients]
                lines.append(
                    f"| {label} (student) | {kp} | {len(runs)} | {done} | {_pm(sum(students, []))} | "
                    f"{_per_seed(students)} | {_p10_per_seed(students)} | - | - | {'' if paper is None else paper} |"
                )
                lines.append(
                    f"| {label} (its teacher) | {kp} | {len(runs)} | {done} | {_pm(sum(teachers, []))} | "
                    f"{_per_seed(teachers)} | {_p10_per_seed(teachers)} | - | - |  |"
                )
                continue
            per_run = [[v for v in r.rounds[-1].test_accuracy["per_client"] if v is not None] for r in runs]
            last = sum(per_run, [])
            best = []
            for r in runs:
                chosen = r.summary()["best"]["round"]
                best += [v for v in r.rounds[chosen - 1].test_accuracy["per_client"] if v is not None]
            trained = [(r.rounds[-1].trained_test_accuracy or {}).get("per_client") for r in runs]
            after = _pm([v for t in trained if t for v in t if v is not None]) if all(trained) else "-"
            lines.append(
                f"| {label}{same} | {kp} | {len(runs)} | {done} | {_pm(last)} | {_per_seed(per_run)} | "
                f"{_p10_per_seed(per_run)} | {after} | {_pm(best)} | {'' if paper is None else paper} |"
            )
            if setting in TEXT_SETTINGS and algorithm == "fedavg" and all(trained):
                # FedAvg + fine-tuning: each device's global model after its local epochs of the last round
                tuned = [[v for v in t if v is not None] for t in trained]
                lines.append(
                    f"| {setting}/{part}/{FINETUNED} (= fedavg, after local training) | all, after FedAvg | "
                    f"{len(runs)} | {done} | {_pm(sum(tuned, []))} | {_per_seed(tuned)} | {_p10_per_seed(tuned)} | "
                    f"- | - |  |"
                )
        if any(label in stale for label in labels):
            lines += [
                "",
                "† made before issue 18's BatchNorm fix: the held score kept the statistics the device had "
                "computed under the old base (the fix re-estimates them under each received base), so these rows "
                "understate every method that receives a base; not rerun (only for the seeds named, where a row "
                "names them).",
            ]
        lines += _at_common_round(groups, labels)
        if setting in PAIRED_SETTINGS:
            finetuned = FINETUNED if setting in TEXT_SETTINGS else None
            lines += ["", *paired.table(setting, labels, groups, finetuned)]
            path = figures / f"{setting}-paired.png" if figures is not None else None
            if path is not None and paired.plot(setting, labels, groups, path, finetuned):
                lines += [f"![{setting} against FedAvg]({path.as_posix()})", ""]
        kept = [(label, r) for label in labels for r in groups[label] if r.rounds and r.rounds[-1].bytes_kept]
        for label, r in kept:
            moved = r.rounds[-1].bytes_up + r.rounds[-1].bytes_down
            share = r.rounds[-1].bytes_kept / (moved + r.rounds[-1].bytes_kept)
            lines += [
                "",
                f"HeurpFedLA kept {100 * share:.1f}% of the round's bytes on the clients "
                f"({label}, seed {r.config.seed}, last round).",
            ]
        lines.append("")
        if figures is not None:
            from edgepfl.simulate.plots import plot_runs

            plotted = [k for k in labels if not groups[k][0].persfl]  # a PersFL run's curve is its teacher's
            parts = sorted({label.split("/")[1] for label in plotted}, key=_natural)
            runs_in = Counter(k.split("/")[1] for k in plotted)  # runs per part
            one_each = all(runs_in[part] == 1 for part in parts)
            for series in dict.fromkeys(_series(f"{setting}/{part}") for part in parts):
                in_series = [part for part in parts if _series(f"{setting}/{part}") == series]
                if all(runs_in[part] == 1 for part in in_series):
                    # every part of the series is one run (kp1, kp2, ...): one plot for the series
                    name = setting if one_each else f"{setting}-{series}"
                    shown = [k for k in plotted if k.split("/")[1] in in_series]
                    path = figures / f"{name}.png"
                    plot_runs([groups[k][0] for k in shown], path, labels=[k.split("/")[1] for k in shown])
                    alt = setting if one_each else f"{setting} {series}"
                    lines += [f"![{alt}]({path.as_posix()})", ""]
                    continue
                for part in in_series:
                    in_part = [k for k in plotted if k.startswith(f"{setting}/{part}/")]
                    path = figures / f"{setting}-{part}.png"
                    plot_runs([groups[k][0] for k in in_part], path, labels=[k.split("/")[2] for k in in_part])
                    lines += [f"![{setting} {part}]({path.as_posix()})", ""]
            for label in labels:
                if groups[label][0].alpha:
                    path = figures / f"{label.replace('/', '-')}-alpha.png"
                    run = groups[label][0]
                    shown = plot_alpha(run, path)
                    # the start is recomputed with today's init: runs made before issue 18's head init get none
                    start = initial_alpha(run) if run.rounds[-1].trained_test_accuracy is not None else None
                    drift = "; ".join(
                        (f"`{name}` {np.diag(start[name]).mean():.2f} at the start, " if start else f"`{name}` ")
                        + f"{np.diag(np.asarray(run.alpha[name])).mean():.2f} after round {len(run.rounds)}"
                        for name in shown
                    )
                    if start is None:
                        drift += " (this run predates issue 18's hypernetwork initialisation)"
                    lines += [
                        f"Mixing weights α learnt by {label} (seed {run.config.seed}) after its last round (row i:",
                        f"how much client i takes of each client's tensor; the paper's Fig. 6). Mean self-weight αᵢⁱ: "
                        f"{drift}.",
                        "",
                        f"![{label} alpha]({path.as_posix()})",
                        "",
                    ]
    notes = out / NOTES_FILE
    if notes.is_file():  # how the runs were made and what was reduced: prose kept beside the results, no numbers
        lines += [notes.read_text(encoding="utf-8").rstrip(), ""]
    return "\n".join(lines)


def _at_common_round(groups: dict[str, list], labels: list[str]) -> list[str]:
    """Where a setting's runs stopped at different rounds: every run's held score at the last round that every
    run of its seed in the same series on the same partition reached (each seed, series and partition compared
    within itself, so a short run of one seed, of another partition, or of the k series beside the kp series,
    does not cut the others)."""
    plain = [label for label in labels if not groups[label][0].persfl]
    partitions: dict[tuple[str, str], list[str]] = {}
    for label in plain:
        partitions.setdefault((groups[label][0].config.data.partition, _series(label)), []).append(label)
    lines = []
    for (partition, _), in_partition in partitions.items():
        common: dict[int, int] = {}
        for label in in_partition:
            for run in groups[label]:
                seed = run.config.seed
                common[seed] = min(common.get(seed, len(run.rounds)), len(run.rounds))
        if all(len(r.rounds) == common[r.config.seed] for label in in_partition for r in groups[label]):
            continue
        where = ", ".join(f"seed {seed}: round {round_id}" for seed, round_id in sorted(common.items()))
        on = f" on {partition}" if len({key[0] for key in partitions}) > 1 else ""
        if len({key[1] for key in partitions if key[0] == partition}) > 1:
            on += " (" + ", ".join(dict.fromkeys(label.split("/")[1] for label in in_partition)) + ")"
        lines += ["", f"The runs{on} stopped at different rounds. At the last round every run of a seed reached "]
        lines[-1] += f"({where}), mean per seed:"
        for label in in_partition:
            runs = sorted(groups[label], key=lambda r: r.config.seed)
            per_run = [
                [v for v in r.rounds[common[r.config.seed] - 1].test_accuracy["per_client"] if v is not None]
                for r in runs
                if common[r.config.seed]
            ]
            lines.append(f"- {label}: {_per_seed(per_run)}")
    return lines


def _dagger(stale_seeds: set[int], seeds: set[int]) -> str:
    """The † of a row made (wholly, or for the seeds it names) before issue 18's BatchNorm fix."""
    if not stale_seeds:
        return ""
    if stale_seeds == seeds:
        return " †"
    return " † (seed " + ", ".join(str(seed) for seed in sorted(stale_seeds)) + ")"


def _series(label: str) -> str:
    """The series a run label's part belongs to, its letters: "kp" for fedper-paper/kp3/fedper, "k" for k10."""
    return label.split("/")[1].rstrip("0123456789")


def _natural(label: str) -> list:
    """Sort key reading the numbers in a label as numbers: k4 before k10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", label)]


def initial_alpha(results) -> dict[str, np.ndarray]:
    """The run's mixing weights before its first round: its strategy's hypernetworks as initialised (same seed)."""
    from edgepfl.manifest import TensorSpec
    from edgepfl.protocol import RoundSettings
    from edgepfl.server.strategies.pfedla import PFedLA, PFedLAOptions

    specs = [TensorSpec(name, (1,), "float32", "base", 0) for name in results.alpha]  # α needs names only
    options = PFedLAOptions(pfedla_clients=len(next(iter(results.alpha.values()))))
    fresh = PFedLA(specs, options, RoundSettings(), results.config.seed)
    return {name: fresh.alpha_matrix(name) for name in results.alpha}


def plot_alpha(results, path: Path) -> list[str]:
    """Heat maps of the N x N mixing weights of the first and the last mixed weight tensor; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name in results.alpha if name.endswith("weight")] or list(results.alpha)
    shown = [names[0], names[-1]] if len(names) > 1 else names
    figure, axes = plt.subplots(1, len(shown), figsize=(5.2 * len(shown), 4.4), squeeze=False)
    for axis, name in zip(axes[0], shown):
        matrix = np.asarray(results.alpha[name])
        image = axis.imshow(matrix, cmap="viridis", vmin=0.0, vmax=max(float(matrix.max()), 1e-9))
        axis.set_title(name)
        axis.set_xlabel("client j (source)")
        axis.set_ylabel("client i (receiver)")
        figure.colorbar(image, ax=axis, fraction=0.046)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return shown


def _has_batchnorm(config: SimulateConfig) -> bool:
    """Whether a run's model has BatchNorm layers (the zoo's mobilenet always; cnn and others with norm batch)."""
    return config.norm == "batch" or (config.model == "mobilenet" and config.norm is None)


def _personal(run) -> str:
    """What a run kept on the devices: its --personal spec, K_P, "all" for local training, 0 for FedAvg."""
    if run.config.algorithm == "local":
        return "all"
    return run.config.personal or str(run.info.get("kp", run.config.kp))


def _p10_per_seed(per_run: list[list[float]]) -> str:
    """Each seed's 10th percentile over its clients (FedAlt's worst-off clients), in seed order."""
    return " / ".join(f"{100 * np.percentile(values, 10):.1f}" for values in per_run if values) or "-"


def _pm(values: list[float]) -> str:
    array = 100 * np.asarray(values, dtype=np.float64)
    return f"{array.mean():.1f} ± {array.std():.1f}" if len(array) else "-"


def _per_seed(per_run: list[list[float]]) -> str:
    """Each seed's mean over its clients, in seed order: whether an ordering holds on every draw."""
    return " / ".join(f"{100 * np.mean(values):.1f}" for values in per_run if values) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "setting",
        nargs="?",
        choices=[
            "persfl-mnist",
            "persfl-cifar",
            "fedper-k",
            "fedper-kp",
            "fedper-budget",
            "fedper-paper",
            "fedalt",
            "pfedla",
            "pfedla-hn",
            "pfedla-mnist",
            "fedalt-text",
            "fedalt-text-rare",
            "har",
        ],
    )
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--data-root", default="../shared/data")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--personal-lr", type=float, default=None, help="fedalt's personal phase (default: --lr)")
    parser.add_argument("--clients", type=int, default=10, help="clients (fedalt-text: the largest speaking roles)")
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--model", default="mobilenet", help="fedper-k, fedper-kp, fedalt: the model (reduced: cnn)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="where the torch engine computes: cpu, cuda, cuda:N")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--only", nargs="+", help="run only the runs whose label contains one of these, e.g. k4/")
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
