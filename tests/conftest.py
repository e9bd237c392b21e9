"""Shared fixtures: small bundles exported once per test session."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from stages import STAGE_ENV, STAGES, StageError, selected, stage_of

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


BUNDLES_ENV = "EDGEPFL_TEST_BUNDLES"  # one folder of bundles for a whole run: its workers, and the stages without torch


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Give every test its one stage of the full run (tests/stages.py); with EDGEPFL_STAGE set keep only that
    stage's. A test that no stage would run fails the collection, naming it."""
    stage = os.environ.get(STAGE_ENV) or None
    if stage is not None and stage not in STAGES:
        raise pytest.UsageError(f"{STAGE_ENV}={stage} is not a stage; use one of {', '.join(STAGES)}")
    kept, dropped = [], []
    for item in items:
        try:
            owner = stage_of(item.path.name, set(item.fixturenames), {mark.name for mark in item.iter_markers()})
        except StageError as error:
            raise pytest.UsageError(f"{item.nodeid}: {error}") from None
        (kept if selected(stage, owner) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def bundle_folder(
    root: str | Path, name: str, kp: int | str, engines: tuple[str, ...], seed: int, distill: bool = False, **fields
) -> Path:
    """Where a bundle made with these arguments lives under `root` (one folder per argument set); `kp`: --kp K
    or a --personal spec."""
    parts = [name, f"kp{kp}", "+".join(engines), f"seed{seed}", *(f"{k}{v}" for k, v in sorted(fields.items()))]
    parts += ["distill"] if distill else []
    return Path(root) / "-".join(parts)


def export_test_bundle(
    out: Path, name: str, kp: int | str, engines: tuple[str, ...], seed: int, distill: bool = False, **fields
) -> Path:
    """Export a zoo model into `out` (needs torch)."""
    import torch

    from edgepfl.export.bundle import ExportOptions, export_bundle
    from edgepfl.export.models import ModelSpec, default_spec

    spec = ModelSpec(**{**default_spec(name).to_dict(), **fields})
    torch.set_num_threads(2)
    export_bundle(spec, kp, out, ExportOptions(engines=engines, seed=seed, force=True, distill=distill))
    return out


@pytest.fixture(scope="session")
def bundle_factory(tmp_path_factory):
    """export(name, kp, engines=..., **spec fields) -> bundle path, cached per argument set.

    With EDGEPFL_TEST_BUNDLES set, bundles are read from (or, where torch is installed, written to)
    that folder, so the device tests also run in an environment without torch
    (scripts/device-env.sh exports them first); a bundle missing there fails instead of skipping.
    """
    shared = os.environ.get(BUNDLES_ENV)
    cache: dict[tuple, Path] = {}

    def export(
        name: str,
        kp: int | str,
        engines: tuple[str, ...] = ("ort-training",),
        seed: int = 0,
        distill: bool = False,
        **fields,
    ):
        key = bundle_key(name, kp, engines, seed, distill, **fields)
        if key in cache:
            return cache[key]
        if shared and (bundle_folder(shared, name, kp, engines, seed, distill, **fields) / "manifest.json").is_file():
            cache[key] = bundle_folder(shared, name, kp, engines, seed, distill, **fields)
            return cache[key]
        if importlib.util.find_spec("torch") is None:
            if shared:
                pytest.fail(f"{BUNDLES_ENV}={shared} has no bundle for {key}; export it first (scripts/device-env.sh)")
            pytest.skip("exporting a bundle needs torch (pip install 'edgepfl[export]')")
        if shared:
            cache[key] = export_shared_bundle(shared, key)
        else:
            out = tmp_path_factory.mktemp(f"bundle-{name}-kp{kp}")
            cache[key] = export_test_bundle(out, name, kp, engines, seed, distill, **fields)
        return cache[key]

    return export


def bundle_key(
    name: str,
    kp: int | str,
    engines: tuple[str, ...] = ("ort-training",),
    seed: int = 0,
    distill: bool = False,
    **fields,
) -> tuple:
    """The arguments of a test bundle as one hashable value (`bundle_factory`'s defaults)."""
    return (name, kp, tuple(engines), seed, distill, tuple(sorted(fields.items())))


def export_shared_bundle(root: str | Path, key: tuple) -> Path:
    """Export the bundle `key` names under `root` once for every worker and stage of a run: the first one exports
    under a lock (into a scratch folder renamed into place), the others wait and read it."""
    from filelock import FileLock

    name, kp, engines, seed, distill, fields = key
    out = bundle_folder(root, name, kp, engines, seed, distill, **dict(fields))
    with FileLock(f"{out}.lock"):
        if not (out / "manifest.json").is_file():
            scratch = out.with_name(out.name + ".partial")
            export_test_bundle(scratch, name, kp, engines, seed, distill, **dict(fields))
            shutil.rmtree(out, ignore_errors=True)  # what a run stopped halfway left
            scratch.rename(out)
    return out


def write_stand_in_digits(
    path: Path, classes: int = 10, side: int = 28, train: int = 600, test: int = 200, noise: float = 40.0
) -> Path:
    """An .npz of learnable stand-in digits (x_train, y_train, x_test, y_test; uint8 side x side): a fixed random
    prototype per class plus seeded noise, labels cycling through the classes."""
    rng = np.random.default_rng(0)
    prototypes = rng.integers(0, 256, (classes, side, side))

    def digits(labels: np.ndarray) -> np.ndarray:
        return np.clip(prototypes[labels] + rng.normal(0, noise, (len(labels), side, side)), 0, 255).astype(np.uint8)

    y_train, y_test = np.arange(train) % classes, np.arange(test) % classes
    np.savez(path, x_train=digits(y_train), y_train=y_train, x_test=digits(y_test), y_test=y_test)
    return path


@pytest.fixture(scope="session")
def stand_in_digits(tmp_path_factory) -> Path:
    """600 + 200 stand-in 28x28 digits of 10 classes (`write_stand_in_digits`), written once per session."""
    return write_stand_in_digits(tmp_path_factory.mktemp("digits") / "tiny.npz")


def run_without_torch(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run Python code in a subprocess where `import torch` fails, as on a device."""
    prelude = "import sys; sys.modules['torch'] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
