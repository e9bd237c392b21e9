"""The browser device's contract (device_runtime/contract.py) says what the Python device does, read from its code."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Annotated, Literal

import pytest
from conftest import REPO
from pydantic import Field

from edgepfl.device_runtime.algorithms import CLIENT_ALGORITHMS, DIVERGED_LOSS_FACTOR, FINETUNE, round_phases
from edgepfl.device_runtime.client import ROUND_GONE_ERRORS, RetryPolicy
from edgepfl.device_runtime.contract import (
    CONTRACT_VERSION,
    MIN_HELD_OUT,
    MIN_TRAIN_EXAMPLES,
    device_contract,
    settings_fields,
)
from edgepfl.device_runtime.model_metadata import METADATA_KEYS, model_file_contract
from edgepfl.device_runtime.options import DeviceOptions, LocalOptions
from edgepfl.device_runtime.runner import MAX_WAIT
from edgepfl.options import bounds_of
from edgepfl.protocol import ALGORITHMS, API_PREFIX, DOWNLOAD_ENCODINGS, RoundSettings


def test_every_setting_has_python_s_default_type_and_bounds() -> None:
    contract = json.loads(json.dumps(device_contract()))  # JSON-able, and read back as the page reads it
    settings = contract["settings"]
    assert contract["version"] == CONTRACT_VERSION and contract["api_prefix"] == API_PREFIX
    assert list(settings) == list(RoundSettings.model_fields)
    assert {name: spec["default"] for name, spec in settings.items()} == RoundSettings().to_json()
    assert RoundSettings.from_json({name: spec["default"] for name, spec in settings.items()}) == RoundSettings()
    kinds = {"integer": int, "number": float, "boolean": bool, "string": str, "array": list, "object": dict}
    for name, spec in settings.items():
        if spec["default"] is not None:
            assert type(spec["default"]) is kinds[spec["type"]], name
    limits = {name: bounds_of(info) for name, info in RoundSettings.model_fields.items()}
    assert {n: (s["minimum"], s["maximum"]) for n, s in settings.items() if "minimum" in s} == {
        name: (bounds["ge"], bounds["le"]) for name, bounds in limits.items() if "ge" in bounds
    }
    assert {n: (s["minimum"], s["maximum"]) for n, s in settings.items() if "minimum" in s}["epochs"] == (0, 1000)
    assert settings["algorithm"]["enum"] == list(ALGORITHMS)
    assert settings["download_encoding"]["enum"] == list(DOWNLOAD_ENCODINGS)
    assert [n for n, s in settings.items() if "exclusiveMinimum" in s] == ["lr", "personal_lr", "clip_norm"]
    assert settings["clip_norm"]["nullable"] and not settings["lr"]["nullable"]
    assert settings["personal_lr"]["nullable"] and settings["personal_lr"]["default"] is None  # None: the shared lr
    assert settings["kept_on_device"] == {**settings["kept_on_device"], "type": "array", "items": "string"}
    assert settings["epochs"]["help"] == RoundSettings.model_fields["epochs"].description


def test_phases_and_uploads_are_the_algorithms_own() -> None:
    contract = device_contract()
    assert list(contract["algorithms"]) == list(CLIENT_ALGORITHMS) == list(ALGORITHMS)
    settings = RoundSettings(epochs=2, personal_epochs=3, finetune_epochs=5, lr=0.1, personal_lr=0.02)
    sets = ("full", "personal", "base")
    for name, algorithm in contract["algorithms"].items():
        assert algorithm["uploads"] is CLIENT_ALGORITHMS[name].uploads
        declared = [contract["finetune_phase"], *algorithm["phases"]]
        # the page's reading of the contract: each phase's epochs and learning rate from the settings fields it names
        read = [
            (p["name"], p["trainable"], getattr(settings, p["epochs"]), getattr(settings, p["lr"])) for p in declared
        ]
        python = round_phases(settings.model_copy(update={"algorithm": name}), sets)
        assert read == [(p.name, p.trainable, p.epochs, p.lr) for p in python], name
    fedalt = round_phases(settings.model_copy(update={"algorithm": "fedalt"}), sets)
    assert [(p.name, p.lr) for p in fedalt] == [("finetune", 0.1), ("personal", 0.02), ("base", 0.1)]
    shared = round_phases(settings.model_copy(update={"algorithm": "fedalt", "personal_lr": None}), sets)
    assert {p.lr for p in shared} == {0.1}  # no --personal-lr: the shared one
    assert contract["finetune_phase"]["epochs"] == FINETUNE.epochs_setting == "finetune_epochs"


def test_refusal_codes_timing_divergence_and_seeds_are_python_s() -> None:
    from edgepfl.server.http_errors import STATUS

    contract = device_contract()
    assert set(contract["round_gone_errors"]) == ROUND_GONE_ERRORS
    assert set(contract["round_gone_errors"]) <= set(STATUS)  # codes the server does send
    retry = RetryPolicy()
    assert contract["timing"] == {
        "max_wait": MAX_WAIT,
        "poll_interval": DeviceOptions().poll_interval,
        "retry": {"attempts": retry.attempts, "first_delay": retry.first_delay, "max_delay": retry.max_delay},
    }
    assert contract["divergence"] == {"loss_factor": DIVERGED_LOSS_FACTOR}
    local = LocalOptions()
    assert contract["device"] == {
        "seed": DeviceOptions().seed,
        "split_seed": local.seed,
        "val_fraction": 0.2,
        "min_train_examples": MIN_TRAIN_EXAMPLES,
        "min_held_out": MIN_HELD_OUT,
    }
    assert local.val_fraction == 0.2


def test_the_page_s_minimum_of_examples_is_reachable_and_its_model_file_texts_are_python_s() -> None:
    from edgepfl.data import split_train_val

    sizes = {n: [len(part) for part in split_train_val(n, 0.2, 0)] for n in range(1, 40)}
    enough = [n for n, (train, held_out) in sizes.items() if train >= MIN_TRAIN_EXAMPLES and held_out >= MIN_HELD_OUT]
    assert enough and enough == list(range(enough[0], 40)), sizes  # once reached, more examples never fall below
    model_file = device_contract()["model_file"]
    assert model_file == model_file_contract()
    assert [tuple(entry) for entry in model_file["metadata"]] == list(METADATA_KEYS)


class _WithMomentum(RoundSettings):
    """A settings model with two settings more, as a later version might add them."""

    momentum: Annotated[float | None, Field(ge=0.0, le=1.0, description="SGD momentum of the local steps")] = 0.9
    schedule: Annotated[Literal["constant", "cosine"], Field(description="learning-rate schedule")] = "constant"


def test_a_setting_added_to_the_settings_class_appears_without_edits() -> None:
    settings = device_contract(_WithMomentum)["settings"]
    assert settings["momentum"] == {
        "type": "number",
        "nullable": True,
        "default": 0.9,
        "help": "SGD momentum of the local steps",
        "minimum": 0.0,
        "maximum": 1.0,
    }
    assert settings["schedule"] == {
        "type": "string",
        "nullable": False,
        "enum": ["constant", "cosine"],
        "default": "constant",
        "help": "learning-rate schedule",
    }
    assert list(settings)[: len(RoundSettings.model_fields)] == list(device_contract()["settings"])
    assert [f.name for f in settings_fields(_WithMomentum)][-2:] == ["momentum", "schedule"]


NEW_SETTING = textwrap.dedent(
    """
    import json, sys
    from typing import Annotated
    from pydantic import Field
    import edgepfl.protocol as protocol

    class Options(protocol.RoundOptions):
        momentum: Annotated[float, Field(ge=0.0, le=1.0, description="test-only: SGD momentum")] = 0.5

    class Settings(protocol.RoundSettings, Options):
        pass

    protocol.RoundOptions, protocol.RoundSettings = Options, Settings  # the edit: a field of the settings model
    from typer.testing import CliRunner
    from edgepfl.cli import app
    from edgepfl.device_runtime.contract import device_contract
    from edgepfl.flower.config import server_config
    from edgepfl.options import leaves
    from edgepfl.flower.config import ServerRunConfig

    runner = CliRunner()
    helps = [runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"}).output for name in ("serve", "simulate")]
    run = server_config({"bundle": "b", "momentum": 0.25})
    print(json.dumps({
        "help": ["--momentum" in text for text in helps],
        "flower_key": "momentum" in {leaf.name for leaf in leaves(ServerRunConfig)},
        "flower_value": run.round.momentum,
        "contract": device_contract()["settings"].get("momentum"),
        "settings": run.round.settings().momentum,
    }))
    """
)


def test_a_new_round_setting_reaches_serve_simulate_flower_and_the_contract_without_further_edits() -> None:
    """Issue 31: a round setting is one field of the settings model; flags, Flower's run config and contract.json
    are made from it (the subprocess adds a field to RoundOptions before anything else reads it)."""
    pytest.importorskip("flwr")
    done = subprocess.run([sys.executable, "-c", NEW_SETTING], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["help"] == [True, True], "serve --help and simulate --help show --momentum"
    assert seen["flower_key"] and seen["flower_value"] == 0.25 and seen["settings"] == 0.25
    assert seen["contract"]["default"] == 0.5 and seen["contract"]["maximum"] == 1.0


def test_a_setting_type_without_a_json_form_is_named() -> None:
    class _Odd(RoundSettings):
        when: complex = 1j

    with pytest.raises(TypeError, match="complex"):
        device_contract(_Odd)


class _WithTextAndCount(RoundSettings):
    """A settings model with a plain-text setting and an optional integer, as a later version might add them."""

    note: Annotated[str, Field(description="a plain-text note for the round")] = "hello"
    warmup: Annotated[int | None, Field(ge=0, le=10, description="optional warm-up steps")] = None


def test_a_plain_text_and_an_optional_integer_setting_are_what_the_page_and_a_python_device_take() -> None:
    from edgepfl.errors import WireError

    settings = device_contract(_WithTextAndCount)["settings"]
    assert settings["note"] == {
        "type": "string",
        "nullable": False,
        "default": "hello",
        "help": "a plain-text note for the round",
    }
    assert settings["warmup"] == {
        "type": "integer",
        "nullable": True,
        "default": None,
        "help": "optional warm-up steps",
        "minimum": 0,
        "maximum": 10,
    }
    # a Python device takes what the contract lets the page take: any text (not an upload encoding), null or 0..10
    taken = _WithTextAndCount.from_json({"note": "any words at all", "warmup": None})
    assert (taken.note, taken.warmup) == ("any words at all", None)
    assert _WithTextAndCount.from_json({"warmup": 3}).warmup == 3
    for bad, match in (
        ({"note": 3}, "note 3 is not text"),
        ({"warmup": 11}, "warmup 11 is not an integer in 0..10"),
        ({"warmup": "3"}, "warmup '3' is not an integer"),
    ):
        with pytest.raises(WireError, match=match):
            _WithTextAndCount.from_json(bad)
    with pytest.raises(WireError, match="upload_encoding 'int9'"):  # the encoding is still checked as one
        _WithTextAndCount.from_json({"upload_encoding": "int9"})
