"""Bytes up per round for each upload encoding, as a fraction of FedAvg's fp32 whole-model upload; with
`--accuracy`, FedPer's last-round accuracy per encoding; with `--dp`, accuracy vs epsilon for DP-FedPer.

Bytes: every row is a real payload: a seeded random base delta of the model's base tensors (FedPer, K_P as
asked), encoded by edgepfl.encoding and serialised with the upload metadata, exactly as a device would send it.
FedAvg's reference is the fp32 payload of every parameter (base + personal), as in bench/export.py.

Accuracy (`--accuracy`): `edgepfl simulate` runs of FedPer (mlp, kp=1) on MNIST from --data-root, one per
encoding (fp32, fp16, int8) and seed, through the served round engine (the server decodes every upload);
`--datasets mnist cifar10` adds the `cnn` on CIFAR-10. Each row: the mean test accuracy across clients after the
last round and the bytes uploaded per round. The runs are reduced to fit a small machine (the JSON's `scale`).

DP (`--dp`): DP-FedPer on MNIST for a few noise multipliers (clip norm --dp-clip, a fraction of the clients
sampled per round), and the same run without DP: last-round accuracy and the epsilon spent at delta 1e-5.
A PNG (accuracy vs epsilon) goes to bench/figures/uploads-dp-mnist.png.

Prints JSON on stdout and tables on stderr.
Usage: python bench/uploads.py [--manifest BUNDLE_DIR] [--kp 2] [--width 1.0]
       python bench/uploads.py --accuracy [--datasets mnist cifar10] [--dp] [--data-root ../shared/data] [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from edgepfl.encoding import Encoding, encode_delta
from edgepfl.manifest import TensorSpec, load_manifest
from edgepfl.protocol import UploadMeta

LABELS = ("fp32", "fp16", "int8", "int8-block256", "int8-block64", "int8-block256-sr")
TARGET = 0.25  # issue 16: uploads at a quarter of FedAvg's bytes or less


def model_specs(width: float, kp: int) -> tuple[list[TensorSpec], str]:
    """MobileNet's tensor specs split at K_P (the export's own split; builds the torch model, exports nothing)."""
    from edgepfl.export.models import ModelSpec, build_model
    from edgepfl.manifest import split_roles

    model = build_model(ModelSpec(name="mobilenet", width=width))
    params, buffers = model.state_tensors()
    return split_roles(params, buffers, len(model.block_modules), kp), f"mobilenet x{width} kp={kp}"


def upload_bytes(specs: list[TensorSpec], label: str, seed: int = 0) -> int:
    """Size of one upload payload (tensors, scales and header) of a seeded random delta of `specs`."""
    rng = np.random.default_rng(seed)
    delta = {spec.name: rng.normal(0, 1e-3, spec.shape).astype(np.float32) for spec in specs}
    meta = UploadMeta(base_layout_hash="0" * 64, num_samples=1000, train_loss=0.5, val_accuracy=0.5, val_loss=0.5)
    encoding = Encoding.parse(label)
    encoded = encode_delta(delta, encoding, np.random.default_rng(seed) if encoding.stochastic else None)
    return len(encoded.to_bytes(meta.to_metadata()))


def measure(specs: list[TensorSpec]) -> dict:
    """FedAvg's fp32 payload and, per encoding, FedPer's upload payload and its fraction of FedAvg's.

    BatchNorm statistics stay on the device (the default, as in FedBN), so neither side sends them.
    """
    params = [spec for spec in specs if spec.role in ("base", "personal")]
    shared = [spec for spec in specs if spec.role == "base"]
    fedavg = upload_bytes(params, "fp32")
    rows = []
    for label in LABELS:
        size = upload_bytes(shared, label)
        rows.append(
            {
                "encoding": label,
                "upload_bytes": size,
                "vs_fedavg_fp32": round(size / fedavg, 4),
                "meets_target": size / fedavg <= TARGET,
            }
        )
    return {"fedavg_fp32_bytes": fedavg, "shared_tensors": len(shared), "rows": rows}


ACCURACY_ENCODINGS = ("fp32", "fp16", "int8")
DP_SIGMAS = (0.3, 0.5, 1.0, 2.0, 4.0)
FIGURE = Path(__file__).parent / "figures" / "uploads-dp-mnist.png"


def simulate(out: Path, **fields) -> dict:
    """One `edgepfl simulate` run into `out` (resumed if it is there): last-round accuracy, bytes up, epsilon."""
    from edgepfl.simulate.config import SimulateConfig
    from edgepfl.simulate.loop import run_simulation

    results = run_simulation(SimulateConfig(out=str(out), **fields))
    last = results.rounds[-1]
    return {
        "rounds": last.round,
        "test_accuracy": round(last.test_accuracy["mean"], 4),
        "bytes_up_per_round": round(sum(r.bytes_up for r in results.rounds) / len(results.rounds)),
        "epsilon": None if last.epsilon is None else round(last.epsilon, 3),
        "stopped": results.stopped,
    }


def accuracy_rows(args: argparse.Namespace) -> list[dict]:
    """FedPer's last-round accuracy for each encoding and seed (MNIST mlp, CIFAR-10 cnn: --datasets)."""
    rows = []
    for dataset, model in (setup for setup in (("mnist", "mlp"), ("cifar10", "cnn")) if setup[0] in args.datasets):
        for seed in args.seeds:
            for label in ACCURACY_ENCODINGS:
                fields = dict(
                    args.scale,
                    dataset=dataset,
                    model=model,
                    kp=1,
                    algorithm="fedper",
                    seed=seed,
                    data_root=args.data_root,
                    upload_encoding=label,
                )
                row = simulate(Path(args.work) / f"{dataset}-{model}-{label}-s{seed}", **fields)
                rows.append({"dataset": dataset, "model": model, "encoding": label, "seed": seed, **row})
                print(f"{dataset} {model} {label} seed {seed}: {row}", file=sys.stderr)
    return rows


def accuracy_summary(rows: list[dict]) -> list[dict]:
    """Per dataset and encoding: mean last-round accuracy over the seeds, its difference to fp32 in points, and
    the bytes up per round as a fraction of fp32's (target: int8 within 0.5 points of fp32)."""
    summary = []
    for dataset in dict.fromkeys(row["dataset"] for row in rows):
        by_encoding = {
            label: [row for row in rows if row["dataset"] == dataset and row["encoding"] == label]
            for label in ACCURACY_ENCODINGS
        }
        mean = {label: float(np.mean([r["test_accuracy"] for r in found])) for label, found in by_encoding.items()}
        size = {label: float(np.mean([r["bytes_up_per_round"] for r in found])) for label, found in by_encoding.items()}
        for label in ACCURACY_ENCODINGS:
            summary.append(
                {
                    "dataset": dataset,
                    "encoding": label,
                    "seeds": len(by_encoding[label]),
                    "mean_test_accuracy": round(mean[label], 4),
                    "points_vs_fp32": round(100 * (mean[label] - mean["fp32"]), 2),
                    "bytes_vs_fp32": round(size[label] / size["fp32"], 4),
                }
            )
    return summary


def dp_rows(args: argparse.Namespace) -> list[dict]:
    """DP-FedPer on MNIST (mlp) for each noise multiplier, and without DP: accuracy and epsilon."""
    rows = []
    for sigma in (None, *DP_SIGMAS):
        dp = {} if sigma is None else {"dp_noise_multiplier": sigma, "dp_clip": args.dp_clip}
        fields = dict(
            args.scale,
            dataset="mnist",
            model="mlp",
            kp=1,
            algorithm="fedper",
            seed=args.seeds[0],
            data_root=args.data_root,
            clients=args.dp_clients,
            fraction=args.dp_fraction,
            **dp,
        )
        row = simulate(Path(args.work) / f"dp-mnist-sigma{sigma}", **fields)
        rows.append({"noise_multiplier": sigma, "clip": args.dp_clip if sigma else None, **row})
        print(f"DP sigma {sigma}: {row}", file=sys.stderr)
    return rows


def plot_dp(rows: list[dict], path: Path, setup: str = "") -> Path:
    """Accuracy vs epsilon (log scale) of the DP runs, the run without DP as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4), dpi=120)
    private = [row for row in rows if row["epsilon"] is not None]
    axes.plot([row["epsilon"] for row in private], [100 * row["test_accuracy"] for row in private], "o-")
    for row in private:
        axes.annotate(
            f"σ={row['noise_multiplier']:g}",
            (row["epsilon"], 100 * row["test_accuracy"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    baseline = next((row for row in rows if row["epsilon"] is None), None)
    if baseline is not None:
        axes.axhline(100 * baseline["test_accuracy"], linestyle="--", color="grey", label="no DP")
        axes.legend()
    axes.set_xscale("log")
    axes.set_xlabel("ε at δ = 1e-5 after the last round (user level)")
    axes.set_ylabel("mean test accuracy, last round (%)")
    axes.set_title(f"DP-FedPer on MNIST (mlp, kp=1){setup}", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", help="a bundle folder whose manifest.json gives the tensors (else: build)")
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--kp", type=int, default=2)
    parser.add_argument("--accuracy", action="store_true", help="FedPer accuracy per encoding (simulated runs)")
    parser.add_argument(
        "--datasets",
        nargs="+",
        choices=("mnist", "cifar10"),
        default=["mnist"],
        help="with --accuracy: MNIST (mlp) and/or CIFAR-10 (cnn) rows",
    )
    parser.add_argument("--dp", action="store_true", help="accuracy vs epsilon of DP-FedPer on MNIST, and a PNG")
    parser.add_argument("--data-root", default="../shared/data")
    parser.add_argument("--work", default="runs/bench-uploads", help="run folders (a rerun resumes them)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--dp-clip", type=float, default=0.5)
    parser.add_argument("--dp-clients", type=int, default=50)
    parser.add_argument("--dp-fraction", type=float, default=0.2)
    args = parser.parse_args()
    if args.accuracy or args.dp:
        args.scale = dict(
            rounds=args.rounds,
            clients=args.clients,
            epochs=1,
            batch_size=32,
            lr=0.05,
            partition="classes:4",
            engine="torch",
            threads=2,
        )
        result: dict = {"scale": args.scale}
        if args.accuracy:
            result["accuracy"] = accuracy_rows(args)
            result["accuracy_summary"] = accuracy_summary(result["accuracy"])
        if args.dp:
            result["dp"] = dp_rows(args)
            sampled = round(args.dp_fraction * args.dp_clients)
            setup = f"\n{sampled} of {args.dp_clients} clients a round, C = {args.dp_clip:g}, {args.rounds} rounds"
            result["dp_figure"] = str(plot_dp(result["dp"], FIGURE, setup))
        print(json.dumps(result, indent=2))
        return
    if args.manifest:
        manifest = load_manifest(args.manifest)
        specs, model = list(manifest.tensors), f"{manifest.model.get('name')} kp={manifest.kp} (manifest)"
    else:
        specs, model = model_specs(args.width, args.kp)
    result = {"model": model, "target": TARGET, **measure(specs)}
    print(json.dumps(result, indent=2))
    print(f"{model}: FedAvg fp32 upload {result['fedavg_fp32_bytes'] / 2**20:.2f} MiB", file=sys.stderr)
    print(f"{'encoding':>18}  {'MiB up':>8}  {'of FedAvg':>9}", file=sys.stderr)
    for row in result["rows"]:
        size, share = row["upload_bytes"] / 2**20, row["vs_fedavg_fp32"]
        print(f"{row['encoding']:>18}  {size:8.3f}  {share:9.1%}", file=sys.stderr)


if __name__ == "__main__":
    main()
