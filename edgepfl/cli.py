"""The `edgepfl` command. Components are imported inside each command, so a device never loads torch."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from edgepfl.boundary import ErrorBoundary, fail
from edgepfl.commands import command
from edgepfl.device_runtime.cli import device_app
from edgepfl.errors import EdgePFLError
from edgepfl.export.options import ExportCommand
from edgepfl.server.cli import serve_app
from edgepfl.simulate.config import PartitionCommand, SimulateConfig, read_config_file
from edgepfl.simulate.demo import DemoOptions
from edgepfl.simulate.plots import PlotOptions

app = typer.Typer(
    cls=ErrorBoundary,
    name="edgepfl",
    help="Personalized federated learning on phones and small boards (FedPer base/personal split).",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


app.add_typer(serve_app, name="serve")
app.add_typer(device_app, name="device")


@app.callback()
def _root() -> None:
    """Personalized federated learning on phones and small boards."""


@app.command()
@command(ExportCommand)
def export(command_options: ExportCommand) -> None:
    """Export a model split at K_P into an artifact bundle (manifest, ORT training, portable)."""
    try:
        from edgepfl.export import bundle, summary
        from edgepfl.export.blocks import block_rows
        from edgepfl.export.target import command_target
    except ImportError as exc:
        fail(EdgePFLError(f"export needs torch and onnx ({exc.name} is missing)", "pip install 'edgepfl[export]'"))
    target, options = command_target(command_options)
    from rich.console import Console

    console = Console(stderr=False)
    if command_options.show_blocks:
        rows = block_rows(target.module, target.blocks)
        origin = target.description.get("blocks_from", "zoo")
        summary.print_blocks(rows, f"{command_options.model}: blocks from the input end ({origin})", console)
        return
    with console.status("exporting") as status:
        manifest = bundle.export_target(
            target,
            command_options.split(),
            command_options.out,
            options,
            progress=lambda step: status.update(f"exporting {step}"),
            notice=lambda line: console.print(line, markup=False, highlight=False),
        )
    summary.print_summary(manifest, command_options.out, console)


@app.command("partition")
@command(PartitionCommand)
def partition_command(options: PartitionCommand) -> None:
    """Partition a dataset among clients and show the client x class counts (train/val/test per client)."""
    from edgepfl.datasets import load_partition
    from edgepfl.datasets.partition import partition_table, write_partition_file
    from edgepfl.errors import UsageError

    if not options.show and options.out is None:
        raise UsageError("partition has nothing to do", "add --show to print the table or --out FILE.json")
    data = options.data
    dataset, parts = load_partition(data, options.seed)
    from rich.console import Console
    from rich.measure import Measurement

    console = Console()
    console.print(
        f"{dataset.description}: {dataset.num_train} train + {len(dataset.y_test)} test samples ({dataset.verified})"
    )
    if options.show:
        split = ",".join(f"{fraction:g}" for fraction in data.split)
        generated = "" if data.partition.startswith("file:") else f" --seed {options.seed} --split {split}"
        title = f"{dataset.name} {data.partition}, {len(parts)} clients{generated}"
        table = partition_table(parts, dataset.labels, title=title, names=getattr(dataset, "client_names", ()))
        wide = Console(width=100_000)
        needed = Measurement.get(wide, wide.options, table).maximum
        Console(width=max(console.width, needed)).print(table)  # a cut-off count is worse than a wide line
    if options.out is not None:
        write_partition_file(options.out, parts)
        console.print(f"wrote {options.out} ({len(parts)} clients, index_space train+test)")


@app.command()
@command(SimulateConfig, config_file=read_config_file, required=("out",))
def simulate(config: SimulateConfig) -> None:
    """Run many clients and a server strategy in one process; results.json, a table and accuracy.png."""
    try:
        _run_simulation(config)
    except ImportError as exc:
        fail(EdgePFLError(f"simulate needs torch ({exc.name} is missing)", "pip install 'edgepfl[all]'"))


def _run_simulation(config) -> None:
    """Run with a progress bar, then print the table and write accuracy.png."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from edgepfl.simulate.loop import run_simulation
    from edgepfl.simulate.plots import PLOT_FILE, plot_runs
    from edgepfl.simulate.results import results_table

    console = Console()
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[detail]}"))
    with Progress(*columns, TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("preparing", total=config.rounds, detail="")

        def on_client(round_id: int, done: int, sampled: int) -> None:
            detail = f"round {round_id}/{config.rounds}, client {done}/{sampled}"
            bar.update(task, completed=round_id - 1 + done / sampled, description=config.algorithm, detail=detail)

        results = run_simulation(config, progress=on_client, status=lambda text: bar.update(task, description=text))
    console.print(results_table(results))
    if results.stopped is not None:
        console.print(results.stopped)
    plot = plot_runs([results], Path(config.out) / PLOT_FILE, x_axis="time" if config.fleet else "round")
    console.print(f"wrote {Path(config.out) / 'results.json'} and {plot}")


@app.command()
@command(PlotOptions)
def plot(options: PlotOptions) -> None:
    """Overlay the accuracy curves of one or more simulated runs in one PNG."""
    from edgepfl.simulate.plots import plot_run_folders

    path = plot_run_folders(options.runs, options.out, options.x)
    typer.echo(f"wrote {path}")


@app.command()
@command(DemoOptions)
def demo(options: DemoOptions) -> None:
    """FedPer vs FedAvg on 4 devices: a real `edgepfl serve` and 4 `edgepfl device run` processes on loopback."""
    try:
        from edgepfl.simulate.demo import run_demo

        run_demo(options)
    except ImportError as exc:
        fail(
            EdgePFLError(
                f"the demo exports a model and needs torch ({exc.name} is missing)", "pip install 'edgepfl[all]'"
            )
        )


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
