#!/usr/bin/env bash
# Prove that edgepfl's portable engine trains on aarch64 (the Raspberry Pi's architecture) with plain
# onnxruntime and no torch: build a 64-bit Debian userland under qemu-user emulation, install the device
# dependencies from the package index into it, and run a few local training steps on a MobileNet-v1
# x0.25 (K_P=2) bundle exported on this host. Prints the loss of each step; exits non-zero unless it falls.
#
# Needs root (debootstrap, chroot, mounts) and network access to a Debian mirror and the package index.
# Usage: sudo examples/raspberry-pi/prove-on-qemu.sh [BUNDLE]
#   BUNDLE       an exported bundle with portable graphs (default: exported here with HOST_PYTHON)
#   HOST_PYTHON  Python with edgepfl[export] (default: .venv/bin/python, else python3)
#   ARM_ROOT     where the aarch64 system lives; reused by later runs (default: /var/tmp/edgepfl-arm64root)
#   MIRROR       Debian mirror for debootstrap (default: the first one this system's apt sources name)
#   STEPS        training steps to run (default: 5)
#   ORT_SPEC     the onnxruntime requirement inside (default: onnxruntime<1.28; see below)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
ROOT="${ARM_ROOT:-/var/tmp/edgepfl-arm64root}"
STEPS="${STEPS:-5}"
# onnxruntime 1.28 to 1.32 die with SIGSEGV at import under bookworm's qemu-user 7.2 (seen 2026-11);
# 1.27 and older import and train. A real Pi runs the current release; this pin is for the emulator only.
ORT_SPEC="${ORT_SPEC:-onnxruntime<1.28}"
HOST_PYTHON="${HOST_PYTHON:-$REPO/.venv/bin/python}"
[ -x "$HOST_PYTHON" ] || HOST_PYTHON=python3

if [ "$(id -u)" != 0 ]; then
    echo "error: this script needs root (debootstrap, chroot and mounts); run it with sudo" >&2
    exit 77
fi

step() { echo "== $*" >&2; }

if ! command -v qemu-aarch64-static >/dev/null || ! command -v debootstrap >/dev/null; then
    step "installing qemu-user-static, debootstrap, binfmt-support"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static debootstrap binfmt-support >/dev/null
fi
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
update-binfmts --enable qemu-aarch64 2>/dev/null || true
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    echo "error: the kernel has no qemu-aarch64 binfmt handler (reinstall qemu-user-static and binfmt-support)" >&2
    exit 1
fi

if [ ! -x "$ROOT/usr/bin/python3" ]; then
    if [ -z "${MIRROR:-}" ]; then
        MIRROR="$( (grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
            /etc/apt/sources.list.d/ 2>/dev/null || true) | grep -oE 'https?://[^ ]+' | sed -n 1p)"
    fi
    MIRROR="${MIRROR:-http://deb.debian.org/debian}"
    step "debootstrap arm64 bookworm into $ROOT from $MIRROR (a few minutes)"
    rm -rf "$ROOT"
    debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$ROOT" "$MIRROR" >/dev/null
fi

cleanup() {
    for mount in sys dev proc; do
        mountpoint -q "$ROOT/$mount" && umount -l "$ROOT/$mount" || true
    done
}
trap cleanup EXIT
cp /etc/resolv.conf "$ROOT/etc/"
# the host's CA bundle, so that pip inside trusts what pip outside trusts (e.g. a TLS-inspecting proxy)
HOST_CA="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
if [ -f "$HOST_CA" ]; then
    cp "$HOST_CA" "$ROOT/etc/ssl/certs/edgepfl-host-ca.crt"
    CHROOT_CA=/etc/ssl/certs/edgepfl-host-ca.crt
else
    CHROOT_CA=/etc/ssl/certs/ca-certificates.crt
fi
mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
mountpoint -q "$ROOT/dev" || mount --bind /dev "$ROOT/dev"
mountpoint -q "$ROOT/sys" || mount --bind /sys "$ROOT/sys" # without it onnxruntime aborts in cpuinfo

step "copying edgepfl into the aarch64 system"
rm -rf "$ROOT/root/edgepfl" "$ROOT/root/bundle"
mkdir -p "$ROOT/root/edgepfl"
tar -C "$REPO" --exclude='./.venv*' --exclude=./.git --exclude='*/__pycache__' --exclude='*.egg-info' \
    --exclude=./runs --exclude=./bench/out -cf - pyproject.toml README.md edgepfl export device_runtime server \
    | tar -C "$ROOT/root/edgepfl" -xf -

BUNDLE="${1:-}"
if [ -z "$BUNDLE" ]; then
    BUNDLE="$(mktemp -d)/bundle"
    step "exporting mobilenet --width 0.25 --kp 2 (portable) on the host with $HOST_PYTHON"
    (cd "$REPO" && "$HOST_PYTHON" -m edgepfl.cli export mobilenet --width 0.25 --kp 2 --engines portable \
        --out "$BUNDLE" >/dev/null)
fi
cp -r "$BUNDLE" "$ROOT/root/bundle"

step "installing plain onnxruntime and the device dependencies (no torch) inside"
# every variable that names a CA bundle: requests lets REQUESTS_CA_BUNDLE override pip's own setting
env -u PIP_FIND_LINKS PIP_CERT="$CHROOT_CA" REQUESTS_CA_BUNDLE="$CHROOT_CA" SSL_CERT_FILE="$CHROOT_CA" \
    CURL_CA_BUNDLE="$CHROOT_CA" ORT_SPEC="$ORT_SPEC" chroot "$ROOT" /bin/bash -c '
    set -e
    [ -x /root/v/bin/python ] || python3 -m venv /root/v
    /root/v/bin/pip install -q --disable-pip-version-check "$ORT_SPEC" numpy safetensors typer rich httpx pillow
    /root/v/bin/pip install -q --disable-pip-version-check --no-deps /root/edgepfl'

step "training on aarch64 under qemu"
chroot "$ROOT" /root/v/bin/python -u - "$STEPS" <<'PY'
import importlib.util
import platform
import sys
import time

import numpy as np
import onnxruntime

from edgepfl.device_runtime.engine import open_engine, training_build_installed

steps = int(sys.argv[1])
assert importlib.util.find_spec("torch") is None, "torch is installed in the device environment"
print(f"machine {platform.machine()}, python {platform.python_version()}, onnxruntime {onnxruntime.__version__}"
      f" (training build: {training_build_installed()})")
engine = open_engine("/root/bundle", "portable", threads=2)
rng = np.random.default_rng(0)
x = rng.standard_normal((engine.batch_size, *engine.manifest.input.shape)).astype(np.float32)
y = rng.integers(0, engine.manifest.num_classes, engine.batch_size)
losses = []
for index in range(steps):
    start = time.perf_counter()
    losses.append(engine.train_step(x, y, lr=0.05))
    print(f"step {index + 1}: loss {losses[-1]:.4f} ({time.perf_counter() - start:.2f} s)", flush=True)
if platform.machine() != "aarch64" or not losses[-1] < losses[0]:
    sys.exit(f"FAILED: machine {platform.machine()}, losses {losses}")
print(f"loss falling on aarch64: {losses[0]:.4f} -> {losses[-1]:.4f}")
PY
