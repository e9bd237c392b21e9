"""The map of docs/architecture.md holds: the layers contract lists every core module, the map names every module,
and no module grows past 450 lines (the browser device's JavaScript included)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import REPO
from stages import FILES, STAGES, StageError, selected, stage_of
from test_device_runtime import DEVICE_BUNDLE, save_npz

from edgepfl.ortbuild import training_build_installed

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
    patterns = ["edgepfl/*.py", "server/*.py", "server/api/*.py", "server/modes/*.py", "server/secure/*.py"]
    patterns += ["export/*.py", "device_runtime/*.py", "device_runtime/web/src/*.js"]
    tracked = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True)
    names = tracked.stdout.split()
    modules = [name for name in names if not name.endswith("/__init__.py") and "/web/test/" not in name]
    assert len(modules) > 150, "git ls-files found the modules"
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [name for name in modules if f"`{name}`" not in text]
    assert missing == [], f"modules docs/architecture.md does not name (as `path`): {missing}"


# A round mode (synchronous, fedbuff, secure) is tested for in its own module under server/modes/ only, or in its own
# package beside it (server/secure/; docs/architecture.md, "How to add a round mode"): a condition that reads one of
# these names is a mode branch.
MODE_WORDS = {"asynchronous", "aggregation", "fedbuff", "secure", "secure_aggregation", "sync"}
# not the engine's: the CLI edge's option models refuse a mode's bad combinations before any engine runs, and the
# status page renders /v1/status's JSON as any client may (a mode's section is shown when the mode put it there)
OPTION_MODULES = {"server/config.py", "server/fleet.py", "server/page.py"}


def _mode_branches(source: str) -> list[int]:
    """The lines of `source` whose condition (if, while, a conditional expression, a comprehension's if) reads a
    mode's name: an attribute, a variable or a string such as "fedbuff"."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            conditions = [node.test]
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            conditions = [test for generator in node.generators for test in generator.ifs]
        else:
            continue
        for condition in conditions:
            parts = list(ast.walk(condition))
            words = {part.attr for part in parts if isinstance(part, ast.Attribute)}
            words |= {part.id for part in parts if isinstance(part, ast.Name)}
            words |= {part.value for part in parts if isinstance(part, ast.Constant) and isinstance(part.value, str)}
            if words & MODE_WORDS:
                found.append(node.lineno)
    return found


def test_the_mode_branch_check_finds_mode_branches() -> None:
    assert _mode_branches("if self.config.fleet_rounds.asynchronous:\n    pass\n") == [1]
    assert _mode_branches("x = None if engine.secure is None else 1\n") == [1]
    assert _mode_branches("y = [r for r in rows if r.aggregation == 'fedbuff']\n") == [1]
    assert _mode_branches("while current is not None and self.closing is None:\n    pass\n") == []
    # the registry reads which mode a configuration runs: the one place outside a mode's module that may
    modes = (REPO / "server" / "modes" / "__init__.py").read_text(encoding="utf-8")
    assert _mode_branches(modes), "the registry's choice of mode is a branch the check sees"


def test_no_server_module_outside_server_modes_branches_on_the_round_mode() -> None:
    server = REPO / "server"
    homes = (server / "modes", server / "secure")  # the modes' modules, and secure aggregation's package
    modules = [path for path in server.rglob("*.py") if not any(home in path.parents for home in homes)]
    assert len(modules) > 30 and (server / "engine.py") in modules and (server / "lifecycle.py") in modules
    branches = {
        f"{path.relative_to(REPO).as_posix()}:{line}"
        for path in modules
        if path.relative_to(REPO).as_posix() not in OPTION_MODULES
        for line in _mode_branches(path.read_text(encoding="utf-8"))
    }
    assert branches == set(), "a round mode's branch belongs in its module under server/modes/ (docs/architecture.md)"


# Secure aggregation in the server is one package (server/secure/, docs/architecture.md): outside it, the registry
# imports its mode and the drivers its device calls (`steps_of`, `SecureSteps`, `end_step`); nothing else of it.
SECURE_PACKAGE = "edgepfl.server.secure"
SECURE_DOORS = {"server/modes/__init__.py": {"edgepfl.server.secure.mode"}}
SECURE_STEPS = "edgepfl.server.secure.steps"


def _secure_imports(source: str) -> set[str]:
    """The modules of the secure package that `source` imports."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {name for name in names if name == SECURE_PACKAGE or name.startswith(SECURE_PACKAGE + ".")}
    return {name for name in found if name.count(".") == 3 or name == SECURE_PACKAGE}


def test_the_secure_import_check_finds_imports_of_the_package() -> None:
    assert _secure_imports("from edgepfl.server.secure.rounds import SecureRounds\n") == {
        "edgepfl.server.secure.rounds"
    }
    assert _secure_imports("import edgepfl.server.secure.store\n") == {"edgepfl.server.secure.store"}
    assert _secure_imports("from edgepfl.server.secure import steps\n") == {SECURE_PACKAGE, SECURE_STEPS}
    assert _secure_imports("from edgepfl.secagg import KeyBook\n") == set()


def test_no_module_outside_server_secure_reaches_into_secure_aggregation() -> None:
    """Outside server/secure/, the sources (and the benchmarks) import its device calls, and the registry its mode;
    its sessions, tables, routes and strategy wrapper are its own."""
    secure = REPO / "server" / "secure"
    folders = [REPO / name for name in ("edgepfl", "server", "device_runtime", "export", "bench")]
    modules = [path for folder in folders for path in folder.rglob("*.py") if secure not in path.parents]
    assert len(modules) > 150 and (REPO / "edgepfl" / "simulate" / "secure.py") in modules
    reaching = {}
    for path in modules:
        name = path.relative_to(REPO).as_posix()
        allowed = {SECURE_STEPS} | SECURE_DOORS.get(name, set())
        found = _secure_imports(path.read_text(encoding="utf-8")) - allowed
        if found:
            reaching[name] = sorted(found)
    assert reaching == {}, "import secure aggregation through server/secure/steps.py (docs/architecture.md)"


def test_the_round_mode_base_and_the_engine_core_have_no_secure_hooks() -> None:
    """The engine core and the round-mode interface name no mode: no secure attribute or hook, and no mode's status
    key in the base (each mode returns its own section, the status view merges them)."""
    import ast

    from edgepfl.server.core import EngineCore
    from edgepfl.server.modes import MODES
    from edgepfl.server.modes.base import Close, DeviceCalls, RoundMode

    for interface in (RoundMode, Close, DeviceCalls, EngineCore):
        names = [name for name in vars(interface) if "secure" in name or "secagg" in name]
        names += [name for name in getattr(interface, "__dataclass_fields__", {}) if "secure" in name]
        assert names == [], f"{interface.__name__} has secure hooks: {names}"
    base = (REPO / "server" / "modes" / "base.py").read_text(encoding="utf-8")
    words = {node.value for node in ast.walk(ast.parse(base)) if isinstance(node, ast.Constant)}
    keys = {mode.name for mode in MODES.values()} | {mode.section for mode in MODES.values()} - {None}
    assert words & keys == set(), "the round-mode base names a mode or its status section"
    assert "secure_aggregation" in keys and "fedbuff" in keys, "the modes' sections are read from the registry"


# A kind of sample (image, next-word, sensor) is one object under edgepfl/kinds/ (docs/architecture.md, "How to add a
# kind of sample"): outside it, code asks the kind (its reader, checks, words...), never which kind it has.
KIND_CLASSES = {"SampleKind", "ImageKind", "NextWordKind", "SensorKind"}


def _kind_branches(source: str) -> list[int]:
    """The lines of `source` that tell kinds apart: a kind's name as a string ("sensor"), a kind's class tested
    with isinstance, or a comparison with a kind class's `name`."""
    import ast

    from edgepfl.kinds import KINDS

    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in KINDS and id(node) not in docstrings:
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
            if {getattr(part, "id", "") for part in ast.walk(node.args[1])} & KIND_CLASSES:
                found.append(node.lineno)
        elif isinstance(node, ast.Compare):
            named = [part for part in ast.walk(node) if isinstance(part, ast.Attribute) and part.attr == "name"]
            if any(getattr(part.value, "id", "") in KIND_CLASSES for part in named):
                found.append(node.lineno)
    return found


def test_the_kind_branch_check_finds_kind_branches() -> None:
    assert _kind_branches("if manifest.kind.name == 'next-word':\n    pass\n") == [1]
    assert _kind_branches("words = {'sensor': 'windows'}\n") == [1]
    assert _kind_branches("if isinstance(kind, (ImageKind, SensorKind)):\n    pass\n") == [1]
    assert _kind_branches("same = kind.name == NextWordKind.name\n") == [1]
    assert _kind_branches('"""Reads next-word text or sensor windows."""\nkind = parse(entry)\n') == []
    registry = (REPO / "edgepfl" / "kinds" / "__init__.py").read_text(encoding="utf-8")
    assert _kind_branches(registry) == [], "the registry names kinds through their classes"
    sensor = (REPO / "edgepfl" / "kinds" / "sensor.py").read_text(encoding="utf-8")
    assert _kind_branches(sensor), "a kind's own module names it: the check sees it"


def test_no_module_outside_the_kinds_branches_on_a_kind_of_sample() -> None:
    """Outside edgepfl/kinds/, no module of the core or the components tells kinds of sample apart."""
    folders = [REPO / name for name in ("edgepfl", "server", "device_runtime", "export")]
    kinds = REPO / "edgepfl" / "kinds"
    modules = [path for folder in folders for path in folder.rglob("*.py") if kinds not in path.parents]
    modules = [path for path in modules if "/web/" not in path.as_posix()]  # the page's fixture writers are tests
    assert len(modules) > 150 and (REPO / "edgepfl" / "data.py") in modules
    branches = {
        f"{path.relative_to(REPO).as_posix()}:{line}"
        for path in modules
        for line in _kind_branches(path.read_text(encoding="utf-8"))
    }
    assert branches == set(), "a kind's branch belongs in its module under edgepfl/kinds/ (docs/architecture.md)"


# The page's kinds of sample (device_runtime/web/src/kinds.js), the twins of edgepfl/kinds/ by name: a kind's name is
# written in its own module (kind_NAME.js) only; any other module that names one (a literal, or a key of a lookup by
# kind) branches on it.
PAGE = REPO / "device_runtime" / "web"


def _page_kind_names(*paths: Path) -> list[tuple[str, int, str]]:
    """Where page modules name a kind: (file, line, text), by TypeScript's parser (test/kind_branches.mjs)."""
    if shutil.which("node") is None or not (PAGE / "node_modules" / "typescript").is_dir():
        pytest.skip("node and the page's node_modules are needed (npm ci --prefix device_runtime/web)")
    from edgepfl.kinds import KINDS

    command = ["node", "test/kind_branches.mjs", ",".join(KINDS), *map(str, paths)]
    done = subprocess.run(command, cwd=PAGE, capture_output=True, text=True, check=True)
    return [tuple(found) for found in json.loads(done.stdout)]


def test_the_page_kind_check_finds_a_branch_on_a_kind(tmp_path: Path) -> None:
    planted = tmp_path / "planted.js"
    planted.write_text(
        "const unit = { image: 'images', 'next-word': 'words' }[kind];\n"
        "if (manifest.task.kind === `sensor`) {}\n"
        "const accept = 'image/*'; // 'sensor', a comment\n"
        "const quoted = /'image'/;\n",
        encoding="utf-8",
    )
    lines = [line for _, line, _ in _page_kind_names(planted)]
    assert lines == [1, 1, 2]
    kinds = {path.name: [text for _, _, text in _page_kind_names(path)] for path in (PAGE / "src").glob("kind_*.js")}
    from edgepfl.kinds import KINDS

    assert sorted(text.strip("'") for found in kinds.values() for text in found) == sorted(KINDS), kinds


def test_no_page_module_outside_the_kinds_names_a_kind() -> None:
    """A kind of sample is one module of the page plus one line of kinds.js (docs/architecture.md)."""
    src = PAGE / "src"
    modules = sorted(path for path in src.glob("*.js") if not path.name.startswith("kind_"))
    assert len(modules) > 40 and src / "app.js" in modules and src / "kinds.js" in modules
    assert _page_kind_names(*modules) == [], "a kind's words and ways belong in its module, kind_NAME.js"


@pytest.mark.skipif(not training_build_installed(), reason="needs onnxruntime-training-cpu")
def test_a_device_command_loads_no_torch_even_where_torch_is_installed(bundle_factory, tmp_path):
    """onnxruntime's training build imports torch when it is imported (and torch says "No CUDA runtime is found"
    on a machine without one): a device command keeps it out, and its stderr holds no such line. (It needs torch
    installed, so it runs in the main stage, not with the other device tests in scripts/device-env.sh.)"""
    pytest.importorskip("torch")
    bundle = bundle_factory(**DEVICE_BUNDLE)
    data = save_npz(tmp_path / "d.npz", (0, 1, 2), 90)
    args = [
        "device",
        "train",
        "--bundle",
        str(bundle),
        "--data",
        str(data),
        "--state",
        str(tmp_path / "state"),
        "--epochs",
        "1",
        "--engine",
        "ort-training",
        "--json",
    ]
    code = f"""
import sys
from edgepfl.cli import app
sys.argv = {["edgepfl", *args]!r}
try:
    app()
except SystemExit as exit:
    assert not exit.code, exit.code
print('torch' in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and '"engine": "ort-training"' in done.stdout, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False" and "CUDA" not in done.stderr, done.stderr[-3000:]
    helped = subprocess.run(
        [sys.executable, "-m", "edgepfl.cli", "device", "--help"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert helped.returncode == 0 and helped.stderr == ""


def test_every_test_has_one_stage_and_one_no_stage_runs_fails_the_collection():
    """tests/stages.py: a test belongs to exactly one stage of the full run; a browser test outside the files
    scripts/web-env.sh runs, or a test in a browser file without the mark, would run nowhere and is refused."""
    assert stage_of("test_x.py", set(), set()) == "main"
    assert stage_of("test_x.py", set(), {"slow"}) == "main"
    assert stage_of("test_x.py", set(), {"arm"}) == "arm"
    assert stage_of("test_portable.py", {"portable_case"}, set()) == "portable"
    assert stage_of("test_portable.py", {"case_bundle"}, set()) == "main"
    assert stage_of("test_device_e2e.py", {"bundle"}, set()) == "device"
    assert stage_of("test_web_capture.py", set(), {"browser"}) == "browser"
    with pytest.raises(StageError, match="add the file to BROWSER_FILES"):
        stage_of("test_x.py", set(), {"browser"})
    with pytest.raises(StageError, match="mark it"):
        stage_of("test_web_browser.py", set(), set())
    assert [selected(None, owner) for owner in STAGES] == [True] * len(STAGES)
    assert [selected("device", owner) for owner in STAGES] == [owner == "device" for owner in STAGES]


def test_the_full_run_and_the_stages_scripts_name_the_same_files():
    """The env scripts take their files from tests/stages.py, and every file it names exists."""
    for stage, files in FILES.items():
        assert all((REPO / "tests" / name).is_file() for name in files), stage
        printed = subprocess.run(
            [sys.executable, "tests/stages.py", stage], capture_output=True, text=True, check=True, cwd=REPO
        )
        assert printed.stdout.split() == [f"tests/{name}" for name in files]
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/full-run.sh" in ci and "bash scripts/full-run.sh" in (REPO / "README.md").read_text()
