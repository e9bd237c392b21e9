"""Export time and bundle size per model: the zoo, and torchvision's tested families (10-class head, 32x32);
base vs personal bytes for mobilenet x1.0 at K_P=0..4.

Prints JSON on stdout and a table on stderr, and writes bench/out/export.png.
Usage: python bench/export.py [--quick] [--families LIST] [--no-zoo]
  --quick: mobilenet x0.25 and mlp only; --families: comma list of torchvision names ("" for none)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from edgepfl.export.bundle import ExportOptions, export_bundle
from edgepfl.export.models import ModelSpec, default_spec
from edgepfl.export.source import TORCHVISION_TESTED
from edgepfl.export.summary import summarize

OUT = Path(__file__).resolve().parent / "out"
FAMILY_SHAPE = (3, 32, 32)


def bundle_bytes(folder: Path) -> dict[str, int]:
    """Bytes on disk per top-level entry of a bundle (and in total)."""
    sizes: dict[str, int] = {}
    for path in folder.rglob("*"):
        if path.is_file():
            top = path.relative_to(folder).parts[0]
            sizes[top] = sizes.get(top, 0) + path.stat().st_size
    sizes["total"] = sum(sizes.values())
    return sizes


def measure_exports(specs: list[tuple[str, ModelSpec | str]], kp: int) -> list[dict]:
    """Time one export per zoo spec or MODEL string (built at 3x32x32, 10 classes) and record its bundle size."""
    from edgepfl.export import source

    rows = []
    for label, spec in specs:
        print(f"exporting {label} ...", file=sys.stderr)
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            if isinstance(spec, ModelSpec):
                manifest = export_bundle(spec, kp, Path(tmp) / "bundle", ExportOptions())
            else:
                loaded = source.build_from_string(source.parse_model(spec), FAMILY_SHAPE, None, 10)
                manifest = export_bundle(
                    loaded.module, kp, Path(tmp) / "bundle", input_shape=FAMILY_SHAPE, description=loaded.description
                )
            seconds = time.perf_counter() - start
            sizes = bundle_bytes(Path(tmp) / "bundle")
        rows.append(
            {
                "model": label,
                "kp": kp,
                "engines": list(manifest.engines),
                "seconds": round(seconds, 2),
                "bundle_bytes": sizes,
                "roles": summarize(manifest),
            }
        )
    return rows


def split_bytes(max_kp: int = 4) -> list[dict]:
    """Base vs personal bytes of mobilenet x1.0 for K_P = 0..max_kp: what FedPer saves on upload."""
    from edgepfl.export.models import build_model
    from edgepfl.manifest import split_roles

    model = build_model(ModelSpec(name="mobilenet", width=1.0))
    params, buffers = model.state_tensors()
    full = None
    rows = []
    for kp in range(max_kp + 1):
        specs = split_roles(params, buffers, len(model.block_modules), kp)
        base = sum(s.nbytes for s in specs if s.role == "base")
        personal = sum(s.nbytes for s in specs if s.role == "personal")
        full = full or base + personal
        rows.append(
            {"kp": kp, "base_bytes": base, "personal_bytes": personal, "upload_vs_fedavg": round(base / full, 4)}
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--families", default=",".join(TORCHVISION_TESTED))
    parser.add_argument("--no-zoo", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    specs: list[tuple[str, ModelSpec | str]] = [
        (f"mobilenet x{w}", ModelSpec(name="mobilenet", width=w)) for w in (0.25, 0.5, 0.75, 1.0)
    ]
    specs += [("cnn", default_spec("cnn")), ("mlp", default_spec("mlp")), ("resnet34", default_spec("resnet34"))]
    if args.quick:
        specs = [specs[0], specs[5]]
    if args.no_zoo:
        specs = []
    specs += [(name, f"torchvision:{name}") for name in args.families.split(",") if name]
    result = {"exports": measure_exports(specs, kp=2), "mobilenet_x1.0_split": split_bytes()}
    print(json.dumps(result, indent=2))
    for row in result["exports"]:
        print(
            f"{row['model']:>16}  {row['seconds']:7.1f} s  {row['bundle_bytes']['total'] / 2**20:8.1f} MiB",
            file=sys.stderr,
        )
    for row in result["mobilenet_x1.0_split"]:
        print(
            f"kp={row['kp']}  base {row['base_bytes'] / 2**20:6.2f} MiB  personal "
            f"{row['personal_bytes'] / 2**20:6.2f} MiB  upload = {row['upload_vs_fedavg']:.1%} of FedAvg",
            file=sys.stderr,
        )
    plot(result)


def plot(result: dict) -> None:
    """Bar charts: export time per model, upload bytes per K_P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    exports = result["exports"]
    left.barh([r["model"] for r in exports], [r["seconds"] for r in exports])
    left.set_xlabel("export time (s)")
    split = result["mobilenet_x1.0_split"]
    kps = [r["kp"] for r in split]
    right.bar(kps, [r["base_bytes"] / 2**20 for r in split], label="base (uploaded)")
    right.bar(
        kps,
        [r["personal_bytes"] / 2**20 for r in split],
        bottom=[r["base_bytes"] / 2**20 for r in split],
        label="personal (stays)",
    )
    right.set_xlabel("K_P (mobilenet x1.0)")
    right.set_ylabel("MiB")
    right.legend()
    fig.tight_layout()
    fig.savefig(OUT / "export.png", dpi=120)


if __name__ == "__main__":
    main()
