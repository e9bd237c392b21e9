"""Which stage of the full run runs each test: exactly one, so no test runs twice and none is left out.

The full run (`scripts/full-run.sh`, what `.ci/run` calls) has four pytest stages:

- `main`: the development environment (torch, the training build), every test not owned by another stage;
  `-m "not slow"` of it is the gate (`scripts/gate.sh`).
- `portable`: `scripts/portable-env.sh`, plain onnxruntime and no torch: the tests of test_portable.py that take
  the `portable_case` fixture (PyTorch's results come from a case folder made beforehand).
- `device`: `scripts/device-env.sh`, the device's dependencies and no torch: the files in DEVICE_FILES.
- `browser`: `scripts/web-env.sh`, a real chromium: the tests marked `browser`, which live in BROWSER_FILES.

Tests marked `arm` run by hand only (`pytest -m arm`: they need root, qemu and a Debian mirror).
conftest.py asks `stage_of` for every collected test; with EDGEPFL_STAGE set (the full run sets it) a stage keeps
only its own tests, and a test no stage can run fails the collection.

`python tests/stages.py device` prints a stage's files, for the scripts.
"""

from __future__ import annotations

import sys

STAGE_ENV = "EDGEPFL_STAGE"
STAGES = ("main", "portable", "device", "browser", "arm")
PORTABLE_FILES = ("test_portable.py",)
DEVICE_FILES = ("test_device_runtime.py", "test_device_e2e.py")
BROWSER_FILES = ("test_web_browser.py", "test_web_capture.py", "test_secagg_browser.py")
FILES = {"portable": PORTABLE_FILES, "device": DEVICE_FILES, "browser": BROWSER_FILES}


class StageError(Exception):
    """A test that no stage of the full run would run."""


def stage_of(file: str, fixtures: set[str] | list[str], markers: set[str]) -> str:
    """The one stage that runs a test in `file` (a name like test_x.py) taking `fixtures`, marked `markers`."""
    if "arm" in markers:
        return "arm"
    if "browser" in markers:
        if file not in BROWSER_FILES:
            raise StageError(
                f"{file} has a test marked browser, but scripts/web-env.sh runs only {', '.join(BROWSER_FILES)}: "
                "add the file to BROWSER_FILES in tests/stages.py"
            )
        return "browser"
    if file in BROWSER_FILES:
        raise StageError(f"{file} is a browser file but has a test not marked browser: mark it, or move the test")
    if file in DEVICE_FILES:
        return "device"
    if file in PORTABLE_FILES and "portable_case" in fixtures:
        return "portable"
    return "main"


def selected(stage: str | None, owner: str) -> bool:
    """Whether a run of `stage` keeps a test of `owner`. None is a developer's plain pytest: it keeps every test
    (pytest's `-m` in pyproject.toml leaves out `arm` and `browser`; with torch the portable and device tests make
    their own case and bundles)."""
    return stage is None or owner == stage


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in FILES:
        sys.exit(f"usage: python tests/stages.py {{{'|'.join(FILES)}}}")
    print(" ".join(f"tests/{name}" for name in FILES[sys.argv[1]]))
