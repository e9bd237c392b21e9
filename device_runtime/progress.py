"""Round and training progress drawn with rich on stderr (the CLI's `DeviceEvents`)."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from edgepfl.device_runtime.algorithms import ClientResult
from edgepfl.device_runtime.runner import DeviceEvents
from edgepfl.protocol import RoundSettings


class RichEvents(DeviceEvents):
    """Round progress as a rich progress bar on stderr, messages above it."""

    def __init__(self, quiet: bool):
        self._console = Console(stderr=True)
        self._quiet = quiet
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=self._console,
            disable=quiet,
        )
        self._bar: Any = None

    def __enter__(self) -> RichEvents:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    def message(self, text: str) -> None:
        """A status line above the bar."""
        if not self._quiet:
            self._progress.console.print(text)

    def waiting(self, text: str) -> None:
        """What the device waits for and why: on stderr even under --json, so a daemon never waits in silence."""
        self._progress.console.print(text)

    def start_bar(self, description: str, total: int) -> None:
        """A fresh bar for one round or one local training run."""
        if self._bar is not None:
            self._progress.remove_task(self._bar)
        self._bar = self._progress.add_task(description, total=total, loss="-")

    def round_started(self, round_id: int, settings: RoundSettings, total_steps: int) -> None:
        """A bar per round."""
        self.start_bar(f"round {round_id} {settings.algorithm}", total_steps)

    def step(self, phase: str, done: int, total: int, loss: float) -> None:
        """Advance the bar by one step."""
        self._progress.update(self._bar, advance=1, loss=f"{loss:.4f}")

    def round_finished(self, round_id: int, result: ClientResult, upload: str) -> None:
        """One line per round."""
        accuracy = "n/a" if math.isnan(result.val_accuracy) else f"{result.val_accuracy:.3f}"
        self.message(
            f"round {round_id}: {result.algorithm}, train loss {result.train_loss:.4f}, held-out accuracy "
            f"{result.start_val_accuracy:.3f} -> {accuracy}, upload {upload}"
        )
