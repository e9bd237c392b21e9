"""Bearer secrets kept in files (the server's enrollment secret, a device token): read one, write one 0600."""

from __future__ import annotations

import os
from pathlib import Path

from edgepfl.atomic import write_bytes_atomic
from edgepfl.errors import UsageError


def read_secret_file(path: Path, option: str) -> str:
    """The secret held in `path`, surrounding whitespace stripped; UsageError naming `option` if unreadable or empty."""
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise UsageError(f"{option} {path} cannot be read ({reason})", "pass a readable file holding it") from None
    if not secret:
        raise UsageError(f"{option} {path} is empty", "pass the file that holds it")
    return secret


def refuse_existing(path: Path, option: str) -> None:
    """UsageError if `path` exists: `write_secret_file` never replaces a file, so callers can refuse early."""
    if Path(path).exists():
        raise _exists(path, option)


def write_secret_file(path: Path, secret: str, option: str) -> None:
    """Write `secret` to a new file readable by its owner only (0600); an existing file is never replaced."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise _exists(path, option) from None
    except OSError as exc:
        raise UsageError(f"{option} {path} cannot be written ({exc.strerror})", "pass a writable path") from None
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(secret + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def replace_secret_file(path: Path, secret: str, option: str) -> None:
    """Write `secret` to `path` (0600) atomically, replacing any file there: a reader never sees a part."""
    try:
        write_bytes_atomic(path, (secret + "\n").encode("utf-8"), mode=0o600)
    except OSError as exc:
        raise UsageError(f"{option} {path} cannot be written ({exc.strerror})", "pass a writable path") from None


def _exists(path: Path, option: str) -> UsageError:
    return UsageError(f"{option} {path} exists already", "pass a new file name, or move the old file away")
