"""The map of docs/architecture.md holds: the layers contract lists every core module, and no module grows past
450 lines."""

from __future__ import annotations

import subprocess

import tomllib
from conftest import REPO

COMPONENTS = {"cli", "flower", "simulate", "server", "device_runtime", "export"}


def test_the_layers_contract_lists_every_core_module() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = config["tool"]["importlinter"]["contracts"]
    listed = {name.strip().removeprefix("edgepfl.") for layer in contract["layers"] for name in layer.split(":")}
    listed = {part.strip().removeprefix("edgepfl.") for name in listed for part in name.split("|")}
    core = {path.stem for path in (REPO / "edgepfl").glob("*.py") if path.stem != "__init__"}
    core |= {path.parent.name for path in (REPO / "edgepfl").glob("*/__init__.py")}  # packages too
    assert core - COMPONENTS <= listed, f"core modules outside the layers contract: {sorted(core - listed)}"
    assert COMPONENTS <= listed


MAX_MODULE_LINES = 450  # docs/architecture.md: a module that grows past this is split by concern


def test_no_module_outside_tests_and_bench_is_over_450_lines() -> None:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    sources = [REPO / name for name in tracked.stdout.split() if not name.startswith(("tests/", "bench/"))]
    sizes = {path.relative_to(REPO).as_posix(): len(path.read_text(encoding="utf-8").splitlines()) for path in sources}
    assert len(sizes) > 50, "git ls-files found the sources"
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}
