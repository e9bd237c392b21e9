"""The browser device's contract (device_runtime/contract.py) says what the Python device does, read from its code."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import pytest

from edgepfl.device_runtime.algorithms import CLIENT_ALGORITHMS, DIVERGED_LOSS_FACTOR, FINETUNE, round_phases
from edgepfl.device_runtime.client import ROUND_GONE_ERRORS, RetryPolicy
from edgepfl.device_runtime.contract import CONTRACT_VERSION, device_contract, settings_fields
from edgepfl.device_runtime.options import DeviceOptions, LocalOptions
from edgepfl.device_runtime.runner import MAX_WAIT
from edgepfl.protocol import (
    ALGORITHMS,
    API_PREFIX,
    DOWNLOAD_ENCODINGS,
    POSITIVE_SETTINGS,
    SETTINGS_LIMITS,
    RoundSettings,
)


def test_every_setting_has_python_s_default_type_and_bounds() -> None:
    contract = json.loads(json.dumps(device_contract()))  # JSON-able, and read back as the page reads it
    settings = contract["settings"]
    assert contract["version"] == CONTRACT_VERSION and contract["api_prefix"] == API_PREFIX
    assert list(settings) == list(RoundSettings.__dataclass_fields__)
    assert {name: spec["default"] for name, spec in settings.items()} == RoundSettings().to_json()
    assert RoundSettings.from_json({name: spec["default"] for name, spec in settings.items()}) == RoundSettings()
    kinds = {"integer": int, "number": float, "boolean": bool, "string": str, "array": list, "object": dict}
    for name, spec in settings.items():
        if spec["default"] is not None:
            assert type(spec["default"]) is kinds[spec["type"]], name
    assert {n: (s["minimum"], s["maximum"]) for n, s in settings.items() if "minimum" in s} == SETTINGS_LIMITS
    assert settings["algorithm"]["enum"] == list(ALGORITHMS)
    assert settings["download_encoding"]["enum"] == list(DOWNLOAD_ENCODINGS)
    assert [n for n, s in settings.items() if "exclusiveMinimum" in s] == list(POSITIVE_SETTINGS)
    assert settings["clip_norm"]["nullable"] and not settings["lr"]["nullable"]
    assert settings["kept_on_device"] == {**settings["kept_on_device"], "type": "array", "items": "string"}
    assert settings["epochs"]["help"] == RoundSettings.__dataclass_fields__["epochs"].metadata["help"]


def test_phases_and_uploads_are_the_algorithms_own() -> None:
    contract = device_contract()
    assert list(contract["algorithms"]) == list(CLIENT_ALGORITHMS) == list(ALGORITHMS)
    settings = RoundSettings(epochs=2, personal_epochs=3, finetune_epochs=5)
    sets = ("full", "personal", "base")
    for name, algorithm in contract["algorithms"].items():
        assert algorithm["uploads"] is CLIENT_ALGORITHMS[name].uploads
        declared = [contract["finetune_phase"], *algorithm["phases"]]
        # the page's reading of the contract: each phase's epochs from the settings field it names
        read = [(p["name"], p["trainable"], getattr(settings, p["epochs"])) for p in declared]
        python = round_phases(RoundSettings(**{**vars(settings), "algorithm": name}), sets)
        assert read == [(p.name, p.trainable, p.epochs) for p in python], name
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
    assert contract["device"] == {"seed": DeviceOptions().seed, "split_seed": local.seed, "val_fraction": 0.2}
    assert local.val_fraction == 0.2


@dataclass(frozen=True)
class _WithMomentum(RoundSettings):
    """A settings class with two settings more, as a later version might add them."""

    momentum: float | None = field(default=0.9, metadata={"help": "SGD momentum of the local steps"})
    schedule: Literal["constant", "cosine"] = field(default="constant", metadata={"help": "learning-rate schedule"})


def test_a_setting_added_to_the_settings_class_appears_without_edits() -> None:
    settings = device_contract(_WithMomentum)["settings"]
    assert settings["momentum"] == {
        "type": "number",
        "nullable": True,
        "default": 0.9,
        "help": "SGD momentum of the local steps",
    }
    assert settings["schedule"] == {
        "type": "string",
        "nullable": False,
        "enum": ["constant", "cosine"],
        "default": "constant",
        "help": "learning-rate schedule",
    }
    assert list(settings)[: len(RoundSettings.__dataclass_fields__)] == list(device_contract()["settings"])
    assert [f.name for f in settings_fields(_WithMomentum)][-2:] == ["momentum", "schedule"]


def test_a_setting_type_without_a_json_form_is_named() -> None:
    @dataclass(frozen=True)
    class _Odd(RoundSettings):
        when: complex = 1j

    with pytest.raises(TypeError, match="complex"):
        device_contract(_Odd)
