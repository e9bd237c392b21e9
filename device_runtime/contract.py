"""The browser device's contract: what the page must agree on with the Python device, written by Python as JSON.

`device_contract()` is served at `GET /device/contract.json` (server/web.py) and written into the Node tests'
fixtures (device_runtime/web/test/make_fixtures.py). The page reads every round setting's default and bounds,
the algorithms' phases, the refusal codes that end a round, its timing and the divergence rule from it, so
nothing of these is copied by hand into JavaScript.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic.fields import FieldInfo

from edgepfl.device_runtime.algorithms import CLIENT_ALGORITHMS, DIVERGED_LOSS_FACTOR, FINETUNE, PhasePlan
from edgepfl.device_runtime.client import ROUND_GONE_ERRORS, RetryPolicy
from edgepfl.device_runtime.model_metadata import model_file_contract
from edgepfl.device_runtime.options import DeviceOptions, LocalOptions
from edgepfl.device_runtime.runner import MAX_WAIT
from edgepfl.options import bounds_of
from edgepfl.protocol import API_PREFIX, RoundSettings

CONTRACT_VERSION = 1  # raised whenever the meaning of a key changes (the page refuses a version it cannot read)
CONTRACT_NAME = "contract.json"
# The page asks the server for rounds only once it holds this many examples to train on and this many held out
# (with the split below): a person adds photos a few at a time, and a round on three photos teaches the model
# nothing while its held-out accuracy (0 % or 100 % of one photo) means nothing. The CLI device is handed a whole
# data set and has no such rule.
MIN_TRAIN_EXAMPLES, MIN_HELD_OUT = 8, 2


@dataclass(frozen=True)
class SettingField:
    """One round setting as the settings model declares it."""

    name: str
    annotation: Any  # the resolved type: int, float, str | None, tuple[str, ...], Literal[...], ...
    default: Any
    help: str
    bounds: dict[str, float]  # {"ge"|"gt"|"le"|"lt": value} (edgepfl.options.bounds_of)


def settings_fields(settings_class: type[RoundSettings] = RoundSettings) -> list[SettingField]:
    """Every field of a round settings model, with its type, default, help and bounds (the one place they are read)."""
    return [_field(name, info) for name, info in settings_class.model_fields.items()]


def _field(name: str, info: FieldInfo) -> SettingField:
    default = info.get_default(call_default_factory=True)
    return SettingField(name, info.annotation, default, info.description or "", bounds_of(info))


def device_contract(settings_class: type[RoundSettings] = RoundSettings) -> dict[str, Any]:
    """The contract as JSON-able data (see the module docstring); `settings_class` gives the round settings."""
    retry = RetryPolicy()
    return {
        "version": CONTRACT_VERSION,
        "api_prefix": API_PREFIX,
        "settings": {field.name: setting_entry(field) for field in settings_fields(settings_class)},
        "algorithms": {
            name: {"uploads": algorithm.uploads, "phases": [_phase(plan) for plan in algorithm.plan]}
            for name, algorithm in CLIENT_ALGORITHMS.items()
        },
        "finetune_phase": _phase(FINETUNE),  # before every algorithm's phases
        "round_gone_errors": sorted(ROUND_GONE_ERRORS),  # refusals after which the device rejoins the next round
        "timing": {  # seconds
            "max_wait": MAX_WAIT,  # between polls at most, whatever the server says
            "poll_interval": DeviceOptions.model_fields["poll_interval"].default,  # when the server gives none
            "retry": {"attempts": retry.attempts, "first_delay": retry.first_delay, "max_delay": retry.max_delay},
        },
        # a loss above loss_factor * max(ln(classes), 1), NaN or Inf, or a NaN/Inf tensor: the round is refused
        "divergence": {"loss_factor": DIVERGED_LOSS_FACTOR},
        "device": {
            "seed": DeviceOptions.model_fields["seed"].default,  # batch order (and stochastic rounding)
            "split_seed": LocalOptions.model_fields["seed"].default,  # the train/held-out split
            "val_fraction": LocalOptions.model_fields["val_fraction"].default,
            "min_train_examples": MIN_TRAIN_EXAMPLES,
            "min_held_out": MIN_HELD_OUT,
        },
        # `device export-model`'s file as the page writes it (model_metadata.py): names, texts, metadata order
        "model_file": model_file_contract(),
    }


def setting_entry(field: SettingField) -> dict[str, Any]:
    """A setting's JSON description: its type (JSON Schema's words), default, help and bounds."""
    entry = {**_json_type(field.annotation), "default": _jsonable(field.default), "help": field.help}
    for bound, key in (("ge", "minimum"), ("le", "maximum"), ("gt", "exclusiveMinimum"), ("lt", "exclusiveMaximum")):
        if bound in field.bounds:
            entry[key] = field.bounds[bound]
    return entry


def _json_type(annotation: Any) -> dict[str, Any]:
    """`type` (with `nullable`, and `enum` of a Literal or `items` of a sequence) of a field's type annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = [arg for arg in args if arg is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"round setting type {annotation!r} has no JSON form in the device contract")
        return {**_json_type(inner[0]), "nullable": True}
    if origin is typing.Literal:
        return {**_json_type(type(args[0])), "enum": list(args)}
    if origin in (tuple, list):
        return {"type": "array", "nullable": False, "items": _json_type(args[0])["type"]}
    for python, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (dict, "object")):
        if (origin or annotation) is python:
            return {"type": name, "nullable": False}
    raise TypeError(f"round setting type {annotation!r} has no JSON form in the device contract")


def _phase(plan: PhasePlan) -> dict[str, str]:
    return {"name": plan.name, "trainable": plan.trainable, "epochs": plan.epochs_setting, "lr": plan.lr_setting}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
