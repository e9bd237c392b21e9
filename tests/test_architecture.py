"""The map of docs/architecture.md holds: the layers contract lists every core module."""

from __future__ import annotations

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
