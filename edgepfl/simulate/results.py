"""results.json of a simulated run, its summary (last and best round) and the table printed at the end.

The best round is chosen by mean *validation* accuracy (each client's own validation split), never by
the test split; its test accuracy is what is reported. Without validation data it falls back to the
last round, and says so. A next-word task's accuracy is FedAlt's: top-1, the targets its manifest's
`metric_ignores` lists (<pad>, <oov>) not counted (edgepfl.data.scored); results.json's info says which.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.atomic import write_text_atomic
from edgepfl.errors import StateError, UsageError

RESULTS_FILE = "results.json"


@dataclass(frozen=True)
class RoundRecord:
    """One completed round: accuracies across clients, loss, traffic and time."""

    round: int
    test_accuracy: dict[str, Any]  # mean, std, min, max, p10 (10th percentile), per_client
    val_accuracy: dict[str, Any]
    train_loss: float | None
    sampled: int
    bytes_up: int
    bytes_down: int
    seconds: float
    bytes_kept: int = 0  # bytes of tensors that stayed on the clients instead of travelling (HeurpFedLA), both ways
    # persfl: each sampled client's validation loss of the received global model (what chooses its teacher)
    start_val_loss: dict[str, float] | None = None
    # device_runtime/evaluation.py's *trained* score (test_accuracy is its *held* score); null for unsampled clients
    trained_test_accuracy: dict[str, Any] | None = None
    epsilon: float | None = None  # DP: epsilon spent through this round, at the run's --dp-delta
    virtual_time: float | None = None  # --fleet: the virtual clock (seconds) when the round (fedbuff: step) ended
    late_uploads: int | None = None  # --fleet: uploads refused since the last round (round closed, too stale)
    # --secure-aggregation: the round's protocol counts (devices masked, dropped, recovered; neighbours, threshold)
    secure_aggregation: dict[str, Any] | None = None


@dataclass
class Results:
    """A run: its config, the rounds done so far and facts about the run (dataset, engine, kp)."""

    config: Any  # SimulateConfig
    rounds: list[RoundRecord]
    info: dict[str, Any] = field(default_factory=dict)
    persfl: dict[str, Any] | None = None  # persfl stage 2: per-client teacher and student scores, and the means
    # pfedla, heurpfedla: {tensor name: N x N mixing weights} after the last completed round (row i: client i's α)
    alpha: dict[str, list[list[float]]] | None = None
    stopped: str | None = None  # why the run ended before --rounds (--dp-target-epsilon)

    def summary(self) -> dict[str, Any]:
        """Last round and best round (by mean validation accuracy) with their test accuracies."""
        if not self.rounds:
            return {}
        last = self.rounds[-1]
        with_val = [r for r in self.rounds if r.val_accuracy.get("mean") is not None]
        best = max(with_val, key=lambda r: (r.val_accuracy["mean"], -r.round)) if with_val else last
        pick = "highest mean validation accuracy" if with_val else "no validation data: the last round"
        summary = {
            "rounds_completed": len(self.rounds),
            "last": {"round": last.round, "test_accuracy": _brief(last.test_accuracy)},
            "best": {"round": best.round, "chosen_by": pick, "test_accuracy": _brief(best.test_accuracy)},
        }
        if last.epsilon is not None:
            summary["epsilon"] = last.epsilon
        if self.stopped is not None:
            summary["stopped"] = self.stopped
        return summary

    def to_json(self) -> dict[str, Any]:
        """The results.json document."""
        return {
            "config": self.config.to_json(),
            "info": self.info,
            "rounds": [asdict(r) for r in self.rounds],
            "summary": self.summary(),
            **({"persfl": self.persfl} if self.persfl is not None else {}),
            **({"alpha": self.alpha} if self.alpha is not None else {}),
            **({"stopped": self.stopped} if self.stopped is not None else {}),
        }


def accuracy_summary(values: list[float]) -> dict[str, Any]:
    """mean, std, min, max and the 10th percentile (FedAlt's worst-off clients) across clients (NaN-free values
    only), and the per-client list."""
    finite = [v for v in values if not math.isnan(v)]
    per_client = [None if math.isnan(v) else round(float(v), 6) for v in values]
    if not finite:
        return {"mean": None, "std": None, "min": None, "max": None, "p10": None, "per_client": per_client}
    array = np.asarray(finite, dtype=np.float64)
    return {
        "mean": float(array.mean()),
        "std": float(array.std()),
        "min": float(array.min()),
        "max": float(array.max()),
        "p10": float(np.percentile(array, 10)),  # numpy's linear interpolation between the two nearest clients
        "per_client": per_client,
    }


def write_results(out: Path, results: Results) -> None:
    """Write results.json atomically."""
    write_text_atomic(Path(out) / RESULTS_FILE, json.dumps(results.to_json(), indent=1) + "\n")


def load_results(run: str | Path) -> Results:
    """Read a run folder's results.json (or the file itself)."""
    from edgepfl.simulate.config import config_from_json

    path = Path(run)
    path = path / RESULTS_FILE if path.is_dir() else path
    if not path.is_file():
        raise UsageError(f"{path} does not exist", "pass a run folder written by edgepfl simulate")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        rounds = [RoundRecord(**r) for r in document["rounds"]]
        config = config_from_json(document["config"], origin=str(path))
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise StateError(f"{path} is not a results file of edgepfl simulate ({exc!r})", "pass another run") from None
    return Results(
        config=config,
        rounds=rounds,
        info=document.get("info", {}),
        persfl=document.get("persfl"),
        alpha=document.get("alpha"),
        stopped=document.get("stopped"),
    )


def results_table(results: Results, title: str = ""):
    """A rich Table: test accuracy mean ± std across clients at the last round and at the best round."""
    from rich.table import Table

    summary = results.summary()
    table = Table(title=title or f"{results.config.algorithm} on {results.config.data.dataset} ({results.config.out})")
    private = any(record.epsilon is not None for record in results.rounds)
    columns = ("", "round", "test accuracy (mean ± std)", "10th pct", "min", "max", *(("ε",) if private else ()))
    columns += ("chosen by",)
    for column in columns:
        table.add_column(column, justify="right" if column else "left")
    if not summary:
        return table
    by_round = {record.round: record for record in results.rounds}
    for key in ("last", "best"):
        entry = summary[key]
        acc = entry["test_accuracy"]
        chosen = entry.get("chosen_by", "the final round")
        epsilon = (_epsilon(by_round[entry["round"]].epsilon),) if private else ()
        row = (_pm(acc), _pct(acc.get("p10")), _pct(acc["min"]), _pct(acc["max"]))
        table.add_row(key, str(entry["round"]), *row, *epsilon, chosen)
    if results.persfl is not None:
        for key, chosen in (("teacher", "each client's lowest validation loss"), ("student", "best validation (λ, T)")):
            acc = results.persfl[key]["test_accuracy"]
            row = (_pm(acc), _pct(acc.get("p10")), _pct(acc["min"]), _pct(acc["max"]))
            table.add_row(f"persfl {key}", "-", *row, *(("-",) if private else ()), chosen)
    return table


def _epsilon(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _brief(accuracy: dict[str, Any]) -> dict[str, Any]:
    return {k: accuracy.get(k) for k in ("mean", "std", "min", "max", "p10")}  # results of older runs have no p10


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _pm(accuracy: dict[str, Any]) -> str:
    if accuracy["mean"] is None:
        return "-"
    return f"{100 * accuracy['mean']:.2f} ± {100 * accuracy['std']:.2f}%"
