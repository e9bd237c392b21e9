"""The aarch64 proof: the portable engine trains under qemu-user emulation with plain onnxruntime, no torch.

Marked `arm` (not in the default run: it needs root, network and minutes). Run it with `pytest -m arm`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "raspberry-pi" / "prove-on-qemu.sh"

pytestmark = pytest.mark.arm


def test_portable_engine_trains_on_aarch64_under_qemu(bundle_factory):
    if os.name != "posix" or os.geteuid() != 0:
        pytest.skip("needs root (debootstrap, chroot, mounts)")
    if not (shutil.which("qemu-aarch64-static") or shutil.which("apt-get")):
        pytest.skip("needs qemu-user-static, or apt-get to install it")
    bundle = bundle_factory("mobilenet", 2, engines=("portable",), width=0.25)
    result = subprocess.run(
        ["bash", str(SCRIPT), str(bundle)],
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, "STEPS": "4"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "machine aarch64" in result.stdout and "training build: False" in result.stdout
    assert "loss falling on aarch64" in result.stdout, result.stdout
