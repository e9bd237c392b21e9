"""Each personalized run against FedAvg, client by client: over the last rounds and at each device's own best round.

A run's last round alone swings with the global model (up to 3 points between rounds on text at lr 0.5), and a mean
over clients hides whether a method helps most clients or a few. So, per client (a role, a subject):

- its *last rounds*: the mean of its held test accuracy over the last LAST_ROUNDS rounds;
- its *own pick*: its held test accuracy at the round whose model scored best on its own validation split (the
  earliest such round), which a device can do alone by keeping the model that validated best (early stopping of
  what it holds, personal part and base together; the test split never chooses);
- the *paired difference* from FedAvg on the same client and seed, averaged over the seeds, with a 95 % bootstrap
  interval over the clients (RESAMPLES resamples, seeded) and the number of clients above FedAvg.

`bench/reproduce.py --report` writes these tables for the settings whose runs differ by what is personal
(PAIRED_SETTINGS); the numbers come from the results.json files only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

LAST_ROUNDS = 10
RESAMPLES = 10_000
BASELINE = "fedavg"


def last_rounds(run, scores: str = "test_accuracy", last: int = LAST_ROUNDS) -> np.ndarray:
    """Per client, the mean of `scores` (a RoundRecord field) over the run's last `last` rounds; NaN where a client
    has none there (an unsampled client's trained score)."""
    table = np.array([_per_client(r, scores) for r in run.rounds[-last:]], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        counted = np.isfinite(table).sum(axis=0)
        return np.where(counted > 0, np.nansum(table, axis=0) / np.maximum(counted, 1), np.nan)


def own_pick(run) -> np.ndarray:
    """Per client, its held test accuracy at the (earliest) round where its own validation accuracy was highest."""
    val = np.array([_per_client(r, "val_accuracy") for r in run.rounds], dtype=np.float64)
    test = np.array([_per_client(r, "test_accuracy") for r in run.rounds], dtype=np.float64)
    picked = np.argmax(np.where(np.isfinite(val), val, -np.inf), axis=0)
    return test[picked, np.arange(test.shape[1])]


def paired(method: list[np.ndarray], baseline: list[np.ndarray], seed: int = 0) -> dict:
    """Per-seed per-client scores of a method and of the baseline (same clients, same seeds): the mean difference over
    clients (each client's difference averaged over its seeds), its 95 % bootstrap interval over clients, how many
    clients are above and below, and each seed's mean difference (the interval is over clients within these runs:
    how much a run as a whole moves shows between its seeds)."""
    by_seed = np.array(method) - np.array(baseline)  # seeds x clients
    diff = np.nanmean(by_seed, axis=0)
    diff = diff[np.isfinite(diff)]
    rng = np.random.default_rng(seed)
    means = rng.choice(diff, size=(RESAMPLES, diff.size), replace=True).mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {
        "mean": float(diff.mean()),
        "seeds": [float(v) for v in np.nanmean(by_seed, axis=1)],
        "low": float(low),
        "high": float(high),
        "above": int((diff > 0).sum()),
        "below": int((diff < 0).sum()),
        "clients": int(diff.size),
        "per_client": diff,
    }


def table(setting: str, labels: list[str], groups: dict[str, list], finetuned: str | None = None) -> list[str]:
    """The markdown section of one setting: a row per run (and FedAvg + fine-tuning where `finetuned` names its row),
    each against the setting's FedAvg run, on the runs whose clients are FedAvg's; empty without one FedAvg run."""
    rows = _rows(labels, groups, finetuned)
    baseline = _baseline(setting, labels)
    if baseline is None or not rows:
        return []
    base_runs = groups[baseline]
    lines = [
        f"### {setting}: client by client, against FedAvg",
        "",
        f"Each client's mean over the last {LAST_ROUNDS} rounds, and its score at the round its own validation split "
        "picked (a device keeping the model that validated best); against FedAvg: the mean over clients of each "
        "client's difference (averaged over the seeds both runs have), its 95 % bootstrap interval over the clients, "
        "each seed's mean difference (the interval leaves out how much a whole run moves; the seeds show it), and the "
        "clients above and below FedAvg (bench/paired.py). FedAvg + fine-tuning has no validation score per round, so "
        "no pick.",
        "",
        f"| run | last {LAST_ROUNDS} rounds, mean per seed | 10th percentile per seed | against FedAvg, last "
        f"{LAST_ROUNDS} rounds | own pick, mean per seed | against FedAvg, own pick |",
        "|---|---|---|---|---|---|",
    ]
    for label, runs, scores in rows:
        if _clients(runs) != _clients(base_runs):
            continue  # other clients (another --clients): nothing to pair
        last = [last_rounds(r, scores) for r in runs]
        versus = "" if label == baseline else _difference(against(runs, base_runs, last_rounds, scores))
        if scores == "test_accuracy":
            pick_cell = _seeds([own_pick(r) for r in runs])
            pick_versus = "" if label == baseline else _difference(against(runs, base_runs, own_pick))
        else:
            pick_cell = pick_versus = "-"
        lines.append(
            f"| {label} | {_seeds(last)} | {_seeds(last, np.nanpercentile, 10)} | {versus} | {pick_cell} | "
            f"{pick_versus} |"
        )
    return [*lines, ""]


def plot(setting: str, labels: list[str], groups: dict[str, list], path: Path, finetuned: str | None = None) -> bool:
    """Write each client's difference from FedAvg (a dot per client; in red the mean and its interval), over the last
    rounds and at each device's own pick, to `path`; False when there is nothing to compare."""
    baseline = _baseline(setting, labels)
    rows = [row for row in _rows(labels, groups, finetuned) if row[0] != baseline]
    if baseline is None or not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = groups[baseline]
    figure, panels = plt.subplots(1, 2, sharey=True, figsize=(10, 0.42 * len(rows) + 1.5), dpi=120)
    for panel, (score, title) in zip(panels, ((last_rounds, f"the last {LAST_ROUNDS} rounds"), (own_pick, "own pick"))):
        for y, (_, runs, scores) in enumerate(rows):
            if score is own_pick and scores != "test_accuracy":
                continue  # no validation score per round to pick by
            result = against(runs, base, score, scores)
            points = 100 * result["per_client"]
            panel.scatter(points, y + np.random.default_rng(y).uniform(-0.15, 0.15, points.size), s=9, color="#90a4ae")
            error = [[100 * (result["mean"] - result["low"])], [100 * (result["high"] - result["mean"])]]
            panel.errorbar(100 * result["mean"], y, xerr=error, fmt="o", color="#c62828", capsize=3, zorder=3)
        panel.axvline(0, color="black", linewidth=0.8)
        panel.set(xlabel="points above FedAvg (each client, mean over seeds)", title=title)
    panels[0].set_yticks(range(len(rows)), [label.split("/", 1)[1] for label, _, _ in rows])
    panels[0].invert_yaxis()
    figure.suptitle(f"{setting}: every client against FedAvg (red: the mean and its 95 % interval)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return True


def against(runs: list, base_runs: list, score, scores: str = "test_accuracy") -> dict:
    """`paired` of the runs' per-client `score` (last_rounds or own_pick; `scores`: which of a run's scores
    last_rounds reads) against the baseline runs', on the seeds both have."""
    base = {r.config.seed: r for r in base_runs}
    common = [r for r in runs if r.config.seed in base]
    method = [score(r, scores) if score is last_rounds else score(r) for r in common]
    return paired(method, [score(base[r.config.seed]) for r in common])


def _rows(labels: list[str], groups: dict[str, list], finetuned: str | None) -> list[tuple[str, list, str]]:
    """(label, runs, which per-client scores): every run's held scores, and FedAvg's trained ones as `finetuned`."""
    rows = []
    for label in labels:
        runs = groups[label]
        if runs[0].persfl is not None or not all(len(r.rounds) >= LAST_ROUNDS for r in runs):
            continue
        rows.append((label, runs, "test_accuracy"))
        trained = all(r.rounds[-1].trained_test_accuracy for r in runs)
        if finetuned and label.endswith("/" + BASELINE) and trained:
            rows.append((label.rsplit("/", 1)[0] + "/" + finetuned, runs, "trained_test_accuracy"))
    return rows


def _baseline(setting: str, labels: list[str]) -> str | None:
    """The FedAvg run the others are held against: the setting's only FedAvg run (its part `none` on text)."""
    found = [label for label in labels if label.split("/")[-1] == BASELINE]
    return found[0] if len(found) == 1 else None


def _clients(runs: list) -> set:
    """The runs' clients by name (by their count where a run does not name them): one entry when every seed has
    the same."""
    return {tuple(r.info.get("client_names") or [len(r.rounds[-1].test_accuracy["per_client"])]) for r in runs}


def _per_client(record, scores: str) -> list[float]:
    values = (getattr(record, scores) or {}).get("per_client") or []
    return [np.nan if v is None else v for v in values]


def _seeds(per_seed: list[np.ndarray], over=np.nanmean, *args) -> str:
    return " / ".join(f"{100 * over(values, *args):.1f}" for values in per_seed)


def _difference(result: dict) -> str:
    return (
        f"{100 * result['mean']:+.1f} [{100 * result['low']:+.1f}, {100 * result['high']:+.1f}] "
        f"(seeds {' / '.join(f'{100 * v:+.1f}' for v in result['seeds'])}), "
        f"{result['above']} above and {result['below']} below of {result['clients']}"
    )
