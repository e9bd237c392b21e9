"""Issue 18's evidence, printed from run folders of `edgepfl simulate` (bench/results/NOTES-issue18.md quotes it).

show RUN...              per round: mean and worst client of the held score (and of the trained score where
                         the run has it); the last round's per-client held scores; pFedLA's self-weights α_ii
alpha-start RUN COMMIT   pFedLA self-weights at the start (the hypernetwork init of git COMMIT, the run's seeds)
                         against the run's α after its last round
bn RUN [N]               FedPer with BatchNorm, offline on the run's saved state (its last round): the trained
                         model, the held model, and the held model with its BatchNorm statistics re-estimated
                         under the new base, with its own BatchNorm affine parameters, or with averaged statistics
                         (only the first N clients when N is given)
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def show(runs: list[str]) -> None:
    """Held (and trained) accuracy per round, per-client held scores and self-weights."""
    for run in runs:
        results = json.loads((Path(run) / "results.json").read_text())
        print(run)
        if not results["rounds"]:
            print("  no round completed yet")
            continue
        for record in results["rounds"]:
            held, trained = record["test_accuracy"], record.get("trained_test_accuracy") or {}
            extra = (
                f" trained {trained['mean']:.4f} min {trained['min']:.4f}" if trained.get("mean") is not None else ""
            )
            print(f" r{record['round']:>2} held {held['mean']:.4f} min {held['min']:.4f}{extra}")
        print("  last round, per client (held):", np.round(results["rounds"][-1]["test_accuracy"]["per_client"], 3))
        for name, matrix in (results.get("alpha") or {}).items():
            alpha = np.asarray(matrix)
            print(f"  alpha {name} diag {alpha.diagonal().round(3)} min {alpha.min():.3f}")


def alpha_start(run: str, commit: str) -> None:
    """Self-weights at the start (init of `commit`) against the run's α after its last round."""
    source = subprocess.run(
        ["git", "show", f"{commit}:server/strategies/pfedla.py"], capture_output=True, text=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "pfedla_at_commit.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("pfedla_at_commit", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    results = json.loads((Path(run) / "results.json").read_text())
    names, seed = list(results["alpha"]), results["config"]["seed"]
    n = len(results["alpha"][names[0]])
    for name in names:
        nets = [module.make_hypernetwork(names, n, seed * 100_003 + slot) for slot in range(n)]
        start = np.stack([net(slot)[name].detach().double().numpy() for slot, net in enumerate(nets)])
        final = np.asarray(results["alpha"][name])
        print(
            f"{name:<18} clients with α_ii = 0: at start {int((start.diagonal() == 0).sum())}, after round "
            f"{len(results['rounds'])} {int((final.diagonal() == 0).sum())}; zero entries at start "
            f"{int((start == 0).sum())}/{n * n}; largest |Δα| over the run {np.abs(final - start).max():.3f}"
        )


def batchnorm(run: str, limit: str | None = None) -> None:
    """Which part of FedPer's held model costs accuracy, on the run's saved state."""
    import torch

    from edgepfl.datasets.images import load_dataset
    from edgepfl.datasets.partition import make_partition
    from edgepfl.device_runtime.evaluation import evaluate, score
    from edgepfl.manifest import load_manifest
    from edgepfl.simulate.bundle import open_sim_engine
    from edgepfl.simulate.loop import RESIDUALS_DIR, STATE_FILE, _make_client
    from edgepfl.simulate.results import load_results
    from edgepfl.wire import decode_tensors

    out = Path(run)
    config = load_results(out).config
    data = config.data
    dataset = load_dataset(data.dataset, data.data_root)
    parts = make_partition(data.partition, dataset.y_train, dataset.y_test, data.clients, config.seed, data.split)
    manifest = load_manifest(out / "bundle")
    engine = open_sim_engine("torch", out / "bundle", manifest, 2)
    payload = (out / STATE_FILE).read_bytes()
    state = decode_tensors(payload)
    shared = {k.removeprefix("global/"): v for k, v in state.items() if k.startswith("global/")}
    statistics = [n for n in manifest.names("buffer") if not n.endswith("num_batches_tracked")]
    layers = {n.rsplit(".", 1)[0] for n in statistics}
    affine = {n for n in shared if n.rsplit(".", 1)[0] in layers}
    initial = engine.get_tensors()
    residuals = out / RESIDUALS_DIR
    clients = [
        _make_client(i, part, dataset, manifest, config.seed, initial, residuals) for i, part in enumerate(parts)
    ]
    own = {
        c.name: {k.removeprefix(f"{c.name}/"): v for k, v in state.items() if k.startswith(f"{c.name}/")}
        for c in clients
    }
    averaged = {n: np.mean([own[c.name][n] for c in clients], axis=0) for n in statistics}
    rows: dict[str, list[float]] = {
        k: [] for k in ("trained", "held", "held, statistics re-estimated", "held, own BN affine", "held, mean stats")
    }
    for client in clients[: int(limit)] if limit else clients:
        mine = own[client.name]
        rows["trained"].append(score(engine, client.test, mine).accuracy)
        rows["held"].append(score(engine, client.test, mine, shared).accuracy)
        kept = {k: v for k, v in shared.items() if k not in affine}
        rows["held, own BN affine"].append(score(engine, client.test, mine, kept).accuracy)
        rows["held, mean stats"].append(score(engine, client.test, mine, {**shared, **averaged}).accuracy)
        score(engine, client.test, mine, shared)  # the engine holds the held model: re-estimate its statistics
        norms = [m for m in engine.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        for module in norms:
            module.reset_running_stats()
            module.momentum = None  # a plain average over one pass of the client's training data
        engine.model.train()
        with torch.no_grad():
            for x, _ in client.train.train_batches(config.round.batch_size, 0, 0):
                engine.model(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
        for module in norms:
            module.momentum = 0.1
        rows["held, statistics re-estimated"].append(evaluate(engine, client.test).accuracy)
    from edgepfl.wire import decode_metadata

    print(
        f"{out}: round {decode_metadata(payload)['round']}, {config.algorithm}, kp {manifest.kp}, "
        f"{len(affine)} BN affine tensors in the shared base"
    )
    for key, values in rows.items():
        print(f"  {key:<31} mean {np.mean(values):.4f} min {np.min(values):.4f}  {np.round(values, 3).tolist()}")


def main() -> None:
    command, *args = sys.argv[1:] or ["--help"]
    if command == "show":
        show(args)
    elif command == "alpha-start":
        alpha_start(*args)
    elif command == "bn":
        batchnorm(*args)
    else:
        print(__doc__)


if __name__ == "__main__":
    main()
