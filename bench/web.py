"""The browser device's speed, first-load bytes and memory: MobileNet steps in headless Chromium vs native.

Serves bench/web/ (a page timing the browser engine), device_runtime/web/src, onnxruntime-web's builds and
the bundle (MobileNet x`--width`, x0.25 by default) from a static server on 127.0.0.1, and drives Debian's
chromium with Playwright: one run at 1 thread without cross-origin isolation, one with COOP/COEP and `--threads`
wasm threads, and one on the GPU (WebGPU; the adapter's name is in the report: on a machine without a GPU it
is SwiftShader, a software GPU, whose speed says nothing about a GPU's; `--no-webgpu` leaves it out). The
Python portable engine runs the same steps at 1 thread in this process, before and after the browser runs
(their mean is the native figure; the load average is reported, since a shared machine drifts).
A third run at 1 thread keeps to the plain step graphs (no frozen variants; the A/B of export/frozen.py in the
browser). First load counts what a device downloads before it can train: the runtime (ort.wasm.min.mjs, its
worker .mjs and .wasm), the engine's modules, manifest.json, the portable graphs, their frozen variants and the
initial tensors; raw and gzip (level 6), and the total with the WebGPU build's runtime instead (what a device
with a GPU downloads). The renderer's peak memory is the highest VmHWM among the browser's renderer processes.
The phone run (issue 33) opens the device page of a real `edgepfl serve` from its join link in chromium emulating
a phone (390x844, touch, CPU slowed 4 times) and times the page until its first upload is answered (it is handed
an .npz of PHONE_EXAMPLES examples as soon as it asks for them), then "Try it" on one photo: the whole answer
(decode, pre-processing, predict) and engine.predict alone, PREDICTIONS times.
Prints JSON and writes bench/figures/web.png (web-x1.0.png for another width).

Usage: python bench/web.py [--bundle DIR] [--width 0.25] [--steps 10] [--warmup 5] [--threads 2] [--no-webgpu]
    [--phone-only | --steps-only]
       --bundle DIR --steps-only times any bundle's steps, a text bundle's too (token ids drawn below its vocabulary)
       (needs chromium, playwright, npm ci)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from edgepfl.server.launch import LocalServer
from edgepfl.server.web import CHROMIUM, CHROMIUM_ARGS, CHROMIUM_WEBGPU_ARGS, PHONE_CONTEXT, PHONE_CPU_SLOWDOWN

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "device_runtime" / "web"
DIST = WEB / "node_modules" / "onnxruntime-web" / "dist"
RUNTIME = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")
WEBGPU_RUNTIME = ("ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")
ENGINE_MODULES = ("engine.js", "safetensors.js", "sha256.js")
TARGET_SPEED, TARGET_MB = 0.5, 8.0
TARGET_WEBGPU_SPEED = 2.0  # the browser's full step on a real GPU vs the native CPU portable engine
TARGET_FIRST_UPLOAD_S, TARGET_PREDICT_MS = 30.0, 100.0
PHONE_EXAMPLES = 20  # what a person adds first: above the page's minimum (10), one batch of the round's 16 to train on
PREDICTIONS = 5
SECRET = "bench-join-secret-0123456789abcdef"
SPEED_KEYS = ("fullImagesPerSecond", "personalImagesPerSecond")


class Handler(SimpleHTTPRequestHandler):
    """Static files from a fixed map of URL prefixes to folders; COOP/COEP when the server is isolated."""

    routes: dict[str, Path] = {}
    isolated = False

    def translate_path(self, path: str) -> str:
        path = path.split("?", 1)[0]
        for prefix, folder in self.routes.items():
            if path.startswith(prefix):
                target = (folder / path[len(prefix) :]).resolve()
                if target.is_relative_to(folder.resolve()):
                    return str(target)
        return str(ROOT / "nonexistent")

    def end_headers(self) -> None:
        if self.isolated:
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
            self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def guess_type(self, path):
        if str(path).endswith((".mjs", ".js")):
            return "text/javascript"
        if str(path).endswith(".wasm"):
            return "application/wasm"
        return super().guess_type(path)

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        pass


def serve(bundle: Path, isolated: bool) -> ThreadingHTTPServer:
    """A static server on a free loopback port, answering in a daemon thread."""
    routes = {"/bench/": ROOT / "bench" / "web", "/src/": WEB / "src", "/vendor/": DIST, "/bundle/": bundle}
    handler = type("BenchHandler", (Handler,), {"routes": routes, "isolated": isolated})
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(handler))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def first_load_bytes(bundle: Path) -> dict:
    """Bytes a device downloads before its first step, per part, raw and gzip-compressed."""
    from edgepfl.manifest import load_manifest

    manifest = load_manifest(bundle)
    required, variants = manifest.portable_files()
    initial = manifest.engines["portable"]["initial"]
    parts = {
        "runtime": [DIST / name for name in RUNTIME],
        "runtime_webgpu": [DIST / name for name in WEBGPU_RUNTIME],  # instead of `runtime` on a GPU
        "engine_modules": [WEB / "src" / name for name in ENGINE_MODULES],
        "graphs": [bundle / "manifest.json", *(bundle / path for path in required if path != initial)],
        "frozen_variants": [bundle / path for path in variants],
        "initial_tensors": [bundle / initial],
    }
    out = {}
    for part, files in parts.items():
        data = [path.read_bytes() for path in files]
        out[part] = {"raw": sum(map(len, data)), "gzip": sum(len(gzip.compress(d, compresslevel=6)) for d in data)}
    wasm = [part for name, part in out.items() if name != "runtime_webgpu"]
    out["total"] = {kind: sum(part[kind] for part in wasm) for kind in ("raw", "gzip")}
    gpu = out["runtime_webgpu"]
    out["total_webgpu"] = {kind: out["total"][kind] - out["runtime"][kind] + gpu[kind] for kind in ("raw", "gzip")}
    return out


def renderer_peak_mib(ancestor: int) -> float | None:
    """Highest VmHWM (peak resident set) among the chromium renderer processes below process `ancestor`."""
    peak = None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
            status = (proc / "status").read_text()
        except OSError:
            continue
        if b"--type=renderer" not in cmdline or not _descends_from(int(proc.name), ancestor):
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peak = max(peak or 0.0, int(line.split()[1]) / 1024)
    return peak


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def browser_run(
    bundle: Path, threads: int, isolated: bool, steps: int, warmup: int, bake: bool = True, backend: str = "wasm"
) -> dict:
    """One bench page in a fresh headless chromium; returns its timings and the renderer's peak memory.
    `bake`: the engine runs the steps' frozen variants (from the third step on the same frozen tensors).
    `backend` 'webgpu': on the GPU, in a chromium with a WebGPU adapter."""
    from playwright.sync_api import sync_playwright

    server = serve(bundle, isolated)
    try:
        with sync_playwright() as playwright:
            args = CHROMIUM_WEBGPU_ARGS if backend == "webgpu" else CHROMIUM_ARGS
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=list(args))
            try:
                page = browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                port = server.server_address[1]
                query = f"threads={threads}&steps={steps}&warmup={warmup}&bake={int(bake)}&backend={backend}"
                page.goto(f"http://127.0.0.1:{port}/bench/index.html?{query}")
                page.wait_for_function("window.benchResult !== undefined", timeout=600_000, polling=500)
                result = page.evaluate("window.benchResult")
                if "error" in result or errors:
                    raise RuntimeError(f"the bench page failed: {result.get('error') or errors[0]}")
                result["renderer_peak_mib"] = renderer_peak_mib(os.getpid())
                return result
            finally:
                browser.close()
    finally:
        server.shutdown()


def native_run(bundle: Path, steps: int, warmup: int) -> dict:
    """The Python portable engine at 1 thread on the same steps: images per second per trainable set."""
    from edgepfl.device_runtime.portable_engine import PortableEngine
    from edgepfl.manifest import load_manifest

    manifest = load_manifest(bundle)
    engine = PortableEngine(bundle, manifest, threads=1)
    rng = np.random.default_rng(0)
    shape = (engine.batch_size, *manifest.input.shape)
    if manifest.input.dtype == "int64":  # a text bundle: token ids below the vocabulary's size
        x = rng.integers(0, manifest.num_classes, shape)
    else:
        x = rng.uniform(-1, 1, shape).astype(np.float32)
    # one label a sample, or a next-word sample's target at every position
    y = rng.integers(0, manifest.num_classes, (engine.batch_size, *manifest.kind.target_shape))
    result = {"threads": 1, "steps": steps, "warmup": warmup, "batchSize": engine.batch_size}
    for trainable in ("full", "personal"):
        for _ in range(warmup):
            engine.train_step(x, y, 0.01, trainable)
        started = time.perf_counter()
        for _ in range(steps):
            engine.train_step(x, y, 0.01, trainable)
        result[f"{trainable}ImagesPerSecond"] = steps * engine.batch_size / (time.perf_counter() - started)
    return result


def phone_run(bundle: Path, folder: Path) -> dict:
    """The device page of `edgepfl serve` on an emulated phone: seconds from opening the join link to the first
    upload's answer (and to the examples being asked for), then "Try it" on one photo, in milliseconds."""
    from PIL import Image
    from playwright.sync_api import sync_playwright

    from edgepfl.manifest import load_manifest

    manifest = load_manifest(bundle)
    channels, height, width = manifest.input.shape
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (PHONE_EXAMPLES, height, width, channels), dtype=np.uint8)
    np.savez(folder / "phone.npz", x=images, y=np.arange(PHONE_EXAMPLES) % manifest.num_classes)
    photo = folder / "photo.png"
    Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(photo)  # a photo, resized by the page
    (folder / "secret").write_text(SECRET)
    options = ("--min-clients", "1", "--rounds", "2", "--epochs", "1", "--batch-size", "16", "--poll-interval", "0.3")
    options += ("--enroll-secret-file", str(folder / "secret"))
    with LocalServer(bundle, folder / "state", *options, log=folder / "server.log") as server:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=list(CHROMIUM_ARGS))
            try:
                page = browser.new_context(**PHONE_CONTEXT).new_page()
                devtools = page.context.new_cdp_session(page)
                devtools.send("Emulation.setCPUThrottlingRate", {"rate": PHONE_CPU_SLOWDOWN})
                started = time.perf_counter()
                with page.expect_response("**/v1/rounds/*/update", timeout=600_000) as uploaded:
                    page.goto(f"{server.url}/device/#enroll={SECRET}")
                    page.wait_for_selector("body[data-stage=examples]", state="attached", timeout=600_000)
                    asked = time.perf_counter() - started
                    page.set_input_files("#npz", str(folder / "phone.npz"))
                status = uploaded.value.status
                first_upload = time.perf_counter() - started
                answers = []
                for _ in range(PREDICTIONS):
                    page.evaluate("document.querySelector('#try-result').removeAttribute('data-ms')")
                    page.set_input_files("#try-photo", str(photo))
                    page.wait_for_selector("#try-result[data-ms]", state="attached", timeout=120_000)
                    read = {key: page.get_attribute("#try-result", f"data-{key}") for key in ("ms", "predict-ms")}
                    answers.append({key: float(value or "nan") for key, value in read.items()})
            finally:
                browser.close()
    predict = sorted(a["predict-ms"] for a in answers)
    whole = sorted(a["ms"] for a in answers)
    return {
        "cpu_slowdown": PHONE_CPU_SLOWDOWN,
        "examples": PHONE_EXAMPLES,
        "upload_status": status,
        "seconds_to_examples_asked": round(asked, 2),
        "seconds_to_first_upload": round(first_upload, 2),
        "try_it_photo": f"{photo.name} 640x480 PNG",
        "predict_ms": [round(v, 1) for v in predict],
        "predict_ms_median": round(predict[len(predict) // 2], 1),
        "try_it_ms_median": round(whole[len(whole) // 2], 1),  # decode, pre-processing and predict
    }


def plot(report: dict, path: Path) -> None:
    """Bars of images/s per run and trainable set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    names = sorted(runs, key=lambda name: not name.startswith("native"))
    figure, axis = plt.subplots(figsize=(7, 3.6))
    for offset, trainable in ((-0.2, "full"), (0.2, "personal")):
        values = [runs[name][f"{trainable}ImagesPerSecond"] for name in names]
        axis.bar(np.arange(len(names)) + offset, values, width=0.4, label=f"{trainable} step")
    axis.set_xticks(np.arange(len(names)), names)
    axis.set_ylabel("images / s")
    load = report["first_load_bytes"]["total"]
    axis.set_title(
        f"{report['bundle']} portable steps (batch {runs[names[0]]['batchSize']}); "
        f"first load {load['gzip'] / 1e6:.1f} MB gzip; load average {report['load_average_1min']['start']:.0f} "
        f"on {report['load_average_1min']['cpus']} CPUs",
        fontsize=9,
    )
    axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def bundle_name(bundle: Path) -> str:
    """What a given bundle is, from its manifest: its model, its kind of sample and what is personal."""
    from edgepfl.manifest import load_manifest

    manifest = load_manifest(bundle)
    return f"{manifest.model.get('name', 'model')} ({manifest.kind.name}), personal {manifest.personal}"


def export_bundle(folder: Path, width: float) -> Path:
    """MobileNet x`width` (x0.25: the bundle the targets name), K_P=2, portable graphs only."""
    command = [str(Path(sys.executable).parent / "edgepfl"), "export", "mobilenet", "--width", str(width), "--kp", "2"]
    subprocess.run([*command, "--engines", "portable", "--out", str(folder)], check=True, stdout=subprocess.DEVNULL)
    return folder


def main() -> None:
    """Run everything and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, help="a MobileNet bundle with portable graphs (default: export)")
    parser.add_argument("--width", type=float, default=0.25, help="MobileNet width of the exported bundle")
    parser.add_argument("--no-webgpu", action="store_true", help="leave out the run on the GPU")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per trainable set")
    parser.add_argument("--threads", type=int, default=2, help="wasm threads of the cross-origin isolated run")
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed steps first (V8 tiers the wasm up over the first steps)"
    )
    parser.add_argument("--phone-only", action="store_true", help="only the phone run (first upload, Try it)")
    parser.add_argument(
        "--steps-only", action="store_true", help="only the steps' speed (any bundle, text too: no phone run)"
    )
    args = parser.parse_args()
    if not CHROMIUM.exists():
        sys.exit(f"{CHROMIUM} is missing: apt-get install -y chromium")
    if not (DIST / RUNTIME[0]).exists():
        sys.exit("onnxruntime-web is not installed: (cd device_runtime/web && npm ci)")
    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle or export_bundle(Path(tmp) / "bundle", args.width)
        if args.phone_only:
            print(json.dumps(phone_report(bundle, Path(tmp)), indent=1))
            return
        load_before = os.getloadavg()
        # native before and after the browser runs: on a shared machine the load drifts between them
        native_before = native_run(bundle, args.steps, args.warmup)
        runs = {"browser 1 thread": browser_run(bundle, 1, isolated=False, steps=args.steps, warmup=args.warmup)}
        runs["browser 1 thread, plain graphs"] = browser_run(
            bundle, 1, isolated=False, steps=args.steps, warmup=args.warmup, bake=False
        )
        runs[f"browser {args.threads} threads (isolated)"] = browser_run(
            bundle, args.threads, isolated=True, steps=args.steps, warmup=args.warmup
        )
        if not args.no_webgpu:
            runs["browser WebGPU"] = browser_run(bundle, 1, False, args.steps, args.warmup, backend="webgpu")
        native_after = native_run(bundle, args.steps, args.warmup)
        runs["native 1 thread"] = {
            **native_after,
            **{key: (native_before[key] + native_after[key]) / 2 for key in SPEED_KEYS},
            "before": native_before,
            "after": native_after,
        }
        report = {
            "bundle": bundle_name(bundle) if args.bundle else f"mobilenet x{args.width} kp=2",
            "load_average_1min": {"start": load_before[0], "end": os.getloadavg()[0], "cpus": os.cpu_count()},
            "runs": runs,
            "first_load_bytes": first_load_bytes(bundle),
            **({"phone_targets": {}} if args.steps_only else phone_report(bundle, Path(tmp))),
        }
    native, browser = runs["native 1 thread"], runs["browser 1 thread"]
    ratio = browser["fullImagesPerSecond"] / native["fullImagesPerSecond"]
    gzip_mb = report["first_load_bytes"]["total"]["gzip"] / 1e6
    report["targets"] = {
        "browser_vs_native_full_1_thread": round(ratio, 3),
        "browser_vs_native_met": ratio >= TARGET_SPEED,
        "first_load_gzip_mb": round(gzip_mb, 2),
        "first_load_met": gzip_mb <= TARGET_MB,
        "personal_frozen_variant_vs_plain_1_thread": round(
            browser["personalImagesPerSecond"] / runs["browser 1 thread, plain graphs"]["personalImagesPerSecond"], 3
        ),
    }
    if "browser WebGPU" in runs:
        gpu = runs["browser WebGPU"]
        speed = gpu["fullImagesPerSecond"] / native["fullImagesPerSecond"]
        report["targets"]["webgpu_adapter"] = gpu["adapter"]
        report["targets"]["browser_webgpu_vs_native_full"] = round(speed, 3)
        # the target is for a real GPU: SwiftShader (a software GPU on the CPU) can never meet it
        report["targets"]["browser_webgpu_vs_native_met"] = speed >= TARGET_WEBGPU_SPEED
        report["targets"]["first_load_webgpu_gzip_mb"] = round(
            report["first_load_bytes"]["total_webgpu"]["gzip"] / 1e6, 2
        )
    report["targets"].update(report.pop("phone_targets"))
    print(json.dumps(report, indent=1))
    name = "web.png" if args.width == 0.25 else f"web-x{args.width}.png"
    if args.bundle:  # a given bundle's plot is named by its model, never over the MobileNet ones
        name = f"web-{report['bundle'].split(' ')[0]}.png"
    plot(report, ROOT / "bench" / "figures" / name)


def phone_report(bundle: Path, folder: Path) -> dict:
    """The phone run and its targets (first upload within 30 s, a prediction within 100 ms)."""
    load = os.getloadavg()[0]
    phone = phone_run(bundle, folder)
    return {
        "phone": {**phone, "load_average_1min": load, "cpus": os.cpu_count()},
        "phone_targets": {
            "first_upload_s": phone["seconds_to_first_upload"],
            "first_upload_met": phone["seconds_to_first_upload"] <= TARGET_FIRST_UPLOAD_S,
            "predict_ms": phone["predict_ms_median"],
            "predict_met": phone["predict_ms_median"] <= TARGET_PREDICT_MS,
        },
    }


if __name__ == "__main__":
    main()
