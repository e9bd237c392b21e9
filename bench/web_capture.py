"""The page as a keyboard and a motion recorder on an emulated phone (issue 52): suggestions after a keystroke, the
live activity's refresh, and the motion readings the page receives while a round trains.

Each part serves a bundle with a real `edgepfl serve`, opens the device page from its join link in Debian's
chromium emulating a phone (390x844, touch, CPU slowed 4 times) and reads what the page itself measures:

- keyboard: a transformer (width 0.25, 2 layers, 20 tokens) whose vocabulary is counted from this repository's
  README.md and docs/*.md; Playwright types SENTENCE key by key at a person's pace (KEY_DELAY_MS between keys, each
  key waited for), first with nothing else on the page, then again while a round trains on a text file the page was
  given; after each key, the milliseconds from the keystroke to the chips drawn (`#chips[data-ms]`: the model is
  asked at a word boundary, a word's completions filtered from its answer). Target: 50 ms.
- motion: UCI HAPT's har-cnn as `edgepfl export` makes it (6 channels, 128-reading windows at 50 Hz, 6 activities),
  given a CSV of windows so that it takes part at once; Chromium's sensor emulation sends the phone's motion (a
  reading changed every 100 ms); the page records windows and shows the live activity, first idle, then while a
  round of 30 epochs trains. Counted: the `devicemotion` events the page received against 60 a second
  (the gaps between them), the resampler's gaps (a window under way dropped), the windows recorded against those
  the time allows, the live activity's refreshes a second (target: at least 2), and the page thread's long tasks
  (over 50 ms, the Long Tasks API: how long the page's own work held its thread, whatever the machine did).

Each part keeps the page's own device line (`page`: its WebAssembly threads, and whether it is cross-origin
isolated, which threads need).

Prints JSON, writes it to --out (default docs/measurements/web-capture-<date>.json) and bench/figures/web-capture.png.

Usage: python bench/web_capture.py [--out FILE]   (needs chromium, playwright, npm ci --prefix device_runtime/web)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgepfl.server.launch import LocalServer
from edgepfl.server.web import CHROMIUM, CHROMIUM_ARGS, PHONE_CONTEXT, PHONE_CPU_SLOWDOWN

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import host  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECRET = "bench-join-secret-0123456789abcdef"
SENTENCE = "the page keeps what you write on this phone and learns your words "
KEY_DELAY_MS = 120  # a quick typist: about 8 keys a second
TARGET_SUGGEST_MS, TARGET_LIVE_PER_S, EVENTS_PER_S = 50.0, 2.0, 60.0
IDLE_SECONDS = 12.0
ROUND_EPOCHS = {"keyboard": 3, "motion": 30}  # each part's round; --round-epochs N: N for both
STARTING_WINDOWS = 20  # a CSV's windows, so that the page takes part in rounds at once


def open_phone(playwright, server_url: str, sensors: bool = False):
    """The device page on an emulated phone, joined; its DevTools session (sensor emulation on, when asked)."""
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=list(CHROMIUM_ARGS))
    context = browser.new_context(**PHONE_CONTEXT)
    if sensors:
        context.grant_permissions(["accelerometer", "gyroscope"], origin=server_url)
    held: list = []
    context.route("**/v1/task", lambda route: held.append(route))  # no round until the idle part is measured
    page = context.new_page()
    devtools = context.new_cdp_session(page)
    devtools.send("Emulation.setCPUThrottlingRate", {"rate": PHONE_CPU_SLOWDOWN})
    for sensor in ("accelerometer", "gyroscope", "linear-acceleration") if sensors else ():
        devtools.send("Emulation.setSensorOverrideEnabled", {"enabled": True, "type": sensor})
    page.goto(f"{server_url}/device/#enroll={SECRET}")
    page.wait_for_selector("body[data-stage=examples]", state="attached", timeout=600_000)
    return browser, context, page, devtools, held


def release(context, held: list) -> None:
    """Let the page's task requests through: rounds begin."""
    context.unroute("**/v1/task")
    for route in held:
        try:
            route.continue_()
        except Exception:  # Playwright let it through when the route went
            pass


def type_sentence(page) -> list[dict]:
    """Type SENTENCE key by key; after each key, the chips' milliseconds (and whether the model was asked)."""
    page.click("#writing")
    keys = []
    for i, key in enumerate(SENTENCE):
        typed = page.input_value("#writing") + key
        page.keyboard.type(key)
        deadline = time.monotonic() + 30
        while page.get_attribute("#chips", "data-typed") != typed:
            if time.monotonic() > deadline:
                raise SystemExit(f"the chips never followed {typed!r}")
            time.sleep(0.005)
        boundary = not key.isalnum()
        keys.append({"key": i, "ms": float(page.get_attribute("#chips", "data-ms")), "word_boundary": boundary})
        time.sleep(KEY_DELAY_MS / 1000)
    page.keyboard.press("Enter")
    return keys


def latency_summary(keys: list[dict]) -> dict:
    ms = np.array([k["ms"] for k in keys])
    asked = np.array([k["ms"] for k in keys if k["word_boundary"]])
    return {
        "keys": len(ms),
        "median_ms": round(float(np.median(ms)), 1),
        "p95_ms": round(float(np.percentile(ms, 95)), 1),
        "max_ms": round(float(ms.max()), 1),
        "word_boundary_median_ms": round(float(np.median(asked)), 1),
        "share_within_target": round(float(np.mean(ms <= TARGET_SUGGEST_MS)), 3),
        "ms": [round(v, 1) for v in ms],
    }


def keyboard_run(folder: Path, epochs: int) -> dict:
    """Suggestions after each keystroke, idle and while a round of `epochs` epochs trains."""
    from playwright.sync_api import sync_playwright

    from edgepfl.export.bundle import ExportOptions, export_target
    from edgepfl.export.sequence_options import SequenceOptions
    from edgepfl.export.textmodels import sequence_target

    corpus = folder / "corpus.txt"
    corpus.write_text(
        "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]),
        encoding="utf-8",
    )
    sequence = SequenceOptions(vocab=corpus, seq_len=20, layers=2)
    target = sequence_target("transformer", sequence, seed=0, width=0.25)
    bundle = folder / "text-bundle"
    export_target(target, 1, bundle, ExportOptions(engines=("portable",), force=True), notice=lambda _: None)
    written = json.loads((bundle / "manifest.json").read_text())
    vocabulary = (written.get("sample") or written["task"])["vocab_size"]
    notes = folder / "notes.txt"
    notes.write_text("\n".join(corpus.read_text(encoding="utf-8").splitlines()[:400]), encoding="utf-8")
    (folder / "secret").write_text(SECRET)
    options = ("--min-clients", "1", "--rounds", "1", "--epochs", str(epochs), "--batch-size", "16")
    options += ("--poll-interval", "0.3")
    options += ("--enroll-secret-file", str(folder / "secret"))
    with LocalServer(bundle, folder / "text-state", *options, log=folder / "text-server.log") as server:
        with sync_playwright() as playwright:
            browser, context, page, _, held = open_phone(playwright, server.url)
            try:
                page.set_input_files("#recording-file", str(notes))
                idle = type_sentence(page)
                release(context, held)
                page.wait_for_selector("body[data-stage=training]", state="attached", timeout=600_000)
                training = type_sentence(page)
                still_training = page.get_attribute("body", "data-stage") == "training"
                device = page.text_content("#device")
            finally:
                browser.close()
    return {
        "model": f"transformer width 0.25, 2 layers, 20 tokens, {vocabulary} words",
        "page": device,
        "target_ms": TARGET_SUGGEST_MS,
        "idle": latency_summary(idle),
        "while_training": {**latency_summary(training), "round_still_training_at_the_end": still_training},
    }


def motion_window(devtools, seconds: float, rng: np.random.Generator) -> None:
    """The phone moves for `seconds`: its readings change every 100 ms (Chromium repeats each at 60 Hz)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        acceleration = rng.normal([0.0, 9.8, 0.0], 2.0)
        rotation = rng.normal(0.0, 0.5, 3)
        for sensor, xyz in (("accelerometer", acceleration), ("gyroscope", rotation), ("linear-acceleration", [0] * 3)):
            reading = {"xyz": dict(zip("xyz", map(float, xyz)))}
            devtools.send("Emulation.setSensorOverrideReadings", {"type": sensor, "reading": reading})
        time.sleep(0.1)


# the devicemotion events' times, and the page thread's long tasks (over 50 ms: the browser's Long Tasks API), which
# tell a reading the page's own work held back from one the machine's other processes did; and what the page was
# doing when (its status line, on the events' clock), which tells a gap at a round's start or end from one in its steps
COUNTERS = """() => {
  window.motionStamps = [];
  window.longTasks = [];
  window.statusChanges = [[performance.now(), document.querySelector('#status').textContent]];
  addEventListener('devicemotion', (event) => motionStamps.push(event.timeStamp));
  new PerformanceObserver((list) => longTasks.push(...list.getEntries().map((e) => e.duration)))
    .observe({ type: 'longtask' });
  const status = document.querySelector('#status');
  new MutationObserver(() => statusChanges.push([performance.now(), status.textContent]))
    .observe(status, { childList: true, characterData: true, subtree: true });
}"""


def motion_part(page, devtools, seconds: float, rng) -> dict:
    """Move for `seconds` while the page records and shows the live activity: what it received and did."""
    refreshed = lambda: int(page.get_attribute("#live-activity", "data-refreshed") or 0)  # noqa: E731
    windows = lambda: int(page.get_attribute("#recording-held", "data-records"))  # noqa: E731
    page.evaluate("() => { motionStamps.length = 0; longTasks.length = 0; }")  # statusChanges kept: the status then
    before = {"refreshed": refreshed(), "windows": windows(), "at": time.monotonic()}
    motion_window(devtools, seconds, rng)
    elapsed = time.monotonic() - before["at"]
    stamps = np.array(page.evaluate("motionStamps"))
    long_tasks = np.array(page.evaluate("longTasks") or [0.0])
    gaps = np.diff(stamps) if len(stamps) > 1 else np.zeros(1)
    span = float(stamps[-1] - stamps[0]) / 1000 if len(stamps) > 1 else 0.0
    return {
        "seconds": round(elapsed, 1),
        "events": int(len(stamps)),
        "events_expected_at_60hz": round(span * EVENTS_PER_S),
        "events_share": round(len(stamps) / max(span * EVENTS_PER_S, 1), 3),
        "gap_ms_median": round(float(np.median(gaps)), 1),
        "gap_ms_max": round(float(gaps.max()), 1),
        "gaps_over_50ms": int((gaps > 50).sum()),
        "gaps_over_200ms_window_dropped": int((gaps > 200).sum()),
        "page_long_tasks": int((long_tasks > 0).sum()),
        "page_long_task_ms_max": round(float(long_tasks.max()), 1),
        "page_long_task_ms_total": round(float(long_tasks.sum()), 1),
        "windows_recorded": windows() - before["windows"],
        "live_refreshes_per_s": round((refreshed() - before["refreshed"]) / elapsed, 2),
        "gaps_over_50ms_by_status": _gaps_by_status(stamps, gaps, page.evaluate("statusChanges")),
        "gaps_ms": [round(float(g), 1) for g in gaps],
    }


def _gaps_by_status(stamps: np.ndarray, gaps: np.ndarray, changes: list) -> dict[str, int]:
    """The gaps over 50 ms counted by the page's status line when each began ("Round 3: fitting…" and so on)."""
    counted: dict[str, int] = {}
    times = [at for at, _ in changes]
    for begun, gap in zip(stamps[:-1], gaps):
        if gap > 50:
            status = changes[max(0, int(np.searchsorted(times, begun, side="right")) - 1)][1]
            label = " ".join(status.split()[:6])  # a round's lines differ by their numbers and progress only
            counted[label] = counted.get(label, 0) + 1
    return counted


def motion_run(folder: Path, epochs: int) -> dict:
    """Readings, windows and live refreshes, idle and while a round of `epochs` epochs trains."""
    from playwright.sync_api import sync_playwright

    from edgepfl.datasets.har import HAR_ACTIVITIES, HAR_CHANNELS, HAR_WINDOW
    from edgepfl.export.bundle import ExportOptions, export_target
    from edgepfl.export.textmodels import sensor_target

    target = sensor_target("har-cnn", HAR_CHANNELS, seed=0)
    bundle = folder / "sensor-bundle"
    options = ExportOptions(engines=("portable",), force=True, class_names=HAR_ACTIVITIES)
    export_target(target, 1, bundle, options, notice=lambda _: None)
    rng = np.random.default_rng(0)
    rows = ["window,label," + ",".join(HAR_CHANNELS)]
    for w in range(STARTING_WINDOWS):
        readings = rng.normal(0, 1, (HAR_WINDOW, len(HAR_CHANNELS)))
        rows += [f"w{w},{HAR_ACTIVITIES[w % 6]}," + ",".join(f"{v:.4f}" for v in row) for row in readings]
    windows = folder / "windows.csv"
    windows.write_text("\n".join(rows) + "\n")
    (folder / "secret").write_text(SECRET)
    serve = ("--min-clients", "1", "--rounds", "1", "--epochs", str(epochs), "--batch-size", "8")
    serve += ("--poll-interval", "0.3", "--enroll-secret-file", str(folder / "secret"))
    with LocalServer(bundle, folder / "sensor-state", *serve, log=folder / "sensor-server.log") as server:
        with sync_playwright() as playwright:
            browser, context, page, devtools, held = open_phone(playwright, server.url, sensors=True)
            try:
                page.set_input_files("#recording-file", str(windows))
                page.wait_for_selector(f"#recording-held[data-records='{STARTING_WINDOWS}']", state="attached")
                page.evaluate(COUNTERS)
                page.click("#watch")
                page.click("#record")
                idle = motion_part(page, devtools, IDLE_SECONDS, rng)
                release(context, held)
                page.wait_for_selector("body[data-stage=training]", state="attached", timeout=600_000)
                started = time.monotonic()
                training = motion_part(page, devtools, IDLE_SECONDS, rng)
                training["round_still_training_at_the_end"] = page.get_attribute("body", "data-stage") == "training"
                page.wait_for_selector("body[data-stage=done]", state="attached", timeout=900_000)
                training["round_seconds_at_least"] = round(time.monotonic() - started, 1)
                page.click("#record")
                device = page.text_content("#device")
            finally:
                browser.close()
    return {
        "model": "har-cnn (UCI HAPT: 6 channels, 128-reading windows at 50 Hz, 6 activities)",
        "page": device,
        "windows_a_second_at_50hz_step_64": round(50 / 64, 2),
        "target_live_refreshes_per_s": TARGET_LIVE_PER_S,
        "idle": idle,
        "while_training": training,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (keys, gaps) = plt.subplots(1, 2, figsize=(10, 3.6))
    for part, style in (("idle", "-"), ("while_training", "--")):
        keys.plot(report["keyboard"][part]["ms"], style, label=part.replace("_", " "))
        gaps.plot(report["motion"][part]["gaps_ms"], style, label=part.replace("_", " "))
    keys.axhline(TARGET_SUGGEST_MS, color="#c62828", linewidth=1, label="target")
    keys.set(xlabel="keystroke", ylabel="ms to the chips", title="Suggestions after a keystroke", yscale="log")
    gaps.axhline(1000 / EVENTS_PER_S, color="#c62828", linewidth=1, label="60 Hz")
    gaps.set(xlabel="devicemotion event", ylabel="ms since the one before", title="Motion readings", yscale="log")
    for axis in (keys, gaps):
        axis.legend(fontsize=8)
    figure.suptitle(f"Emulated phone (CPU x{PHONE_CPU_SLOWDOWN}), load average {report['load_average']}", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    today = datetime.date.today().isoformat()
    default = ROOT / "docs" / "measurements" / f"web-capture-{today}.json"
    parser.add_argument("--out", type=Path, default=default, help="where the JSON goes")
    parser.add_argument("--only", choices=("keyboard", "motion"), help="one part only (no plot)")
    parser.add_argument(
        "--round-epochs",
        type=int,
        help=f"each part's round (default {ROUND_EPOCHS}; more on a fast host, so that the round outlasts the "
        "keys typed and the readings taken while it trains)",
    )
    args = parser.parse_args()
    if not CHROMIUM.exists():
        sys.exit(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        report = {"date": today, "host": host(), "cpu_slowdown": PHONE_CPU_SLOWDOWN, "cpus": os.cpu_count()}
        parts = (args.only,) if args.only else ("keyboard", "motion")
        for part in parts:
            run = keyboard_run if part == "keyboard" else motion_run
            report[part] = run(folder, args.round_epochs or ROUND_EPOCHS[part])
        report["load_average"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if not args.only:
        plot(report, ROOT / "bench" / "figures" / "web-capture.png")
    brief = {part: dict(report[part]) for part in parts}
    for part in brief.values():
        for phase in ("idle", "while_training"):
            part[phase] = {k: v for k, v in part[phase].items() if k not in ("ms", "gaps_ms")}
    print(json.dumps(brief, indent=1))


if __name__ == "__main__":
    main()
