"""The `edgepfl` command. Components are imported inside each command, so a device never loads torch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from edgepfl.device_runtime.cli import device_app
from edgepfl.errors import EdgePFLError
from edgepfl.server.cli import serve_app

app = typer.Typer(
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


def fail(error: EdgePFLError) -> None:
    """Print one line naming the problem and the fix, then exit with code 2."""
    typer.echo(f"error: {error}", err=True)
    raise typer.Exit(code=2)


@app.command()
def export(
    model: Annotated[str, typer.Argument(help="zoo model: mobilenet, cnn, mlp, resnet34")],
    kp: Annotated[int, typer.Option(help="personal blocks counted from the classifier (0 = FedAvg)")] = 2,
    out: Annotated[Path, typer.Option(help="bundle folder to write")] = Path("bundle"),
    width: Annotated[float | None, typer.Option(help="MobileNet width multiplier: 0.25|0.5|0.75|1.0")] = None,
    input_size: Annotated[int | None, typer.Option(help="image side: 32 (CIFAR), 28 (MNIST), 224")] = None,
    in_channels: Annotated[int | None, typer.Option(help="input channels: 3 colour, 1 grey")] = None,
    num_classes: Annotated[int | None, typer.Option(help="number of classes")] = None,
    norm: Annotated[str | None, typer.Option(help="batch | group | none")] = None,
    engines: Annotated[str, typer.Option(help="comma list of: ort-training, portable")] = "ort-training",
    optimizer: Annotated[str, typer.Option(help="ORT-training optimizer: sgd | adamw")] = "sgd",
    seed: Annotated[int, typer.Option(help="seed of the initial weights")] = 0,
    force: Annotated[bool, typer.Option("--force", help="replace a non-empty output folder")] = False,
) -> None:
    """Export a zoo model split at K_P into an artifact bundle (manifest, ORT training, portable)."""
    try:
        from edgepfl.export.bundle import ExportOptions, export_bundle, print_summary
        from edgepfl.export.models import ModelSpec, default_spec, validate_spec
    except ImportError as exc:
        fail(EdgePFLError(f"export needs torch and onnx ({exc.name} is missing)", "pip install 'edgepfl[export]'"))
    try:
        base = default_spec(model) if model in ("mobilenet", "cnn", "mlp", "resnet34") else ModelSpec(name=model)
        spec = ModelSpec(
            name=model,
            width=base.width if width is None else width,
            input_size=base.input_size if input_size is None else input_size,
            in_channels=base.in_channels if in_channels is None else in_channels,
            num_classes=base.num_classes if num_classes is None else num_classes,
            norm=base.norm if norm is None else norm,
        )
        validate_spec(spec)
        options = ExportOptions(
            engines=tuple(e.strip() for e in engines.split(",") if e.strip()),
            optimizer=optimizer,
            seed=seed,
            force=force,
        )
        from rich.console import Console

        console = Console(stderr=False)
        with console.status("exporting") as status:
            manifest = export_bundle(spec, kp, out, options, progress=lambda step: status.update(f"exporting {step}"))
        print_summary(manifest, out, console)
    except EdgePFLError as error:
        fail(error)


@app.command("partition")
def partition_command(
    dataset: Annotated[
        str, typer.Option(help="mnist, fashion-mnist, emnist[-SPLIT], cifar10, cifar100, or a .npz path")
    ] = "mnist",
    data_root: Annotated[Path, typer.Option(help="folder that holds the dataset")] = Path("data"),
    partition: Annotated[
        str, typer.Option(help="iid | classes:K | dirichlet:ALPHA | ds3 | dominant:D[:SHARE] | file:PATH.json")
    ] = "iid",
    clients: Annotated[int | None, typer.Option(help="number of clients (default 10; file: takes the file's)")] = None,
    seed: Annotated[int, typer.Option(help="seed of the partition")] = 0,
    split: Annotated[str, typer.Option(help="each client's train,val,test fractions")] = "0.6,0.2,0.2",
    show: Annotated[bool, typer.Option("--show", help="print the client x class count table")] = False,
    out: Annotated[Path | None, typer.Option(help="write the partition as a file: JSON (train+test indices)")] = None,
    download: Annotated[bool, typer.Option("--download", help="download the dataset if it is missing")] = False,
    checksums: Annotated[
        Path | None, typer.Option(help="md5 list (JSON or CSV) of a known copy of the dataset")
    ] = None,
) -> None:
    """Partition a dataset among clients and show the client x class counts (train/val/test per client)."""
    from edgepfl.datasets import load_dataset
    from edgepfl.errors import UsageError
    from edgepfl.partition import make_partition, parse_split, partition_table, write_partition_file

    try:
        if not show and out is None:
            raise UsageError("partition has nothing to do", "add --show to print the table or --out FILE.json")
        fractions = parse_split(split)
        data = load_dataset(dataset, data_root, download=download, checksums=checksums)
        if clients is None and not partition.startswith("file:"):
            clients = 10
        parts = make_partition(partition, data.y_train, data.y_test, clients, seed, fractions)
        from rich.console import Console
        from rich.measure import Measurement

        console = Console()
        console.print(f"{data.description}: {data.num_train} train + {len(data.y_test)} test samples ({data.verified})")
        if show:
            generated = "" if partition.startswith("file:") else f" --seed {seed} --split {split}"
            title = f"{data.name} {partition}, {len(parts)} clients{generated}"
            table = partition_table(parts, data.labels, title=title)
            wide = Console(width=100_000)
            needed = Measurement.get(wide, wide.options, table).maximum
            Console(width=max(console.width, needed)).print(table)  # a cut-off count is worse than a wide line
        if out is not None:
            write_partition_file(out, parts)
            console.print(f"wrote {out} ({len(parts)} clients, index_space train+test)")
    except EdgePFLError as error:
        fail(error)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
