"""Options are typed models: every flag of serve, simulate, export, device and demo comes from one field, and bad
values are one line."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from edgepfl.cli import app
from edgepfl.errors import UsageError
from edgepfl.options import flag_name, validated
from edgepfl.server.config import HttpLimits, Listen, PrivacyOptions, RoundOptions, ServerConfig, StrategyOptions
from edgepfl.simulate.config import SimulateConfig

NOT_FLAGS = {"bundle", "state", "enroll_secret", "strategy_options", "settings", "seed", "privacy"}


def _params(name: str) -> dict:
    subcommand = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {option: param for param in subcommand.params for option in param.opts + param.secondary_opts}


@pytest.mark.parametrize("model", [ServerConfig, RoundOptions, StrategyOptions, PrivacyOptions, HttpLimits, Listen])
def test_every_serve_option_is_a_flag_with_the_models_default_and_help(model) -> None:
    params = _params("serve")
    for name, info in model.model_fields.items():
        if name in NOT_FLAGS:
            continue
        flag = flag_name(model, name).split("/")[0]
        assert flag in params, f"{model.__name__}.{name} has no serve flag {flag}"
        param = params[flag]
        if name != "forwarded_allow_ips":  # a comma list on the command line, a tuple in the model
            assert param.default == info.get_default(call_default_factory=True), flag
        assert info.description and info.description in (param.help or ""), flag


def test_every_simulate_option_is_a_flag_that_shows_the_models_default() -> None:
    params = _params("simulate")
    for name, info in SimulateConfig.model_fields.items():
        flag = flag_name(SimulateConfig, name)
        assert flag in params, f"SimulateConfig.{name} has no simulate flag {flag}"
        assert params[flag].default is None, "a left-out flag must let the --config file's value apply"
        assert info.description and info.description in (params[flag].help or ""), flag


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--rounds", "0"], "error: --rounds 0: input should be greater than or equal to 1 (pass e.g. --rounds 100)"),
        (["--strategy", "fedprox"], "error: --strategy 'fedprox' is unknown (use one of: fedavg, fedper,"),
        (["--client-update", "sgd"], "error: --client-update 'sgd' is unknown (use one of: fedsim, fedalt, local)"),
        (["--batch-size", "2000000"], "error: --batch-size 2000000: input should be less than or equal to 1048576"),
        (["--trim-fraction", "0.5"], "error: --trim-fraction 0.5: input should be less than 0.5"),
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
    from edgepfl.server.strategies.heurpfedla import HeurPFedLAOptions
    from edgepfl.server.strategies.pfedla import PFedLAOptions

    assert SimulateConfig.model_fields["hn_lr"] is not None
    assert SimulateConfig().hn_lr == PFedLAOptions().hn_lr == StrategyOptions().hn_lr
    assert SimulateConfig().retain_top_k == HeurPFedLAOptions().retain_top_k
    with pytest.raises(UsageError, match=r"--retain-top-k 0: input should be greater than or equal to 1"):
        validated(SimulateConfig, {"retain_top_k": 0})
    with pytest.raises(UsageError, match="unknown option 'colour'"):
        validated(ServerConfig, {"bundle": ".", "state": ".", "colour": "red"})


def _device_params(name: str) -> dict:
    group = typer.main.get_command(app).commands["device"]  # type: ignore[attr-defined]
    command = group.commands[name]  # type: ignore[attr-defined]
    return {option: param for param in command.params for option in param.opts + param.secondary_opts}


def _assert_flags_carry_fields(params: dict, model, skip: set[str] = frozenset()) -> None:
    """Each field of `model` is a flag whose default and help come from the field (a comma list shows none)."""
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        flag = flag_name(model, name)
        assert flag in params, f"{model.__name__}.{name} has no flag {flag}"
        default = info.get_default(call_default_factory=True)
        if not isinstance(default, tuple):
            assert params[flag].default == default, flag
        assert info.description and info.description in (params[flag].help or ""), flag


def test_export_device_and_demo_flags_come_from_their_models() -> None:
    from edgepfl.device_runtime.options import (
        ConnectionOptions,
        DeviceOptions,
        DistillOptions,
        LocalOptions,
        TrainOptions,
    )
    from edgepfl.export.options import ExportOptions
    from edgepfl.simulate.demo import DemoOptions

    _assert_flags_carry_fields(_params("export"), ExportOptions, skip={"portable_batch"})
    _assert_flags_carry_fields(_params("demo"), DemoOptions, skip={"round_timeout"})
    for command in ("run", "train", "teacher", "distill", "eval"):
        _assert_flags_carry_fields(_device_params(command), LocalOptions)
    _assert_flags_carry_fields(_device_params("run"), ConnectionOptions)
    _assert_flags_carry_fields(_device_params("teacher"), ConnectionOptions)
    _assert_flags_carry_fields(_device_params("run"), DeviceOptions, skip={"seed"})
    _assert_flags_carry_fields(_device_params("train"), TrainOptions)
    _assert_flags_carry_fields(_device_params("distill"), DistillOptions)
    from edgepfl.device_runtime.persfl import DistillConfig

    assert DistillOptions().config(seed=0) == DistillConfig(), "device distill's defaults are DistillConfig's"


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
