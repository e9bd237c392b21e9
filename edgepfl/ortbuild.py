"""Which onnxruntime distribution is installed: the training build or plain onnxruntime.

Both provide the `onnxruntime` module; only the training build (`onnxruntime-training`, frozen at
1.19.2) has the training Module that runs ORT on-device training artifacts. Export and the device
runtime both ask, and neither may import the other, so the one check lives here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types


def training_build_installed() -> bool:
    """True when the installed onnxruntime is the training build (it has the training Module)."""
    import onnxruntime

    return hasattr(onnxruntime.capi._pybind_state, "Module")


def onnxruntime_without_torch() -> None:
    """Keep the training build of onnxruntime from importing torch, which a device neither has nor needs.

    Its `onnxruntime.training` package __init__ imports torch (amp, optim), and `import onnxruntime` itself imports
    ORTModule, PyTorch's front end, to check a CUDA build, which prints torch's "No CUDA runtime is found" on every
    device command. So `onnxruntime.training` becomes a bare package (its submodules, such as `api`, still import)
    and ORTModule is hidden, which onnxruntime takes as "not present". Call it before onnxruntime is imported; once
    it has been (or none is installed), it does nothing.
    """
    if "onnxruntime" in sys.modules or "onnxruntime.training" in sys.modules:
        return
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return
    package = types.ModuleType("onnxruntime.training")
    package.__path__ = [os.path.join(next(iter(spec.submodule_search_locations)), "training")]
    sys.modules["onnxruntime.training"] = package
    sys.modules["onnxruntime.training.ortmodule"] = None  # type: ignore[assignment] - import raises ImportError
