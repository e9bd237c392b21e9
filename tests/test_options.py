"""Options are typed models: every flag of serve, simulate, export, device and demo comes from one field, and bad
values are one line."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from edgepfl.cli import app
from edgepfl.errors import UsageError
from edgepfl.options import Leaf, leaves, validated
from edgepfl.server.config import ServeCommand, ServerConfig
from edgepfl.simulate.config import SimulateConfig


def _params(*names: str) -> dict:
    command = typer.main.get_command(app)
    for name in names:
        command = command.commands[name]  # type: ignore[attr-defined]
    return {option: param for param in command.params for option in param.opts + param.secondary_opts}


def _assert_leaves_are_flags(params: dict, tree: list[Leaf]) -> None:
    """Every leaf is a flag whose default and help come from its field (a comma list shows its text)."""
    assert tree
    for leaf in tree:
        flag = leaf.name if leaf.name in params else leaf.flag  # a positional argument goes by its name
        assert flag in params, f"{leaf.name} has no flag {leaf.flag}"
        param = params[flag]
        if not isinstance(leaf.default, tuple):
            assert param.default == leaf.default, leaf.flag
        if flag == leaf.flag:  # (click 8.5 drops a Typer argument's help)
            assert (leaf.info.description or "") in (param.help or ""), leaf.flag


def test_every_serve_option_is_a_flag_with_the_models_default_and_help() -> None:
    tree = leaves(ServeCommand)
    _assert_leaves_are_flags(_params("serve"), tree)
    names = {leaf.name for leaf in tree}
    assert {"epochs", "dp_clip", "hn_lr", "trim_fraction", "retain_top_k", "read_timeout", "port"} <= names
    assert "enroll_secret" not in names, "a hidden field is set by the program, never by a flag"


def test_every_simulate_option_is_a_flag_that_shows_the_models_default() -> None:
    tree = leaves(SimulateConfig)
    _assert_leaves_are_flags(_params("simulate"), tree)
    by_name = {leaf.name: leaf for leaf in tree}
    assert by_name["epochs"].default == 4 and by_name["batch_size"].default == 128, "simulate's own defaults"
    assert by_name["distill_lambdas"].flag == "--distill-lambdas"
    assert "trainable" not in by_name and "distill_trainable" not in by_name


def test_a_command_lists_no_option_by_hand() -> None:
    """Every option of serve, simulate, export, partition, plot, demo and the device commands is a model leaf."""
    from edgepfl.device_runtime import options as device
    from edgepfl.export.options import ExportCommand
    from edgepfl.simulate.config import PartitionCommand
    from edgepfl.simulate.demo import DemoOptions
    from edgepfl.simulate.plots import PlotOptions

    commands = {
        ("serve",): ServeCommand,
        ("simulate",): SimulateConfig,
        ("export",): ExportCommand,
        ("partition",): PartitionCommand,
        ("plot",): PlotOptions,
        ("demo",): DemoOptions,
        ("device", "enroll"): device.EnrollCommand,
        ("device", "run"): device.RunCommand,
        ("device", "train"): device.TrainCommand,
        ("device", "teacher"): device.TeacherCommand,
        ("device", "distill"): device.DistillCommand,
        ("device", "eval"): device.EvalCommand,
        ("device", "predict"): device.PredictCommand,
        ("device", "export-model"): device.ExportModelCommand,
    }
    for names, model in commands.items():
        params = _params(*names)
        flags = {leaf.flag for leaf in leaves(model)} | {"--help", "--config"}
        visible = {opt for opt, param in params.items() if opt.startswith("--") and not getattr(param, "hidden", False)}
        positional = {param.name for param in params.values() if not param.opts[0].startswith("-")}
        assert visible - {f"--no-{flag[2:]}" for flag in flags} <= flags, (names, visible - flags)
        assert positional <= {leaf.name for leaf in leaves(model)}, names


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--rounds", "0"], "error: --rounds 0: input should be greater than or equal to 1 (pass e.g. --rounds 100)"),
        (["--strategy", "fedprox"], "error: --strategy 'fedprox' is unknown (use one of: fedavg, fedper,"),
        (["--client-update", "sgd"], "error: --client-update 'sgd' is unknown (use one of: fedsim, fedalt, local)"),
        (["--batch-size", "2000000"], "error: --batch-size 2000000: input should be less than or equal to 1048576"),
        (["--strategy", "trimmed-mean", "--trim-fraction", "0.5"], "error: --trim-fraction 0.5: input should be less"),
        (["--clip-multiple", "0.5"], "error: --clip-multiple 0.5: must be 0 (off) or at least 1"),
        (["--forwarded-allow-ips", "proxy"], "error: --forwarded-allow-ips 'proxy': 'proxy' is not an IP address"),
        (["--port", "70000"], "error: --port 70000: input should be less than or equal to 65535"),
        (["--upload-encoding", "int4"], "error: --upload-encoding 'int4': unknown encoding 'int4'"),
        (["--download-encoding", "int8"], "error: --download-encoding 'int8' is unknown (use one of: fp32, fp16)"),
        (["--dp-noise-multiplier", "1"], "error: --dp-noise-multiplier and --dp-clip go together"),
        (["--dp-delta", "1"], "error: --dp-delta 1.0: input should be less than 1"),
        (
            ["--dp-noise-multiplier", "1", "--dp-clip", "1", "--strategy", "median"],
            "error: differential privacy cannot run with --strategy median: the median is not a sum",
        ),
        (["--download-encoding", "fp16", "--share-bn-stats"], "error: --download-encoding fp16 cannot carry the"),
    ],
)
def test_a_bad_serve_value_is_one_line_naming_the_flag(tmp_path, args, line) -> None:
    result = CliRunner().invoke(app, ["serve", "--bundle", str(tmp_path), "--state", str(tmp_path / "s"), *args])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(line), result.output
    assert not (tmp_path / "s").exists(), "a refused start leaves no state behind"


def test_a_bad_value_names_the_config_file_key_or_the_flag_that_gave_it(tmp_path) -> None:
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"out": str(tmp_path / "run"), "rounds": 0, "fraction": 0.5}))
    runner = CliRunner()
    from_file = runner.invoke(app, ["simulate", "--config", str(config)])
    assert from_file.exit_code == 2 and from_file.output.count("\n") == 1, from_file.output
    assert from_file.output.startswith(f"error: {config}: rounds 0: input should be greater than or equal to 1")
    from_flag = runner.invoke(app, ["simulate", "--config", str(config), "--rounds", "3", "--fraction", "2"])
    assert from_flag.output.startswith("error: --fraction 2.0: input should be less than or equal to 1"), from_flag
    split = runner.invoke(app, ["simulate", "--out", str(tmp_path / "x"), "--split", "0.5,0.5"])
    assert split.exit_code == 2 and "is not three fractions summing to 1" in split.output, split.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "x").exists()


def test_a_strategy_owns_its_options_and_simulate_reads_them() -> None:
    from edgepfl.server.strategies import strategy_options
    from edgepfl.server.strategies.heurpfedla import HeurPFedLAOptions
    from edgepfl.server.strategies.pfedla import PFedLAOptions

    assert SimulateConfig().strategy_knobs.hn_lr == PFedLAOptions().hn_lr == strategy_options("pfedla").hn_lr
    assert SimulateConfig().strategy_knobs.retain_top_k == HeurPFedLAOptions().retain_top_k
    with pytest.raises(UsageError, match=r"--retain-top-k 0: input should be greater than or equal to 1"):
        validated(SimulateConfig, {"retain_top_k": 0})
    with pytest.raises(UsageError, match="unknown option 'colour'"):
        validated(ServerConfig, {"bundle": ".", "state": ".", "colour": "red"})


def test_simulate_has_every_option_of_the_strategies_it_runs_but_their_cohort() -> None:
    """A new option in a strategy's `Options` is a simulate flag (and reaches the strategy) with no simulate change."""
    from edgepfl.server.strategies import STRATEGIES
    from edgepfl.simulate.config import ALGORITHMS, StrategyKnobs

    expected = {}
    for name in {plan.strategy for plan in ALGORITHMS.values() if plan.strategy is not None}:
        strategy = STRATEGIES[name]
        expected |= {key: info.description for key, info in strategy.Options.model_fields.items()}
        expected.pop(strategy.cohort_option, None)
    assert {key: info.description for key, info in StrategyKnobs.model_fields.items()} == expected
    config = validated(SimulateConfig, {"algorithm": "heurpfedla", "hn_lr": 0.02, "retain_top_k": 2})
    chosen = config.server_options()["strategy"]
    assert (chosen.name, chosen.hn_lr, chosen.retain_top_k) == ("heurpfedla", 0.02, 2)
    with pytest.raises(UsageError, match="--trim-fraction applies to --strategy trimmed-mean, not fedper"):
        validated(ServerConfig, {"bundle": ".", "state": ".", "trim_fraction": 0.2})
    chosen = validated(ServerConfig, {"bundle": ".", "state": ".", "strategy": "trimmed-mean", "trim_fraction": 0.2})
    assert chosen.strategy.name == "trimmed-mean" and chosen.strategy.trim_fraction == 0.2


def test_flat_keys_round_trip_through_the_tree() -> None:
    """results.json and config files hold flat keys; the config is a tree of the parts' models."""
    from edgepfl.options import flatten

    config = validated(SimulateConfig, {"epochs": 2, "dp_noise_multiplier": 1.0, "dp_clip": 0.5, "hn_lr": 0.1})
    assert (config.round.epochs, config.privacy.dp_clip, config.strategy_knobs.hn_lr) == (2, 0.5, 0.1)
    assert validated(SimulateConfig, flatten(config)) == config
    assert flatten(config)["distill_lambdas"] == list(config.distill.lambdas)


def test_export_device_and_demo_flags_come_from_their_models() -> None:
    from edgepfl.device_runtime import options as device
    from edgepfl.device_runtime.persfl import DistillConfig
    from edgepfl.export.options import ExportCommand
    from edgepfl.simulate.demo import DemoOptions

    _assert_leaves_are_flags(_params("export"), leaves(ExportCommand))
    _assert_leaves_are_flags(_params("demo"), leaves(DemoOptions))
    for name, model in (
        ("run", device.RunCommand),
        ("train", device.TrainCommand),
        ("teacher", device.TeacherCommand),
        ("distill", device.DistillCommand),
        ("eval", device.EvalCommand),
    ):
        _assert_leaves_are_flags(_params("device", name), leaves(model))
    assert device.DistillOptions().config(seed=0) == DistillConfig(), "device distill's defaults are DistillConfig's"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["run", "--retries", "0"], "error: --retries 0: input should be greater than or equal to 1 (pass e.g. --ret"),
        (["run", "--poll-interval", "nan"], "error: --poll-interval nan: input should be a finite number"),
        (["run", "--rounds", "0"], "error: --rounds 0: input should be greater than or equal to 1"),
        (["run", "--engine", "tflite"], "error: --engine 'tflite' is unknown (use one of: auto, ort-training, port"),
        (["train", "--val-fraction", "1"], "error: --val-fraction 1.0: input should be less than 1"),
        (["train", "--trainable", "head"], "error: --trainable 'head' is unknown (use one of: full, personal, base)"),
        (["train", "--lr", "-1"], "error: --lr -1.0: input should be greater than 0"),
        (["distill", "--lambdas", "0.1,x"], "error: --lambdas"),
        (["distill", "--variant", "xx"], "error: --variant 'xx' is unknown (use one of: kd, gd)"),
        (["teacher", "--timeout", "0"], "error: --timeout 0.0: input should be greater than 0"),
    ],
)
def test_a_bad_device_value_is_one_line_naming_the_flag(tmp_path, args, line) -> None:
    command, *rest = args
    required = {
        "run": ["--server", "http://127.0.0.1:9", "--token", "t"],
        "teacher": ["--server", "http://127.0.0.1:9", "--token", "t"],
    }.get(command, [])
    state = tmp_path / "state"
    base = ["--bundle", str(tmp_path), "--data", str(tmp_path / "d.npz"), "--state", str(state)]
    result = CliRunner().invoke(app, ["device", command, *base, *required, *rest])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(line), result.output
    assert not state.exists(), "a refused command leaves no state behind"
