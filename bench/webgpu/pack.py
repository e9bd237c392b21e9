"""Here: one folder (at most 60 MiB) with everything bench.py needs on a bare Linux machine, and print its size.

The runner (bench.py, run.mjs, the browser bench's timing.js, engines.py), the page's engine (device_runtime/web/src),
the Node modules it loads (onnxruntime-web's WebGPU and wasm builds only, npm `webgpu`'s Linux x64 Dawn, fflate),
edgepfl's Python package (for the native engine) and the MobileNet bundles (exported here when missing). Files over
1 MiB that gzip well are stored gzipped; bench.py writes them out on its first run.
Usage: python bench/webgpu/pack.py DEST [--widths 0.25,1.0] [--bundles DIR]
    (needs `npm ci` in bench/webgpu and device_runtime/web)
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
from pathlib import Path

from bench import export

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "bench" / "webgpu"
WEB = ROOT / "device_runtime" / "web"
LIMIT_MIB = 60
GZIP_ABOVE = 1 << 20
ORT_FILES = (
    "ort.webgpu.min.mjs",
    "ort-wasm-simd-threaded.asyncify.mjs",
    "ort-wasm-simd-threaded.asyncify.wasm",
    "ort.wasm.min.mjs",
    "ort-wasm-simd-threaded.mjs",
    "ort-wasm-simd-threaded.wasm",
)


def place(source: Path, target: Path) -> None:
    """Copy one file; gzipped (name + .gz) when it is over 1 MiB and gzip saves a tenth of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    data = source.read_bytes()
    if len(data) > GZIP_ABOVE:
        packed = gzip.compress(data, compresslevel=9)
        if len(packed) < 0.9 * len(data):
            target.with_name(target.name + ".gz").write_bytes(packed)
            return
    target.write_bytes(data)


def files(dest: Path, bundles: Path, widths: list[float]) -> dict[Path, Path]:
    """Every file of the folder: its place in `dest` -> its source here."""
    dawn = HERE / "node_modules" / "webgpu"
    ort = WEB / "node_modules" / "onnxruntime-web"
    out = {dest / name: HERE / name for name in ("bench.py", "run.mjs", "package.json", "package-lock.json")}
    out[dest / "timing.js"] = ROOT / "bench" / "web" / "timing.js"
    out[dest / "engines.py"] = ROOT / "bench" / "engines.py"
    out.update({dest / "src" / p.name: p for p in (WEB / "src").glob("*.js")})
    for name in ("package.json", "index.js", "dist/linux-x64/dawn.node"):
        out[dest / "node_modules/webgpu" / name] = dawn / name
    out[dest / "node_modules/onnxruntime-web/package.json"] = ort / "package.json"
    out.update({dest / "node_modules/onnxruntime-web/dist" / name: ort / "dist" / name for name in ORT_FILES})
    fflate = WEB / "node_modules" / "fflate"
    out.update({dest / "node_modules/fflate" / p.relative_to(fflate): p for p in fflate.rglob("*") if p.is_file()})
    # edgepfl as pyproject.toml lays it out (edgepfl.export is ./export, ...), without the page's web/ folder
    import tomllib  # Python 3.11+: pack runs here, not on the bare machine

    layout = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in layout.items():
        if package.count(".") > 1:
            continue  # a subpackage inside a folder copied whole
        for path in (ROOT / folder).rglob("*"):
            parts = path.relative_to(ROOT / folder).parts
            if path.is_file() and "__pycache__" not in parts and parts[0] not in ("web", "node_modules"):
                out[dest / "python" / Path(*package.split(".")) / Path(*parts)] = path
    for width in widths:
        bundle = export(bundles, width)
        for path in bundle.rglob("*"):
            if path.is_file():
                out[dest / "bundles" / bundle.name / path.relative_to(bundle)] = path
    return out


def main() -> None:
    """Write the folder and print its size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="the folder to write (replaced)")
    parser.add_argument("--widths", default="0.25,1.0", help="comma list of MobileNet widths")
    bundles = ROOT / ".webgpu" / "bundles"
    parser.add_argument("--bundles", type=Path, default=bundles, help="the bundles (exported there when missing)")
    args = parser.parse_args()
    for needed, fix in ((HERE, "bench/webgpu"), (WEB, "device_runtime/web")):
        if not (needed / "node_modules").is_dir():
            sys.exit(f"error: {needed}/node_modules is missing: run `npm ci` in {fix}")
    if args.dest.exists():
        shutil.rmtree(args.dest)
    widths = [float(w) for w in args.widths.split(",") if w.strip()]
    for target, source in files(args.dest, args.bundles, widths).items():
        place(source, target)
    size = sum(p.stat().st_size for p in args.dest.rglob("*") if p.is_file()) / 2**20
    print(f"{args.dest}: {size:.1f} MiB (limit {LIMIT_MIB} MiB)")
    if size > LIMIT_MIB:
        sys.exit(f"error: {args.dest} is {size:.1f} MiB, over {LIMIT_MIB} MiB: pack fewer --widths")


if __name__ == "__main__":
    main()
