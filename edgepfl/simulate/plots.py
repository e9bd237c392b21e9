"""accuracy.png: mean test accuracy per round with the spread across clients shaded; several runs overlaid."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from edgepfl.errors import UsageError
from edgepfl.options import ARGUMENT, titled
from edgepfl.simulate.results import Results, load_results


class PlotOptions(BaseModel):
    """`edgepfl plot`: which runs, drawn where."""

    model_config = titled("Plot")

    runs: Annotated[
        list[Path],
        Field(min_length=1, description="run folders written by edgepfl simulate", json_schema_extra={ARGUMENT: True}),
    ]
    out: Annotated[
        Path | None, Field(description="PNG to write (default: RUN/accuracy.png for one run, else accuracy.png)")
    ] = None
    x: Annotated[
        Literal["round", "time"],
        Field(description="the x axis: rounds (fedbuff: steps), or the virtual time of a --fleet run"),
    ] = "round"


PLOT_FILE = "accuracy.png"


def plot_runs(
    runs: Sequence[Results], out: str | Path, labels: Sequence[str] | None = None, x_axis: str = "round"
) -> Path:
    """Write one PNG: per run, mean test accuracy across clients, ± std shaded dark and min..max light, against
    rounds or (x_axis "time") the virtual time of a --fleet run."""
    if not runs:
        raise UsageError("nothing to plot", "pass at least one run folder")
    if x_axis == "time":
        untimed = [results.config.out for results in runs if any(r.virtual_time is None for r in results.rounds)]
        if untimed:
            raise UsageError(f"{untimed[0]} has no virtual time", "plot it with --x round, or rerun it with --fleet")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=120)
    for index, results in enumerate(runs):
        rounds = [r for r in results.rounds if r.test_accuracy["mean"] is not None]
        if not rounds:
            continue
        x = [r.virtual_time if x_axis == "time" else r.round for r in rounds]
        mean = [100 * r.test_accuracy["mean"] for r in rounds]
        std = [100 * r.test_accuracy["std"] for r in rounds]
        low = [100 * r.test_accuracy["min"] for r in rounds]
        high = [100 * r.test_accuracy["max"] for r in rounds]
        label = labels[index] if labels else f"{results.config.algorithm} ({Path(results.config.out).name})"
        (line,) = axes.plot(x, mean, marker="o" if len(x) < 30 else None, markersize=3, label=label)
        colour = line.get_color()
        axes.fill_between(x, low, high, color=colour, alpha=0.08, linewidth=0)
        axes.fill_between(
            x,
            [m - s for m, s in zip(mean, std)],
            [m + s for m, s in zip(mean, std)],
            color=colour,
            alpha=0.2,
            linewidth=0,
        )
    from matplotlib.ticker import MaxNLocator

    if x_axis == "time":
        axes.set_xlabel("virtual time (s)")
    else:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_xlabel("round")
    axes.set_ylabel("test accuracy across clients (%)")
    axes.set_title("mean; shaded: ± std (dark), min..max (light)", fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    plt.close(figure)
    return out


def plot_run_folders(folders: Sequence[str | Path], out: str | Path | None = None, x_axis: str = "round") -> Path:
    """Overlay the runs in these folders; default output: the first folder's accuracy.png (one run) or
    ./accuracy.png (several)."""
    runs = [load_results(folder) for folder in folders]
    if out is None:
        out = Path(folders[0]) / PLOT_FILE if len(folders) == 1 else Path(PLOT_FILE)
    return plot_runs(runs, out, x_axis=x_axis)
