"""Check the import layers of pyproject.toml's [tool.importlinter] contract (run by the test command).

The components live in top-level folders mapped into the `edgepfl` namespace by `[tool.setuptools] package-dir`
(`server/` is `edgepfl.server`), which import-linter, walking the `edgepfl/` folder, cannot see. So this builds
a view of the installed layout, one symbolic link per mapped folder, and runs `lint-imports` on that view.

Usage: python scripts/lint_imports.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    mapping = config["tool"]["setuptools"]["package-dir"]
    with tempfile.TemporaryDirectory(prefix="edgepfl-layers-") as view:
        package = Path(view) / "edgepfl"
        package.mkdir()
        for entry in (ROOT / mapping["edgepfl"]).iterdir():
            (package / entry.name).symlink_to(entry)
        for name, folder in sorted(mapping.items()):
            parts = name.split(".")
            if len(parts) != 2:  # edgepfl itself, and packages nested in a mapped folder (they come with it)
                continue
            target = package / parts[1]
            if target.is_symlink():
                target.unlink()
            target.symlink_to(ROOT / folder)
        lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
        env = {**os.environ, "PYTHONPATH": view}
        return subprocess.call([lint, "--config", str(ROOT / "pyproject.toml")], cwd=view, env=env)


if __name__ == "__main__":
    sys.exit(main())
