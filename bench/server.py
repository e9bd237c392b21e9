"""`edgepfl serve` under load: accepted uploads per second, aggregation MB/s and server peak memory vs devices.

One fresh server process (a real `edgepfl serve` on loopback) per device count; every device uploads a
mobilenet x1.0 base (kp=2 by default) with up to `--concurrency` uploads in flight. Peak memory is the
server process's VmHWM (Linux), so it must stay flat as devices grow: aggregation is a running float64
sum and at most `--upload-slots` bodies are held at once.

Prints JSON on stdout and a table on stderr, and writes bench/out/server.png.
Usage: python bench/server.py [--quick] [--devices 10,50,200] [--concurrency 50] [--width 1.0] [--kp 2]
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from edgepfl.device_runtime.client import KEEPALIVE_SECONDS
from edgepfl.kinds import ImageKind, InputSpec
from edgepfl.manifest import Manifest, split_roles
from edgepfl.protocol import UploadMeta
from edgepfl.server.launch import LocalServer
from edgepfl.server.store import Store
from edgepfl.server.tokens import hash_token
from edgepfl.wire import decode_tensors, encode_tensors, save_tensors

OUT = Path(__file__).resolve().parent / "out"


def write_bundle(folder: Path, width: float, kp: int) -> Manifest:
    """A bundle with only what the server reads: manifest.json and portable/initial.safetensors (no ONNX export)."""
    import torch

    from edgepfl.export.models import ModelSpec, build_model

    torch.manual_seed(0)
    model = build_model(ModelSpec(name="mobilenet", width=width))
    params, buffers = model.state_tensors()
    spec = model.spec
    mean, std = spec.normalization
    manifest = Manifest(
        model=spec.to_dict(),
        kind=ImageKind(input=InputSpec(shape=spec.input_shape, mean=mean, std=std)),
        num_classes=spec.num_classes,
        kp=kp,
        blocks=tuple(model.block_names()),
        tensors=split_roles(params, buffers, len(model.block_modules), kp),
    )
    manifest.check()
    manifest.save(folder)
    state = {name: value.detach().numpy() for name, value in model.state_dict().items()}
    save_tensors(folder / "portable" / "initial.safetensors", {t.name: state[t.name] for t in manifest.tensors})
    return manifest


def peak_rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident memory of a process in MiB, from /proc (Linux)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def run_round(bundle: Path, manifest: Manifest, devices: int, concurrency: int, upload_slots: int, work: Path) -> dict:
    """One server, `devices` enrolled devices, one round of uploads; returns the measurements."""
    state = work / f"state-{devices}"
    store = Store(state)
    tokens = {f"d{i:03d}": secrets.token_urlsafe(16) for i in range(devices)}
    for name, token in tokens.items():
        store.add_device(name, hash_token(token), time.time())
    store.close()
    server = LocalServer(
        bundle,
        state,
        *("--strategy", "fedper", "--rounds", "1", "--min-clients", str(devices), "--round-timeout", "3600"),
        *("--upload-slots", str(upload_slots), "--max-upload-mb", "256", "--public-status"),
        log=work / f"server-{devices}.log",
    )
    try:
        server.start(timeout=60)
        url = server.url
        clients = {
            name: httpx.Client(
                base_url=url,
                headers={"Authorization": f"Bearer {t}"},
                timeout=600,
                limits=httpx.Limits(keepalive_expiry=KEEPALIVE_SECONDS),  # as a device: never reuse a closing one
            )
            for name, t in tokens.items()
        }
        for client in clients.values():
            client.get("/v1/task").raise_for_status()
        task = clients["d000"].get("/v1/task").json()
        if task["action"] != "train":
            raise RuntimeError(f"round did not open: {task}")
        round_id = task["round"]
        base = decode_tensors(clients["d000"].get(task["base_url"]).content)
        rss_before, _ = peak_rss_mb(server.process.pid)

        def upload(index_name: tuple[int, str]) -> int:
            index, name = index_name
            new = {key: value + np.float32(1e-3 * index) for key, value in base.items()}
            meta = UploadMeta(manifest.base_layout_hash, 10 + index, train_loss=0.5, val_accuracy=0.5)
            body = encode_tensors(new, meta.to_metadata())
            reply = clients[name].post(
                f"/v1/rounds/{round_id}/update", content=body, headers={"Content-Type": "application/octet-stream"}
            )
            if reply.status_code != 200:
                raise RuntimeError(f"upload of {name} refused: {reply.text}")
            return len(body)

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(concurrency, devices)) as pool:
            sizes = list(pool.map(upload, enumerate(clients)))
        upload_seconds = time.perf_counter() - started
        while True:
            status = httpx.get(f"{url}/v1/status", timeout=30).json()
            if status["rounds_completed"] == 1:
                break
            time.sleep(0.1)
        _, peak = peak_rss_mb(server.process.pid)
        record = status["rounds"][0]
        for client in clients.values():
            client.close()
        aggregate_seconds = record["aggregate_seconds"]
        return {
            "devices": devices,
            "concurrency": min(concurrency, devices),
            "upload_mb": round(sizes[0] / 2**20, 3),
            "uploads_per_s": round(devices / upload_seconds, 2),
            "upload_mb_per_s": round(sum(sizes) / 2**20 / upload_seconds, 1),
            "aggregate_seconds": round(aggregate_seconds, 3),
            "aggregate_mb_per_s": round(record["upload_bytes"] / 2**20 / aggregate_seconds, 1),
            "server_rss_before_uploads_mb": round(rss_before, 1),
            "server_peak_rss_mb": round(peak, 1),
        }
    finally:
        server.stop(grace=20)
        shutil.rmtree(state, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="10,50,200", help="devices per round, comma-separated")
    parser.add_argument("--concurrency", type=int, default=50, help="uploads in flight at once")
    parser.add_argument("--width", type=float, default=1.0, help="mobilenet width")
    parser.add_argument("--kp", type=int, default=2, help="personal blocks (they are not uploaded)")
    parser.add_argument("--upload-slots", type=int, default=4, help="the server's --upload-slots")
    parser.add_argument("--quick", action="store_true", help="mobilenet x0.25 with 4, 8 and 16 devices")
    args = parser.parse_args()
    if args.quick:
        args.width, args.devices = 0.25, "4,8,16"
    counts = [int(n) for n in args.devices.split(",")]
    with tempfile.TemporaryDirectory(prefix="edgepfl-bench-server-") as tmp:
        work = Path(tmp)
        manifest = write_bundle(work / "bundle", args.width, args.kp)
        base_mb = sum(t.nbytes for t in manifest.by_role("base")) / 2**20
        rows = []
        for count in counts:
            row = run_round(work / "bundle", manifest, count, args.concurrency, args.upload_slots, work)
            rows.append(row)
            print(
                f"{count:4d} devices  {row['uploads_per_s']:7.1f} uploads/s  "
                f"aggregation {row['aggregate_mb_per_s']:7.1f} MB/s  peak {row['server_peak_rss_mb']:7.1f} MiB",
                file=sys.stderr,
            )
    result = {
        "model": f"mobilenet x{args.width}",
        "kp": args.kp,
        "strategy": "fedper",
        "base_mb": round(base_mb, 3),
        "upload_slots": args.upload_slots,
        "rounds": rows,
    }
    print(json.dumps(result, indent=2))
    plot(result)


def plot(result: dict) -> None:
    """Peak server memory and throughput against devices per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    rows = result["rounds"]
    devices = [r["devices"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(devices, [r["server_peak_rss_mb"] for r in rows], marker="o", label="peak RSS")
    left.plot(devices, [r["server_rss_before_uploads_mb"] for r in rows], marker=".", ls="--", label="before uploads")
    left.set_xlabel("devices per round")
    left.set_ylabel("server memory (MiB)")
    left.set_ylim(bottom=0)
    left.legend()
    left.set_title(f"{result['model']} base ({result['base_mb']:.1f} MiB per upload)")
    right.plot(devices, [r["uploads_per_s"] for r in rows], marker="o", label="uploads accepted / s")
    right.plot(devices, [r["aggregate_mb_per_s"] for r in rows], marker="s", label="aggregation MB/s")
    right.set_xlabel("devices per round")
    right.set_yscale("log")
    right.legend()
    fig.tight_layout()
    fig.savefig(OUT / "server.png", dpi=120)


if __name__ == "__main__":
    main()
