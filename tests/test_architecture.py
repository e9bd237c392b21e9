"""The map of docs/architecture.md holds: the layers contract lists every core module, the map names every module,
and no module grows past 450 lines (the browser device's JavaScript included)."""

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


WEB = REPO / "device_runtime" / "web"


def test_no_module_of_the_browser_device_is_over_450_lines() -> None:
    """The page's JavaScript under the Python's limit (its tests under none, as tests/ is not counted)."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.js", "*.mjs", "*.mts"], cwd=WEB, capture_output=True, text=True, check=True
    )
    sources = [WEB / name for name in tracked.stdout.split() if not name.startswith("test/")]
    sizes = {path.relative_to(REPO).as_posix(): len(path.read_text(encoding="utf-8").splitlines()) for path in sources}
    assert len(sizes) > 20, "git ls-files found the page's modules"
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_the_map_names_every_module() -> None:
    """docs/architecture.md names each module of the core and the components by its path, and each of the page's."""
    patterns = ["edgepfl/*.py", "server/*.py", "export/*.py", "device_runtime/*.py", "device_runtime/web/src/*.js"]
    tracked = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True)
    names = tracked.stdout.split()
    modules = [name for name in names if not name.endswith("/__init__.py") and "/web/test/" not in name]
    assert len(modules) > 150, "git ls-files found the modules"
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [name for name in modules if f"`{name}`" not in text]
    assert missing == [], f"modules docs/architecture.md does not name (as `path`): {missing}"
