"""Errors a user, a device or the network can cause: each names the problem and the fix."""


class EdgePFLError(Exception):
    """Base class: caught once at the CLI boundary and printed as one line."""

    def __init__(self, problem: str, fix: str = ""):
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.problem} ({self.fix})" if self.fix else self.problem


class UsageError(EdgePFLError):
    """A bad command-line value or option combination."""


class BundleError(EdgePFLError):
    """A missing, incomplete or inconsistent artifact bundle."""


class WireError(EdgePFLError):
    """Tensor bytes that cannot be decoded or do not match the manifest."""


class StateError(EdgePFLError):
    """Saved state that does not belong to this bundle or cannot be read."""


class DataError(EdgePFLError):
    """Device or dataset input that does not fit the model."""


class SecAggError(EdgePFLError):
    """A secure-aggregation message or state that breaks the protocol (edgepfl.secagg); nothing held is lost."""
