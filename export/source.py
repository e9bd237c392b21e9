"""MODEL strings: a zoo name, `torchvision:NAME`, `path/to/file.py:factory` or `package.module:factory`.

Each becomes an nn.Module built locally (torchvision with weights=None: nothing is ever downloaded),
optionally loaded from a local state_dict file (strictly) and given a fresh classifier head.
A model may say its own input shape with an `edgepfl_input_shape` attribute (C, H, W) and its head
with an `edgepfl_head` attribute (the submodule name of the final nn.Linear).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from edgepfl.errors import UsageError
from edgepfl.export.models import MODEL_NAMES
from edgepfl.export.sequence_options import SEQUENCE_MODELS

TORCHVISION_PREFIX = "torchvision:"
# the families exported and tested end to end (tests/test_export_families.py); other torchvision
# classification builders are accepted and may export too
TORCHVISION_TESTED = (
    "mobilenet_v2",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "resnet18",
    "efficientnet_b0",
    "shufflenet_v2_x1_0",
)
TORCHVISION_INPUT = (3, 224, 224)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
INPUT_SHAPE_ATTR = "edgepfl_input_shape"
HEAD_ATTR = "edgepfl_head"
MODEL_FORMS = (
    "a zoo name (mobilenet, cnn, mlp, resnet34; transformer, lstm; har-cnn), torchvision:NAME, path/to/file.py:factory"
    " or package.module:factory"
)


@dataclass(frozen=True)
class ModelSource:
    """A parsed MODEL string: its kind (zoo, torchvision, file, module) and what it points at."""

    text: str
    kind: str
    target: str = ""  # torchvision builder, file path or module path
    factory: str = ""

    @property
    def is_zoo(self) -> bool:
        """True for the built-in zoo models (built from a ModelSpec, not from a factory)."""
        return self.kind == "zoo"


@dataclass
class LoadedModel:
    """A model built from a MODEL string, with what the manifest records about where it came from."""

    module: nn.Module
    input_shape: tuple[int, ...] | None
    normalization: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    description: dict = field(default_factory=dict)


def parse_model(text: str) -> ModelSource:
    """Recognise the MODEL string's form, or one line listing the forms."""
    if text in MODEL_NAMES + SEQUENCE_MODELS:
        return ModelSource(text, "zoo")
    if text.startswith(TORCHVISION_PREFIX):
        name = text[len(TORCHVISION_PREFIX) :]
        if not re.fullmatch(r"[a-z0-9_]+", name):
            raise UsageError(
                f"model {text!r} names no torchvision builder", f"e.g. torchvision:{TORCHVISION_TESTED[0]}"
            )
        return ModelSource(text, "torchvision", name)
    target, colon, factory = text.rpartition(":")
    if colon and target and factory.isidentifier():
        if target.endswith(".py"):
            return ModelSource(text, "file", target, factory)
        if all(part.isidentifier() for part in target.split(".")):
            return ModelSource(text, "module", target, factory)
    raise UsageError(f"unknown model {text!r}", f"use {MODEL_FORMS}")


def load_source(source: ModelSource, seed: int = 0) -> LoadedModel:
    """Build the model a (non-zoo) MODEL string names, seeded; torchvision builders get weights=None."""
    torch.manual_seed(seed)
    if source.kind == "torchvision":
        module = _torchvision(source.target)
        description = {"name": source.text, "source": source.text}
        return LoadedModel(module, TORCHVISION_INPUT, (IMAGENET_MEAN, IMAGENET_STD), description)
    factory = _factory(source)
    try:
        module = factory()
    except Exception as exc:  # the user's code: any failure is theirs to fix, in one line
        raise UsageError(f"{source.text}() failed: {type(exc).__name__}: {exc}", "fix the factory function") from None
    if not isinstance(module, nn.Module):
        raise UsageError(
            f"{source.text}() returned a {type(module).__name__}, not a torch.nn.Module", "return the model"
        )
    shape = getattr(module, INPUT_SHAPE_ATTR, None)
    description = {"name": type(module).__name__, "source": source.text}
    return LoadedModel(module, tuple(int(d) for d in shape) if shape is not None else None, ((), ()), description)


def build_from_string(
    source: ModelSource,
    input_shape: tuple[int, ...] | None = None,
    weights: str | Path | None = None,
    num_classes: int | None = None,
    seed: int = 0,
) -> LoadedModel:
    """A non-zoo MODEL string made ready to export: built, weights loaded strictly, head replaced if asked."""
    loaded = load_source(source, seed)
    loaded.input_shape = input_shape or loaded.input_shape
    if loaded.input_shape is None:
        raise UsageError(f"{source.text} does not say its input shape", "pass --input-shape C,H,W")
    if weights is not None:
        load_weights(loaded.module, read_state_dict(weights), f"weights file {weights}")
        digest = hashlib.sha256(Path(weights).read_bytes()).hexdigest()
        loaded.description["weights"] = {"file": Path(weights).name, "sha256": digest}
    if num_classes is not None:
        loaded.description["new_head"] = replace_head(loaded.module, loaded.input_shape, num_classes, seed)
    return loaded


def rebuild_module(description: dict) -> nn.Module:
    """The architecture a bundle's manifest `model` entry describes (zoo spec or MODEL string), random layers
    off as in on-device training; its tensors are the bundle's to load."""
    from edgepfl.export.models import ModelSpec, build_model
    from edgepfl.export.prepare import without_random_layers

    if description.get("name") in SEQUENCE_MODELS:
        from edgepfl.export.textmodels import build_sequence_model, spec_from_description

        return build_sequence_model(spec_from_description(description))
    if "source" not in description:
        return build_model(ModelSpec(**description))
    module = load_source(parse_model(description["source"])).module
    if "new_head" in description:
        replace_head(module, tuple(description["input_shape"]), int(description["num_classes"]))
    return without_random_layers(module)


def _torchvision(name: str) -> nn.Module:
    import torchvision

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise UsageError(
            f"torchvision {torchvision.__version__} has no classification model {name!r}",
            f"choose e.g. one of: {', '.join(TORCHVISION_TESTED)}",
        )
    return torchvision.models.get_model(name, weights=None)


def _factory(source: ModelSource):
    if source.kind == "file":
        path = Path(source.target)
        if not path.is_file():
            raise UsageError(f"model file {path} does not exist", "check the path before ':factory'")
        module_name = "edgepfl_user_model_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(module_name, path)
        code = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = code  # dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(code)
        except Exception as exc:
            sys.modules.pop(module_name, None)
            raise UsageError(f"cannot import {path}: {type(exc).__name__}: {exc}", "fix the model file") from None
    else:
        try:
            code = importlib.import_module(source.target)
        except Exception as exc:
            raise UsageError(
                f"cannot import {source.target}: {type(exc).__name__}: {exc}", "install the package or fix PYTHONPATH"
            ) from None
    factory = getattr(code, source.factory, None)
    if not callable(factory):
        raise UsageError(
            f"{source.target} has no function {source.factory!r}", "name a function that returns an nn.Module"
        )
    return factory


def parse_input_shape(text: str) -> tuple[int, int, int]:
    """`C,H,W` -> (C, H, W), all positive, or one line."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UsageError(f"--input-shape {text!r} is not C,H,W", "write e.g. --input-shape 3,32,32")
    return (int(parts[0]), int(parts[1]), int(parts[2]))


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A local state_dict file: safetensors, or torch.save'd with weights_only=True (no code is run)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"weights file {path} does not exist", "pass a local state_dict file to --weights")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"cannot read weights file {path} ({reason})",
            "save it with torch.save(model.state_dict(), FILE) or safetensors.torch.save_file",
        ) from None
    if not isinstance(state, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise UsageError(
            f"weights file {path} holds a {type(state).__name__}, not a state_dict of tensors",
            "save model.state_dict() itself, not a checkpoint or the model object",
        )
    return dict(state)


def load_weights(module: nn.Module, state: Mapping[str, torch.Tensor], origin: str) -> None:
    """Load a state_dict strictly: missing, unexpected or mis-shaped keys end in one line naming the first few."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({_first(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({_first(unexpected)})")
        raise UsageError(
            f"{origin} does not fit the model: {'; '.join(parts)} key(s)",
            "pass the state_dict of this very architecture (before --num-classes replaces the head)",
        )
    wrong = [k for k in expected if tuple(expected[k].shape) != tuple(state[k].shape)]
    if wrong:
        k = wrong[0]
        raise UsageError(
            f"{origin}: {len(wrong)} tensor(s) have another shape, e.g. {k} is {tuple(state[k].shape)}, "
            f"the model's is {tuple(expected[k].shape)}",
            "pass the state_dict of this very architecture (before --num-classes replaces the head)",
        )
    module.load_state_dict(state, strict=True)


def find_head(module: nn.Module, input_shape: tuple[int, ...]) -> str:
    """The submodule name of the classifier head: `edgepfl_head`, else the last nn.Linear the forward calls."""
    declared = getattr(module, HEAD_ATTR, None)
    if declared is not None:
        if not isinstance(module.get_submodule(declared), nn.Linear):
            raise UsageError(f"{HEAD_ATTR} = {declared!r} is not an nn.Linear", "name the final nn.Linear")
        return str(declared)
    names = {id(m): n for n, m in module.named_modules()}
    called: list[str] = []
    hooks = [
        m.register_forward_hook(lambda m, _i, _o: called.append(names[id(m)]))
        for m in module.modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        logits = _dry_forward(module, input_shape)
    finally:
        for hook in hooks:
            hook.remove()
    if not called or module.get_submodule(called[-1]).out_features != logits.shape[-1]:
        raise UsageError(
            "cannot tell the classifier head (the model's output is not its last nn.Linear)",
            f"set the model's {HEAD_ATTR} attribute to the head's submodule name, or leave out --num-classes",
        )
    return called[-1]


def replace_head(module: nn.Module, input_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> str:
    """Swap the classifier head for a freshly initialised one with `num_classes` outputs; returns its name."""
    if num_classes < 2:
        raise UsageError(f"--num-classes {num_classes} is too small", "use at least 2 classes")
    name = find_head(module, input_shape)
    old = module.get_submodule(name)
    torch.manual_seed(seed)
    new = nn.Linear(old.in_features, num_classes, bias=old.bias is not None)
    parent_name, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, attr, new)
    return name


def output_classes(module: nn.Module, input_shape: tuple[int, ...]) -> int:
    """How many logits one sample gives (a (N, classes) output is required)."""
    logits = _dry_forward(module, input_shape)
    if logits.dim() != 2:
        raise UsageError(
            f"the model returns shape {tuple(logits.shape)} for a batch, not (batch, classes)",
            "return logits of shape (N, classes)",
        )
    return int(logits.shape[1])


def _dry_forward(module: nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor:
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            out = module(torch.zeros(2, *input_shape))
    except Exception as exc:
        raise UsageError(
            f"the model fails on input shape {tuple(input_shape)}: {type(exc).__name__}: {str(exc)[:200]}",
            "pass the --input-shape C,H,W the model takes",
        ) from None
    finally:
        module.train(was_training)
    if not isinstance(out, torch.Tensor):
        raise UsageError(f"the model returns a {type(out).__name__}, not a tensor of logits", "return logits")
    return out


def _first(names: list[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (", …" if len(names) > count else "")
