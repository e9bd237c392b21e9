"""Secure aggregation (SecAgg+ / SecAgg with double masking): the server learns only the sum of the deltas.

Core layer: stdlib, numpy and `cryptography` only. docs/secure-aggregation.md describes the protocol; the
browser device's side is device_runtime/web/src/secagg.js.
"""

from edgepfl.errors import SecAggError
from edgepfl.secagg.client import ClientSession
from edgepfl.secagg.config import Plan, SecAggConfig, make_plan
from edgepfl.secagg.messages import (
    KeyAdvert,
    KeyBook,
    MaskedInput,
    ShareBundle,
    ShareInbox,
    UnmaskRequest,
    UnmaskShares,
    from_json,
    to_json,
)
from edgepfl.secagg.quantize import SecureSum, VectorLayout, dequantize_sum, quantize_delta
from edgepfl.secagg.server import ServerSession

__all__ = [
    "ClientSession",
    "KeyAdvert",
    "KeyBook",
    "MaskedInput",
    "Plan",
    "SecAggConfig",
    "SecAggError",
    "SecureSum",
    "ServerSession",
    "ShareBundle",
    "ShareInbox",
    "UnmaskRequest",
    "UnmaskShares",
    "VectorLayout",
    "dequantize_sum",
    "from_json",
    "make_plan",
    "quantize_delta",
    "to_json",
]
