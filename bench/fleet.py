"""Issue 32's measurement: time to accuracy on a simulated fleet's virtual clock (sync, sync + over-selection and
fedbuff for the same client work), and `edgepfl serve`'s task endpoint with 1,000 polling devices, fedbuff and sync.

Time to accuracy. `edgepfl simulate --fleet dropout:0.3,speed:lognormal:1.0,seed:0 --algorithm fedper` (the Python
API the CLI calls, one child process per run) on MNIST `mlp` and CIFAR-10 `cnn` from --data-root, four ways: sync;
sync + `--over-select 0.3` (the issue's) and 0.5 (beside it: 15 x 0.7 expected uploads cover a round's 10, and
0.3's 13 x 0.7 do not); `--aggregation fedbuff`. One setting for both datasets, fixed before any run and never
tuned on the test split: 50 clients x 2 classes (`classes:2`), kp 1, 1 local epoch, batch 32, lr 0.05, the torch
engine on one thread, seed 0. Sync samples 10 clients a round (`--fraction 0.2`, `--min-clients 1`); over-selection
samples 13 (15) and closes at the 10th upload; fedbuff steps every 10 accepted uploads (`--buffer-size 10`, sync's
round size) with the CLI's defaults otherwise (`--max-staleness 10`, `--staleness-weight poly:0.5`: FedBuff's
1/sqrt(1 + s), `--server-lr 1`: a step of fresh uploads is their FedAvg mean), and every online device that polls
trains (its concurrency is the fleet's 50). All modes share one deadline (`--round-timeout`): the time a device
at the fleet's 90th-percentile speed takes to train one round on a client's mean training set, so a sync round
short of its uploads (a dropout) ends there.

Definitions.
- Work: client trainings that ran to their end (an upload sent, accepted or refused late: round closed, deadline
  passed, too stale), each one epoch over that client's training samples; a device that drops out trains nothing
  in the simulator and is not counted. A record's trainings are its `bytes_down` over the bytes of one base
  download (each finished training downloaded one base); its late ones are its `late_uploads`.
- Same total client work: sync runs 40 rounds and its trainings W are every mode's budget; over-selection runs
  rounds enough for 1.2 W at its expected rate (13 x 0.7 or 15 x 0.7 a round), fedbuff steps for 4 W (10 a
  step), and each counts its records up to the one whose cumulative work is nearest W (the JSON gives each
  run's counted work).
- A: sync's final mean test accuracy across all 50 clients (the simulator's held score: each client's personal
  part with the global base). Time to A: the virtual time of a mode's first counted record at or above A (sync's
  too: it may reach its final accuracy before its last round). Ratios fedbuff / sync and over-select / sync of
  times to A, against the issue's targets 0.5 and 0.7 (`ratio_to_sync_end`: over sync's whole run instead).
- Beside the targets (`common`): the highest mean accuracy all modes reach within the budget, and each
  mode's time to it and its ratio to sync's; and (`uncapped`) fedbuff's whole run of 4 W: its time to A, the
  ratio to sync's, and the work it took (a device's training costs its battery whether or not it is counted).

Server load. A real `edgepfl serve` on loopback (fedper, mobilenet x0.25 kp 2 base) with 1,000 enrolled devices,
one fresh server per row: sync and fedbuff with one-minute trainings, and fedbuff with 8 s trainings (a stress).
Every device polls GET /v1/task every retry_after (the server's --poll-interval, 5 s), also while it trains, so
every row is offered the same 200 polls/s; a device told to train while idle downloads its base, trains (a sleep)
and uploads the base plus a small shift of its own (its own bytes), and takes its next task at a later poll. One
asyncio loop and one httpx pool of --concurrency (100) connections drive the 1,000 devices. Sync: 10 devices a
round (`--fraction 0.01 --min-clients 10`); fedbuff: `--buffer-size 10` and `--max-staleness` as large as the
fleet, since all 1,000 train at once (staleness ~100 steps; the default 10 would refuse most uploads). Measured
in a 60 s window after the first trainings' uploads: uploads accepted per second; the task endpoint's latency
twice: as the 1,000 devices see it (their event loop's delays included) and as one more device sees it, a probe
in its own process polling every 0.1 s (it trains in no time when told to); and the CPU the server process and
the load used in the window (100% = one core). Server, load and probe share this machine's cores.

Prints JSON on stdout and tables on stderr; writes bench/figures/fleet.png and, without --quick,
docs/measurements/fleet-<date>.json.
Usage: python bench/fleet.py [--data-root ../shared/data] [--quick] [--only accuracy|server] [--datasets mnist cifar10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIGURE = ROOT / "bench" / "figures" / "fleet.png"
MEASUREMENTS = ROOT / "docs" / "measurements"
FLEET = "dropout:0.3,speed:lognormal:1.0,seed:0"
TARGETS = {"fedbuff": 0.5, "over-select": 0.7}  # time to A as a fraction of sync's
SETTING = {
    "algorithm": "fedper",
    "kp": 1,
    "partition": "classes:2",
    "clients": 50,
    "epochs": 1,
    "batch_size": 32,
    "lr": 0.05,
    "fraction": 0.2,
    "min_clients": 1,
    "engine": "torch",
    "threads": 1,
    "seed": 0,
    "fleet": FLEET,
}
TARGET = 10  # sync's round: ceil(0.2 x 50)
MODES = {
    "sync": {},
    "over-select": {"over_select": 0.3},
    "over-select 0.5": {"over_select": 0.5},
    "fedbuff": {
        "aggregation": "fedbuff",
        "buffer_size": TARGET,
        "max_staleness": 10,
        "staleness_weight": "poly:0.5",
        "server_lr": 1.0,
    },
}
DATASETS = {"mnist": {"model": "mlp", "rounds": 40}, "cifar10": {"model": "cnn", "rounds": 40}}
QUICK_ROUNDS = 8
MARGIN = 1.2  # over-select runs rounds for this many times sync's work (`within` counts up to 1x)
UNCAPPED_WORK = 4  # fedbuff runs steps for this many times sync's work: the first 1x is its row, all of it "uncapped"
DEADLINE_QUANTILE = 0.9
# server load: (mode, a device's slept training in seconds): a one-minute round on a phone, and a stress of 8 s
LOAD_ROWS = (("sync", 60.0), ("fedbuff", 60.0), ("fedbuff", 8.0))
QUICK_LOAD_ROWS = (("sync", 8.0), ("fedbuff", 8.0))
POLL_SECONDS = 5.0  # server load: --poll-interval, the retry_after every device polls at
PROBE_SECONDS = 0.1  # server load: the probe device's poll interval


# time to accuracy


def deadline(dataset: str, data_root: str) -> dict:
    """The round deadline: a device at the fleet's 90th-percentile speed training one round on the mean client."""
    from edgepfl.simulate.config import PartitionOptions
    from edgepfl.simulate.fleet import FleetSpec
    from edgepfl.simulate.loop import load_partition

    options = PartitionOptions(
        dataset=dataset, data_root=data_root, partition=SETTING["partition"], clients=SETTING["clients"]
    )
    _, parts = load_partition(options, SETTING["seed"])
    mean_train = float(np.mean([len(part.train) for part in parts]))
    spec = FleetSpec.parse(FLEET)
    speed = math.exp(statistics.NormalDist().inv_cdf(DEADLINE_QUANTILE) * spec.speed_sigma)
    seconds = speed * SETTING["epochs"] * mean_train * spec.sample_time
    return {"round_timeout": round(seconds, 3), "mean_train_samples": mean_train, "speed_p90": speed}


def run_child(request: dict) -> dict:
    """One simulated run (in the child): each record's virtual time, mean test accuracy, trainings and late ones."""
    from edgepfl.simulate.config import SimulateConfig
    from edgepfl.simulate.loop import run_simulation
    from edgepfl.simulate.rounds import final_global_base
    from edgepfl.wire import encode_tensors

    fields = {**SETTING, **MODES[request["mode"]], "model": DATASETS[request["dataset"]]["model"]}
    config = SimulateConfig(
        out=request["out"],
        dataset=request["dataset"],
        data_root=request["data_root"],
        rounds=request["rounds"],
        round_timeout=request["round_timeout"],
        **fields,
    )
    started = time.perf_counter()
    results = run_simulation(config)
    wall = time.perf_counter() - started
    download = len(encode_tensors(final_global_base(config.out)))  # every base download has these bytes (fp32)
    records = []
    for record in results.rounds:
        trainings, rest = divmod(record.bytes_down, download)
        assert rest == 0, f"round {record.round}: {record.bytes_down} bytes down is not a number of downloads"
        records.append(
            {
                "round": record.round,
                "virtual_time": record.virtual_time,
                "accuracy": record.test_accuracy["mean"],
                "trainings": trainings,
                "late": record.late_uploads or 0,
            }
        )
    return {"records": records, "wall_seconds": round(wall, 1), "download_bytes": download}


def simulate(dataset: str, mode: str, rounds: int, timeout: float, data_root: str) -> dict:
    """One run in a fresh Python process."""
    with tempfile.TemporaryDirectory(prefix="edgepfl-bench-fleet-") as out:
        request = {
            "dataset": dataset,
            "mode": mode,
            "rounds": rounds,
            "round_timeout": timeout,
            "data_root": data_root,
            "out": out,
        }
        child = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(request)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    if child.returncode != 0:
        sys.exit(f"{dataset} {mode} failed:\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.splitlines()[-1])


def rounds_for(mode: str, budget: int) -> int:
    """Rounds expected to do MARGIN x `budget` trainings (fedbuff: steps for UNCAPPED_WORK x `budget`)."""
    from edgepfl.simulate.fleet import FleetSpec

    if mode == "fedbuff":
        return math.ceil(UNCAPPED_WORK * budget / MODES[mode]["buffer_size"])
    dropout = FleetSpec.parse(FLEET).dropout
    return math.ceil(MARGIN * budget / (math.ceil(TARGET * (1 + MODES[mode]["over_select"])) * (1 - dropout)))


def within(records: list[dict], budget: int) -> list[dict]:
    """The records up to the one whose cumulative work is nearest `budget` (the earlier on a tie), each with its
    cumulative trainings."""
    kept, total = [], 0
    for record in records:
        if total + record["trainings"] - budget >= budget - total and kept:
            break  # this record would take the work further from the budget than stopping before it
        total += record["trainings"]
        kept.append({**record, "work": total})
    return kept


def first_at(records: list[dict], accuracy: float) -> float | None:
    """The virtual time of the first record at or above `accuracy`, or None."""
    return next((r["virtual_time"] for r in records if r["accuracy"] >= accuracy - 1e-12), None)


def time_to_accuracy(dataset: str, data_root: str, quick: bool) -> dict:
    """The three modes on one dataset, sync first (its work is the budget, its final accuracy A)."""
    clock = deadline(dataset, data_root)
    timeout = clock["round_timeout"]
    sync_rounds = QUICK_ROUNDS if quick else DATASETS[dataset]["rounds"]
    print(f"{dataset}: deadline {timeout:.1f} virtual s; sync {sync_rounds} rounds ...", file=sys.stderr)
    runs = {"sync": simulate(dataset, "sync", sync_rounds, timeout, data_root)}
    runs["sync"]["rounds"] = sync_rounds
    budget = sum(r["trainings"] for r in runs["sync"]["records"])
    accuracy = runs["sync"]["records"][-1]["accuracy"]
    for mode in [mode for mode in MODES if mode != "sync"]:
        rounds = rounds_for(mode, budget)
        print(f"{dataset}: {mode} {rounds} rounds (budget {budget} trainings) ...", file=sys.stderr)
        runs[mode] = {**simulate(dataset, mode, rounds, timeout, data_root), "rounds": rounds}
    sync_time = first_at(runs["sync"]["records"], accuracy)
    sync_end = runs["sync"]["records"][-1]["virtual_time"]
    rows = []
    for mode, run in runs.items():
        counted = within(run["records"], budget)
        reached = first_at(counted, accuracy)
        ratio = reached / sync_time if reached is not None and sync_time else None
        target = TARGETS.get(mode)
        rows.append(
            {
                "mode": mode,
                "options": MODES[mode],
                "rounds": run["rounds"],
                "wall_seconds": run["wall_seconds"],
                "trainings": sum(r["trainings"] for r in run["records"]),
                "late": sum(r["late"] for r in run["records"]),
                "work_counted": counted[-1]["work"] if counted else 0,
                "records_counted": len(counted),
                "virtual_time_at_budget": counted[-1]["virtual_time"] if counted else None,
                "final_accuracy": counted[-1]["accuracy"] if counted else None,
                "time_to_A": reached,
                "ratio_to_sync": ratio,
                "target": target,
                "ratio_to_sync_end": reached / sync_end if reached is not None else None,
                "met": None if target is None else ratio is not None and ratio <= target,
                "records": run["records"],
            }
        )
    return {
        "dataset": dataset,
        "model": DATASETS[dataset]["model"],
        **clock,
        "budget_trainings": budget,
        "A": accuracy,
        "sync_time_to_A": sync_time,
        "sync_virtual_time": sync_end,
        "runs": rows,
        "common": common_level(rows, budget),
        "uncapped": uncapped(runs["fedbuff"], accuracy, sync_time, budget),
    }


def uncapped(run: dict, accuracy: float, sync_time: float | None, budget: int) -> dict:
    """Beside the issue's target: fedbuff without the same-work cap (UNCAPPED_WORK x sync's work): its time to A,
    its ratio to sync's, and the client work it took to get there (trainings, and as a multiple of sync's)."""
    work, reached = 0, None
    for record in run["records"]:
        work += record["trainings"]
        if record["accuracy"] >= accuracy - 1e-12:
            reached = record
            break
    end = run["records"][-1]
    target = TARGETS["fedbuff"]
    ratio = reached["virtual_time"] / sync_time if reached is not None and sync_time else None
    return {
        "mode": "fedbuff",
        "steps": run["rounds"],
        "work_limit": sum(r["trainings"] for r in run["records"]),
        "time_to_A": reached["virtual_time"] if reached else None,
        "ratio_to_sync": ratio,
        "work_to_A": work if reached else None,
        "work_vs_sync": round(work / budget, 2) if reached else None,
        "best_accuracy": max(r["accuracy"] for r in run["records"]),
        "virtual_time_at_end": end["virtual_time"],
        "target": target,
        "met": ratio is not None and ratio <= target,
    }


def common_level(rows: list[dict], budget: int) -> dict:
    """Beside the issue's target: the highest mean accuracy every mode reaches within the budget, and each mode's
    time to it (its ratio to sync's)."""
    counted = {row["mode"]: within(row["records"], budget) for row in rows}
    level = min(max(r["accuracy"] for r in records) for records in counted.values())
    times = {mode: first_at(records, level) for mode, records in counted.items()}
    return {"accuracy": level, "time": times, "ratio_to_sync": {mode: t / times["sync"] for mode, t in times.items()}}


# server load


def serve_load(mode: str, train: float, devices: int, seconds: float, concurrency: int, work: Path) -> dict:
    """One real server with `devices` enrolled and polling, each training `train` seconds when told to; uploads
    accepted per second and task latency in a window of `seconds` after the first trainings' uploads."""
    import secrets

    from edgepfl.server.launch import LocalServer
    from edgepfl.server.store import Store
    from edgepfl.server.tokens import hash_token
    from server import peak_rss_mb  # bench/server.py

    warmup = train + 2 * POLL_SECONDS
    state = work / f"state-{mode}-{train:g}"
    store = Store(state)
    tokens = {f"d{i:04d}": secrets.token_urlsafe(16) for i in range(devices + 1)}  # the last one: the probe
    for name, token in tokens.items():
        store.add_device(name, hash_token(token), time.time())
    store.close()
    probe_token = tokens.pop(f"d{devices:04d}")
    options = [
        "--strategy",
        "fedper",
        "--rounds",
        "1000000",
        "--round-timeout",
        "120",
        "--min-clients",
        str(TARGET),
        "--fraction",
        str(TARGET / devices),
        "--poll-interval",
        str(POLL_SECONDS),
    ]
    if mode == "fedbuff":
        options += ["--aggregation", "fedbuff", "--buffer-size", str(TARGET), "--max-staleness", str(devices)]
    server = LocalServer(work / "bundle", state, *options, log=work / f"server-{mode}-{train:g}.log")
    try:
        server.start(timeout=60)
        assert server.process is not None
        pid = server.process.pid
        request = {"url": server.url, "token": probe_token, "warmup": warmup, "seconds": seconds, "index": devices}
        probe = subprocess.Popen(
            [sys.executable, __file__, "--probe", json.dumps(request)], stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        row = asyncio.run(poll_fleet(server.url, pid, tokens, train, warmup, seconds, concurrency))
        output, _ = probe.communicate(timeout=600)
        if probe.returncode != 0:
            sys.exit(f"the probe device failed (exit {probe.returncode})")
        row.update(json.loads(output.splitlines()[-1]))
        row["server_peak_rss_mb"] = round(peak_rss_mb(pid)[1], 1)
        row["machine_load_1min"] = os.getloadavg()[0]  # other work on the shared cores, at the window's end
    finally:
        server.stop(grace=20)
        shutil.rmtree(state, ignore_errors=True)
    return {
        "mode": mode,
        "devices": devices,
        "concurrency": concurrency,
        "window_seconds": seconds,
        "warmup_seconds": warmup,
        "train_seconds": train,
        **row,
    }


async def poll_fleet(
    url: str, pid: int, tokens: dict[str, str], train_seconds: float, warmup: float, seconds: float, concurrency: int
) -> dict:
    """Every device polls every retry_after (the poll interval also while it trains, so that both modes poll alike);
    told to train while idle, it downloads its base, sleeps `train_seconds` and uploads. Counted from `warmup` on."""
    import httpx

    from edgepfl.device_runtime.client import KEEPALIVE_SECONDS
    from edgepfl.wire import decode_tensors

    loop = asyncio.get_running_loop()
    opens = loop.time() + warmup
    ends = opens + seconds
    latencies: list[float] = []
    counts: Counter = Counter()
    bases: dict[int, dict[str, np.ndarray]] = {}  # the recent rounds' decoded bases, shared by their devices
    newest = {"seen": 0, "at_open": 0}  # the newest round (fedbuff: base version) any device was given
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=KEEPALIVE_SECONDS
    )

    async def train(index: int, auth: dict, task: dict, http: httpx.AsyncClient) -> None:
        round_id = task["round"]
        download = await http.get(task["base_url"], headers=auth)
        if round_id not in bases:
            bases[round_id] = decode_tensors(download.content)
            for old in [r for r in bases if r < round_id - 2]:
                del bases[old]  # devices training on it keep their own reference
        base = bases[round_id]
        newest["seen"] = max(newest["seen"], round_id)
        if loop.time() < opens:
            newest["at_open"] = newest["seen"]
        await asyncio.sleep(train_seconds)
        reply = await http.post(
            f"/v1/rounds/{round_id}/update",
            content=update_body(base, task, index),
            headers={**auth, "Content-Type": "application/octet-stream"},
        )
        if opens <= loop.time() < ends:
            counts["accepted" if reply.status_code == 200 else f"refused {reply.json().get('error')}"] += 1

    async def device(index: int, token: str, http: httpx.AsyncClient) -> None:
        auth = {"Authorization": f"Bearer {token}"}
        training: asyncio.Task | None = None
        due = loop.time() + POLL_SECONDS * index / len(tokens)  # the first polls spread over one interval
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            if loop.time() >= ends:
                break
            sent = loop.time()
            reply = await http.get("/v1/task", headers=auth)
            if opens <= sent < ends:
                latencies.append(1000 * (loop.time() - sent))
            task = reply.json()
            due = sent + float(task.get("retry_after") or POLL_SECONDS)
            if task["action"] == "train" and (training is None or training.done()):
                counts["tasks"] += opens <= sent < ends
                training = asyncio.create_task(train(index, auth, task, http))
        if training is not None and not training.done():
            training.cancel()  # past the window: its upload would not count
            await asyncio.gather(training, return_exceptions=True)

    cpu: dict[str, float] = {}  # CPU seconds of the server and of this load, at the window's ends

    async def window() -> None:
        for mark, at in (("open", opens), ("end", ends)):
            await asyncio.sleep(max(0.0, at - loop.time()))
            cpu[f"server_{mark}"], cpu[f"load_{mark}"] = cpu_seconds(pid), time.process_time()

    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        await asyncio.gather(window(), *(device(i, token, http) for i, token in enumerate(tokens.values())))
    task_ms = np.asarray(latencies)
    return {
        "polls_per_s": round(len(latencies) / seconds, 1),
        "task_p50_ms": round(float(np.percentile(task_ms, 50)), 2),
        "task_p90_ms": round(float(np.percentile(task_ms, 90)), 2),
        "task_p99_ms": round(float(np.percentile(task_ms, 99)), 2),
        "task_max_ms": round(float(task_ms.max()), 2),
        "uploads_per_s": round(counts["accepted"] / seconds, 2),
        "uploads_refused": {key[8:]: n for key, n in counts.items() if key.startswith("refused ")},
        "tasks_started": counts["tasks"],
        "rounds_per_s": round((newest["seen"] - newest["at_open"]) / seconds, 2),
        "server_cpu_percent": round(100 * (cpu["server_end"] - cpu["server_open"]) / seconds, 1),
        "load_cpu_percent": round(100 * (cpu["load_end"] - cpu["load_open"]) / seconds, 1),
    }


def update_body(base: dict[str, np.ndarray], task: dict, index: int) -> bytes:
    """A device's upload: the base plus a small shift of its own (its own bytes: the blob store writes each)."""
    from edgepfl.protocol import UploadMeta
    from edgepfl.wire import encode_tensors

    meta = UploadMeta(task["base_layout_hash"], 100 + index % 50, train_loss=0.5, val_accuracy=0.5)
    shift = np.float32(1e-4 * (1 + index % 100))
    return encode_tensors({key: value + shift for key, value in base.items()}, meta.to_metadata())


def run_probe(request: dict) -> dict:
    """One more device in its own process (the probe), polling every PROBE_SECONDS through the window and training
    in no time when told to: the task endpoint's latency without the load generator's own delays."""
    import httpx

    from edgepfl.wire import decode_tensors

    latencies = []
    with httpx.Client(
        base_url=request["url"], headers={"Authorization": f"Bearer {request['token']}"}, timeout=300
    ) as http:
        time.sleep(request["warmup"])
        ends = time.monotonic() + request["seconds"]
        while time.monotonic() < ends:
            sent = time.monotonic()
            task = http.get("/v1/task").json()
            latencies.append(1000 * (time.monotonic() - sent))
            if task["action"] == "train":
                base = decode_tensors(http.get(task["base_url"]).content)
                body = update_body(base, task, request["index"])
                http.post(
                    f"/v1/rounds/{task['round']}/update",
                    content=body,
                    headers={"Content-Type": "application/octet-stream"},
                )
            time.sleep(max(0.0, sent + PROBE_SECONDS - time.monotonic()))
    task_ms = np.asarray(latencies)
    return {
        "probe_polls": len(latencies),
        **{f"probe_p{q}_ms": round(float(np.percentile(task_ms, q)), 2) for q in (50, 90, 99)},
        "probe_max_ms": round(float(task_ms.max()), 2),
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_load(rows: tuple, devices: int, seconds: float, concurrency: int) -> dict:
    """Sync and fedbuff under the same polling fleet, one fresh server per row of `rows` ((mode, train seconds))."""
    from server import write_bundle  # bench/server.py: manifest + initial tensors, no ONNX export

    with tempfile.TemporaryDirectory(prefix="edgepfl-bench-fleet-server-") as tmp:
        work = Path(tmp)
        manifest = write_bundle(work / "bundle", 0.25, 2)
        base_mb = sum(t.nbytes for t in manifest.by_role("base")) / 2**20
        measured = []
        for mode, train in rows:
            print(f"server load: {mode}, {devices} devices training {train:g} s ...", file=sys.stderr)
            measured.append(serve_load(mode, train, devices, seconds, concurrency, work))
    return {
        "model": "mobilenet x0.25 kp 2",
        "base_mb": round(base_mb, 3),
        "poll_interval_s": POLL_SECONDS,
        "rows": measured,
    }


# output


def plot(datasets: list[dict], path: Path) -> None:
    """Mean test accuracy against virtual time, one panel per dataset, one line per mode (within the budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.2), squeeze=False)
    for axis, result in zip(axes[0], datasets):
        for row in result["runs"]:
            counted = within(row["records"], result["budget_trainings"])
            line = axis.plot(
                [r["virtual_time"] for r in counted], [r["accuracy"] for r in counted], marker=".", label=row["mode"]
            )
            if row["time_to_A"] is not None:
                axis.axvline(row["time_to_A"], color=line[0].get_color(), ls=":", lw=1)
            if row["mode"] == "fedbuff":  # past the budget, up to A (or its last step): the uncapped run
                later = row["records"][len(counted) - 1 :]
                reached = result["uncapped"]["time_to_A"]
                later = [r for r in later if reached is None or r["virtual_time"] <= reached]
                axis.plot(
                    [r["virtual_time"] for r in later],
                    [r["accuracy"] for r in later],
                    ls="--",
                    lw=1,
                    color=line[0].get_color(),
                    label=f"fedbuff past sync's work (to {UNCAPPED_WORK}x)",
                )
        axis.axhline(result["A"], color="grey", ls="--", lw=1, label=f"A = sync's final ({result['A']:.3f})")
        axis.set_title(f"{result['dataset']} {result['model']}, fedper, {result['budget_trainings']} trainings each")
        axis.set_xlim(0, result["sync_virtual_time"] * 1.05)
        axis.set_xlabel("virtual time (s)")
        axis.set_ylabel("mean test accuracy")
        axis.legend(loc="lower right")
    figure.suptitle(f"--fleet {FLEET}", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def tables(result: dict) -> None:
    """The two tables on stderr."""
    for data in result["time_to_accuracy"]:
        print(
            f"\n{data['dataset']} {data['model']}: A = {data['A']:.4f}, budget {data['budget_trainings']} trainings, "
            f"deadline {data['round_timeout']:.1f} s",
            file=sys.stderr,
        )
        print(
            f"{'mode':15} {'rounds':>6} {'trainings':>9} {'late':>5} {'counted':>7} {'final acc':>9} "
            f"{'time to A':>10} {'ratio':>6} {'target':>6} {'met':>4}",
            file=sys.stderr,
        )
        for r in data["runs"]:
            reached = "-" if r["time_to_A"] is None else f"{r['time_to_A']:.0f}"
            ratio = "-" if r["ratio_to_sync"] is None else f"{r['ratio_to_sync']:.2f}"
            target = "-" if r["target"] is None else f"{r['target']:.1f}"
            met = "-" if r["met"] is None else ("yes" if r["met"] else "no")
            line = f"{r['mode']:15} {r['rounds']:>6} {r['trainings']:>9} {r['late']:>5} {r['work_counted']:>7} "
            print(f"{line}{r['final_accuracy']:>9.4f} {reached:>10} {ratio:>6} {target:>6} {met:>4}", file=sys.stderr)
        common = data["common"]
        times = ", ".join(
            f"{mode} {common['time'][mode]:.0f} s ({common['ratio_to_sync'][mode]:.2f})" for mode in common["time"]
        )
        print(f"the highest accuracy all modes reach, {common['accuracy']:.4f}, at: {times}", file=sys.stderr)
        free = data["uncapped"]
        if free["time_to_A"] is None:
            print(
                f"fedbuff past sync's work: A not reached in {free['work_limit']} trainings (best "
                f"{free['best_accuracy']:.4f} at {free['virtual_time_at_end']:.0f} s)",
                file=sys.stderr,
            )
        else:
            print(
                f"fedbuff past sync's work: A at {free['time_to_A']:.0f} s ({free['ratio_to_sync']:.2f} of sync's, "
                f"target {free['target']}), after {free['work_to_A']} trainings ({free['work_vs_sync']}x sync's)",
                file=sys.stderr,
            )
    if result["server_load"]:
        load = result["server_load"]
        devices = load["rows"][0]["devices"]
        print(f"\nserver load ({devices} devices, {load['model']}, {load['base_mb']} MiB base):", file=sys.stderr)
        print(
            f"{'mode':8} {'train s':>7} {'polls/s':>8} {'task p50/p99 ms':>17} {'probe p50/p99 ms':>17} "
            f"{'uploads/s':>9} {'rounds/s':>8} {'server CPU':>10} {'load CPU':>8} {'peak MiB':>8}",
            file=sys.stderr,
        )
        for r in load["rows"]:
            task = f"{r['task_p50_ms']:.0f} / {r['task_p99_ms']:.0f}"
            probe = f"{r['probe_p50_ms']:.0f} / {r['probe_p99_ms']:.0f}"
            print(
                f"{r['mode']:8} {r['train_seconds']:>7g} {r['polls_per_s']:>8} {task:>17} {probe:>17} "
                f"{r['uploads_per_s']:>9} {r['rounds_per_s']:>8} {r['server_cpu_percent']:>9}% "
                f"{r['load_cpu_percent']:>7}% {r['server_peak_rss_mb']:>8}",
                file=sys.stderr,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument(
        "--quick", action="store_true", help="MNIST only, 8 sync rounds; 200 devices, 8 s trainings, for 20 s"
    )
    parser.add_argument("--only", choices=("accuracy", "server"), help="run this part only")
    parser.add_argument("--datasets", nargs="+", choices=sorted(DATASETS), help="default: both (--quick: mnist)")
    parser.add_argument("--devices", type=int, help="server load: enrolled devices (default 1000; --quick 200)")
    parser.add_argument("--concurrency", type=int, default=100, help="server load: connections in the client pool")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    if args.probe:
        print(json.dumps(run_probe(json.loads(args.probe))))
        return
    datasets = args.datasets or (["mnist"] if args.quick else list(DATASETS))
    started = time.perf_counter()
    accuracy = [] if args.only == "server" else [time_to_accuracy(d, args.data_root, args.quick) for d in datasets]
    devices = args.devices or (200 if args.quick else 1000)
    rows, seconds = (QUICK_LOAD_ROWS, 20.0) if args.quick else (LOAD_ROWS, 60.0)
    load = None if args.only == "accuracy" else server_load(rows, devices, seconds, args.concurrency)
    result = {
        "command": " ".join(["python", "bench/fleet.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "quick": args.quick,
        "cores": os.cpu_count(),
        "fleet": FLEET,
        "setting": SETTING,
        "modes": MODES,
        "targets": TARGETS,
        "time_to_accuracy": accuracy,
        "server_load": load,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(result, indent=1)
    print(text)
    tables(result)
    if accuracy:
        plot(accuracy, FIGURE)
    if not args.quick and args.only is None:
        MEASUREMENTS.mkdir(parents=True, exist_ok=True)
        (MEASUREMENTS / f"fleet-{result['date']}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
