"""Issue 39's table without a browser: MobileNet steps on WebGPU (Dawn from Node), wasm and native ORT, one machine.

The page's engine (device_runtime/web/src, openEngine) runs from Node (run.mjs) on Dawn's WebGPU (npm `webgpu`,
the WebGPU implementation inside Chrome) and on onnxruntime-web's WebAssembly at 1 and N threads; the Python
portable engine (bench/engines.py's worker, native onnxruntime) runs the same steps at 2 and N threads. Images
per second of the full and personal-only steps, batch 32, 32x32x3, K_P = 2, per MobileNet width. WebGPU runs
once per --layouts value (the convolutions' activation layout in onnxruntime-web's WebGPU kernels; the page's is
NCHW), each checked against wasm by its first step's loss (a layout that computes wrong values is marked so).
Prints JSON on stdout and the markdown table on stderr, and writes a plot (--plot).
Runs in this repository (bundles exported into --bundles if missing) or in a folder pack.py wrote (copied to a
bare machine with Node 20+, Python 3 with numpy and onnxruntime, and a Vulkan driver): `python3 bench.py`.
Usage: python bench/webgpu/bench.py [--widths 0.25,1.0] [--layouts nchw,nhwc] [--steps 10] [--warmup 5] [--threads N]
    [--bundles DIR] [--vulkan-icd FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKED = (HERE / "bundles").is_dir()  # pack.py's folder: everything beside this file
REPO = None if PACKED else HERE.parents[1]
sys.path.insert(0, str(HERE if PACKED else REPO / "bench"))
if PACKED:  # engines.py's workers import edgepfl from the packed copy
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "python"), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(HERE / "python"))

from engines import host, run_worker  # noqa: E402 (after the path of the packed folder)

RUNNER = HERE / "run.mjs"
PATHS = (
    {"src": HERE / "src", "vendor": HERE / "node_modules/onnxruntime-web/dist", "timing": HERE / "timing.js"}
    if PACKED
    else {}
)
SETS = ("full", "personal")
LOSS_TOLERANCE = 1e-3  # relative: engines computing the same step agree on its first loss to float rounding


def unpack_gzipped(folder: Path) -> None:
    """pack.py gzips its largest files (the folder must stay under 60 MiB): write each one out once."""
    for packed in folder.rglob("*.gz"):
        target = packed.with_suffix("")
        if not target.exists():
            with gzip.open(packed) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)


def node_run(
    bundle: Path, backend: str, threads: int, steps: int, warmup: int, timeout: float, layout: str = "nchw"
) -> dict:
    """One run.mjs process: its JSON report, or {'error': its last line}."""
    command = ["node", str(RUNNER), "--bundle", str(bundle), "--backend", backend, "--threads", str(threads)]
    command += ["--steps", str(steps), "--warmup", str(warmup), "--layout", layout]
    for name, path in PATHS.items():
        command += [f"--{name}", str(path)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=HERE)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout:.0f} s"}
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        lines = result.stderr.strip().splitlines() or ["failed"]
        return {"error": next((line for line in lines if "Error" in line or "error:" in line), lines[-1])[:400]}
    return json.loads(lines[-1])


def webgpu_column(layout: str) -> str:
    """A WebGPU column's name: the page's layout plain, another named."""
    return "WebGPU" if layout == "nchw" else f"WebGPU {layout.upper()}"


def check_values(runs: dict, reference: str) -> None:
    """Mark each WebGPU run whose first full step's loss differs from the `reference` run's (wasm) beyond
    LOSS_TOLERANCE: `wrong_values` (its speed is not a result)."""
    expected = runs.get(reference, {}).get("fullFirstLoss")
    for column, run in runs.items():
        loss = run.get("fullFirstLoss")
        if column.startswith("WebGPU") and loss is not None and expected is not None:
            run["firstLossVsWasm"] = abs(loss - expected)
            run["wrong_values"] = abs(loss - expected) > LOSS_TOLERANCE * max(1.0, abs(expected))


def native_run(bundle: Path, threads: int, steps: int, warmup: int) -> dict:
    """The Python portable engine (engines.py's worker, a fresh process per step kind) on `threads` threads."""
    out: dict = {"threads": threads, "steps": steps, "warmup": warmup}
    for trainable in SETS:
        seconds = run_worker("portable", bundle, trainable, steps, warmup, threads)
        if isinstance(seconds, str):
            return {"error": seconds[:400]}
        out[f"{trainable}ImagesPerSecond"] = len(seconds) * 32 / sum(seconds)
    return out


def export(bundles: Path, width: float) -> Path:
    """The MobileNet x`width` bundle under `bundles` (exported here when missing; a packed folder has it)."""
    bundle = bundles / f"mobilenet-x{width}"
    if not (bundle / "manifest.json").is_file():
        if PACKED:
            sys.exit(f"error: {bundle} is missing: pack it with pack.py --widths {width}")
        command = [str(Path(sys.executable).parent / "edgepfl"), "export", "mobilenet", "--width", str(width)]
        command += ["--kp", "2", "--engines", "portable", "--out", str(bundle)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return bundle


def threaded(engine: str, threads: int) -> str:
    """A column's name: the engine and its thread count."""
    return f"{engine} {threads} thread{'s' * (threads > 1)}"


def columns(threads: int, layouts: list[str]) -> list[str]:
    """The table's columns for N = `threads` (once each: N may be 1 or 2)."""
    named = [webgpu_column(layout) for layout in layouts] + [threaded("wasm", 1), threaded("wasm", threads)]
    return list(dict.fromkeys(named + [threaded("native ORT", 2), threaded("native ORT", threads)]))


def table(report: dict) -> str:
    """Issue 39's table: images/s per MobileNet width and step kind, one column per engine."""
    names = columns(report["threads"], report["layouts"])
    lines = ["| MobileNet, step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for trainable in SETS:
        for width, runs in report["widths"].items():
            cells = []
            for column in names:
                speed = runs.get(column, {}).get(f"{trainable}ImagesPerSecond")
                cell = "–" if speed is None else f"{speed:,.1f}" if speed < 100 else f"{speed:,.0f}"
                cells.append(f"{cell} (wrong values)" if runs.get(column, {}).get("wrong_values") else cell)
            lines.append(f"| ×{width} {trainable} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Grouped bars: images/s per engine for each width and step kind (log scale: a software GPU is far below)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = columns(report["threads"], report["layouts"])
    groups = [(w, t) for t in SETS for w in report["widths"]]
    figure, axis = plt.subplots(figsize=(8, 3.8))
    bar = 0.8 / len(names)
    for index, column in enumerate(names):
        values = [report["widths"][w].get(column, {}).get(f"{t}ImagesPerSecond") or 0 for w, t in groups]
        axis.bar([g + index * bar for g in range(len(groups))], values, bar, label=column)
    axis.set_xticks([g + bar * (len(names) - 1) / 2 for g in range(len(groups))], [f"×{w} {t}" for w, t in groups])
    axis.set_yscale("log")
    axis.set_ylabel("images / s (batch 32)")
    axis.set_title(
        f"WebGPU adapter: {report['adapter']}; {report['host']['cpu']}, {report['host']['cores']} CPUs", fontsize=8
    )
    axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    """Run every column for every width; print the JSON report and the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="0.25,1.0", help="comma list of MobileNet widths")
    parser.add_argument("--layouts", default="nchw,nhwc", help="comma list of the WebGPU runs' layouts (nchw, nhwc)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per step kind")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (the first compiles shaders)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="N of the wasm and native N-thread runs")
    parser.add_argument("--bundles", type=Path, help="folder of mobilenet-xW bundles (default: the packed ones)")
    parser.add_argument("--vulkan-icd", help="a Vulkan driver's ICD json for Dawn (sets VK_ICD_FILENAMES)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds one Node run may take")
    figure = HERE / "webgpu.png" if PACKED else REPO / "bench" / "figures" / "webgpu.png"
    parser.add_argument("--plot", type=Path, default=figure, help="where the plot goes")
    args = parser.parse_args()
    if shutil.which("node") is None:
        sys.exit("error: node is not on PATH: install Node.js 20 or newer")
    widths = [float(w) for w in args.widths.split(",") if w.strip()]
    layouts = [layout.strip().lower() for layout in args.layouts.split(",") if layout.strip()]
    unknown = sorted(set(layouts) - {"nchw", "nhwc"})
    if unknown or not layouts:
        sys.exit(f"error: --layouts {args.layouts} names no layout or an unknown one: use nchw, nhwc or both")
    if args.vulkan_icd:
        os.environ["VK_ICD_FILENAMES"] = args.vulkan_icd
    if PACKED:
        unpack_gzipped(HERE)
    bundles = args.bundles or (HERE / "bundles" if PACKED else REPO / ".webgpu" / "bundles")
    started = time.time()
    report: dict = {"host": host(), "threads": args.threads, "layouts": layouts, "batch": 32, "kp": 2, "adapter": None}
    report["widths"] = {}
    report["host"]["node"] = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    report["vulkan_icd"] = os.environ.get("VK_ICD_FILENAMES")
    report["load_average_1min"] = {"start": os.getloadavg()[0]}
    for width in widths:
        bundle = export(bundles, width)
        runs = {}
        for layout in layouts:
            run = node_run(bundle, "webgpu", 1, args.steps, args.warmup, args.timeout, layout)
            runs[webgpu_column(layout)] = run
            report["adapter"] = report["adapter"] or run.get("adapter")
        for threads in sorted({1, args.threads}):
            runs[threaded("wasm", threads)] = node_run(bundle, "wasm", threads, args.steps, args.warmup, args.timeout)
        check_values(runs, threaded("wasm", 1))
        for threads in sorted({2, args.threads}):
            runs[threaded("native ORT", threads)] = native_run(bundle, threads, args.steps, args.warmup)
        report["widths"][str(width)] = runs
        print(
            f"x{width}: " + ", ".join(f"{k}: {'error' if 'error' in v else 'ok'}" for k, v in runs.items()),
            file=sys.stderr,
        )
    report["load_average_1min"]["end"] = os.getloadavg()[0]
    report["seconds"] = round(time.time() - started, 1)
    report["table"] = table(report)
    print(json.dumps(report, indent=1))
    print(report["table"], file=sys.stderr)
    plot(report, args.plot)


if __name__ == "__main__":
    main()
