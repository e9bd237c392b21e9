"""Which onnxruntime distribution is installed: the training build or plain onnxruntime.

Both provide the `onnxruntime` module; only the training build (`onnxruntime-training`, frozen at
1.19.2) has the training Module that runs ORT on-device training artifacts. Export and the device
runtime both ask, and neither may import the other, so the one check lives here.
"""

from __future__ import annotations


def training_build_installed() -> bool:
    """True when the installed onnxruntime is the training build (it has the training Module)."""
    import onnxruntime

    return hasattr(onnxruntime.capi._pybind_state, "Module")
