"""Bytes up per round for each upload encoding, as a fraction of FedAvg's fp32 whole-model upload.

Every row is a real payload: a seeded random base delta of the model's base tensors (FedPer, K_P as asked),
encoded by edgepfl.encoding and serialised with the upload metadata, exactly as a device would send it.
FedAvg's reference is the fp32 payload of every parameter (base + personal), as in bench/export.py.

Not here yet (issue 16's second and third parts): last-round accuracy of FedPer on MNIST (mlp) and CIFAR-10
(cnn) with fp32 vs fp16 vs int8, and accuracy vs epsilon for DP-FedPer. Both need the simulator to run the
encodings and DP (`edgepfl simulate --upload-encoding ... --dp-*`), which lands with the round-engine rewrite
(issue 13); they are left out rather than estimated.

Prints JSON on stdout and a table on stderr.
Usage: python bench/uploads.py [--manifest BUNDLE_DIR] [--kp 2] [--width 1.0]
"""

from __future__ import annotations

import argparse
import json
import sys

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
        rows.append({"encoding": label, "upload_bytes": size, "vs_fedavg_fp32": round(size / fedavg, 4),
                     "meets_target": size / fedavg <= TARGET})
    return {"fedavg_fp32_bytes": fedavg, "shared_tensors": len(shared), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", help="a bundle folder whose manifest.json gives the tensors (else: build)")
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--kp", type=int, default=2)
    args = parser.parse_args()
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
