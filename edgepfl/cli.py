"""The `edgepfl` command. Components are imported inside each command, so a device never loads torch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from edgepfl.boundary import ErrorBoundary, fail
from edgepfl.device_runtime.cli import device_app
from edgepfl.errors import EdgePFLError
from edgepfl.export.options import ExportOptions, read_class_names_file
from edgepfl.options import field_help, flag, validated
from edgepfl.server.cli import serve_app
from edgepfl.simulate.config import SimulateConfig
from edgepfl.simulate.demo import DemoOptions

app = typer.Typer(cls=ErrorBoundary,
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
def export(
    model: Annotated[
        str,
        typer.Argument(
            help="zoo model (mobilenet, cnn, mlp, resnet34), torchvision:NAME, path/to/file.py:factory "
            "or package.module:factory"
        ),
    ],
    kp: Annotated[int, typer.Option(help="personal blocks counted from the classifier (0 = FedAvg)")] = 2,
    out: Annotated[Path, typer.Option(help="bundle folder to write")] = Path("bundle"),
    input_shape: Annotated[
        str | None, typer.Option(help="C,H,W of one sample (torchvision:/factory models; torchvision: 3,224,224)")
    ] = None,
    weights: Annotated[
        Path | None, typer.Option(help="local state_dict file (.pt/.pth via torch.load weights_only, or .safetensors)")
    ] = None,
    num_classes: Annotated[
        int | None,
        typer.Option(help="number of classes (torchvision:/factory models: a new, freshly initialised head)"),
    ] = None,
    show_blocks: Annotated[
        bool, typer.Option("--show-blocks", help="print the blocks and what each --kp would upload, then stop")
    ] = False,
    width: Annotated[float | None, typer.Option(help="zoo MobileNet width multiplier: 0.25|0.5|0.75|1.0")] = None,
    input_size: Annotated[int | None, typer.Option(help="zoo image side: 32 (CIFAR), 28 (MNIST), 224")] = None,
    in_channels: Annotated[int | None, typer.Option(help="zoo input channels: 3 colour, 1 grey")] = None,
    norm: Annotated[str | None, typer.Option(help="zoo normalisation: batch | group | none")] = None,
    engines: Annotated[str | None, typer.Option(help=field_help(ExportOptions.model_fields["engines"]))] = None,
    optimizer: str = flag(ExportOptions, "optimizer"),
    seed: int = flag(ExportOptions, "seed"),
    force: bool = flag(ExportOptions, "force"),
    distill: bool = flag(ExportOptions, "distill"),
    frozen_variants: bool = flag(ExportOptions, "frozen_variants", "--frozen-variants/--no-frozen-variants"),
    class_names: str | None = flag(ExportOptions, "class_names", unset_default=True),
    class_names_file: Annotated[Path | None, typer.Option(help="file of class names, one per line")] = None,
) -> None:
    """Export a model split at K_P into an artifact bundle (manifest, ORT training, portable)."""
    try:
        from edgepfl.export import bundle, source
        from edgepfl.export.blocks import block_rows
        from edgepfl.export.models import ModelSpec, default_spec
    except ImportError as exc:
        fail(EdgePFLError(f"export needs torch and onnx ({exc.name} is missing)", "pip install 'edgepfl[export]'"))
    from edgepfl.errors import UsageError

    chosen = {"optimizer": optimizer, "seed": seed, "force": force, "distill": distill}
    chosen["frozen_variants"] = frozen_variants
    if class_names is not None and class_names_file is not None:
        raise UsageError("both --class-names and --class-names-file are given", "pass only one of them")
    if class_names is not None or class_names_file is not None:
        chosen["class_names"] = class_names if class_names_file is None else read_class_names_file(class_names_file)
    if engines is not None:
        chosen["engines"] = tuple(name.strip() for name in engines.split(",") if name.strip())
    options = validated(ExportOptions, chosen)
    parsed = source.parse_model(model)
    zoo_options = {"--width": width, "--input-size": input_size, "--in-channels": in_channels, "--norm": norm}
    if parsed.is_zoo:
        if input_shape is not None:
            raise UsageError("--input-shape is for torchvision:/factory models", "use --input-size/--in-channels")
        base = default_spec(model)
        spec = ModelSpec(
            name=model,
            width=base.width if width is None else width,
            input_size=base.input_size if input_size is None else input_size,
            in_channels=base.in_channels if in_channels is None else in_channels,
            num_classes=base.num_classes if num_classes is None else num_classes,
            norm=base.norm if norm is None else norm,
        )
        target = bundle.zoo_target(spec, options.seed)
        if weights is not None:
            source.load_weights(target.module, source.read_state_dict(weights), f"weights file {weights}")
    else:
        given = [name for name, value in zoo_options.items() if value is not None]
        if given:
            raise UsageError(f"{given[0]} applies to zoo models only", "use --input-shape/--num-classes")
        shape = source.parse_input_shape(input_shape) if input_shape is not None else None
        loaded = source.build_from_string(parsed, shape, weights, num_classes, options.seed)
        target = bundle.module_target(
            loaded.module, loaded.input_shape, None, loaded.normalization, loaded.description
        )
    from rich.console import Console

    console = Console(stderr=False)
    if show_blocks:
        rows = block_rows(target.module, target.blocks)
        bundle.print_blocks(
            rows, f"{model}: blocks from the input end ({target.description.get('blocks_from', 'zoo')})", console
        )
        return
    with console.status("exporting") as status:
        manifest = bundle.export_target(
            target,
            kp,
            out,
            options,
            progress=lambda step: status.update(f"exporting {step}"),
            notice=lambda line: console.print(line, markup=False, highlight=False),
        )
    bundle.print_summary(manifest, out, console)


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


@app.command()
def simulate(
    ctx: typer.Context,
    config_file: Annotated[Path | None, typer.Option("--config", help="JSON or TOML file of these options")] = None,
    out: str | None = flag(SimulateConfig, 'out', unset_default=True),
    model: str | None = flag(SimulateConfig, 'model', unset_default=True),
    width: float | None = flag(SimulateConfig, 'width', unset_default=True),
    kp: int | None = flag(SimulateConfig, 'kp', unset_default=True),
    norm: str | None = flag(SimulateConfig, 'norm', unset_default=True),
    algorithm: str | None = flag(SimulateConfig, 'algorithm', unset_default=True),
    dataset: str | None = flag(SimulateConfig, 'dataset', unset_default=True),
    data_root: str | None = flag(SimulateConfig, 'data_root', unset_default=True),
    download: bool | None = flag(SimulateConfig, 'download', unset_default=True),
    checksums: str | None = flag(SimulateConfig, 'checksums', unset_default=True),
    partition: str | None = flag(SimulateConfig, 'partition', unset_default=True),
    clients: int | None = flag(SimulateConfig, 'clients', unset_default=True),
    split: str | None = flag(SimulateConfig, 'split', unset_default=True),
    fraction: float | None = flag(SimulateConfig, 'fraction', unset_default=True),
    min_clients: int | None = flag(SimulateConfig, 'min_clients', unset_default=True),
    rounds: int | None = flag(SimulateConfig, 'rounds', unset_default=True),
    epochs: int | None = flag(SimulateConfig, 'epochs', unset_default=True),
    batch_size: int | None = flag(SimulateConfig, 'batch_size', unset_default=True),
    lr: float | None = flag(SimulateConfig, 'lr', unset_default=True),
    finetune_epochs: int | None = flag(SimulateConfig, 'finetune_epochs', unset_default=True),
    personal_epochs: int | None = flag(SimulateConfig, 'personal_epochs', unset_default=True),
    share_buffers: bool | None = flag(SimulateConfig, 'share_buffers', unset_default=True),
    recompute_bn: bool | None = flag(
        SimulateConfig, 'recompute_bn', '--recompute-bn/--no-recompute-bn', unset_default=True
    ),
    upload_encoding: str | None = flag(SimulateConfig, 'upload_encoding', unset_default=True),
    download_encoding: str | None = flag(SimulateConfig, 'download_encoding', unset_default=True),
    dp_noise_multiplier: float | None = flag(SimulateConfig, 'dp_noise_multiplier', unset_default=True),
    dp_clip: float | None = flag(SimulateConfig, 'dp_clip', unset_default=True),
    dp_delta: float | None = flag(SimulateConfig, 'dp_delta', unset_default=True),
    dp_target_epsilon: float | None = flag(SimulateConfig, 'dp_target_epsilon', unset_default=True),
    engine: str | None = flag(SimulateConfig, 'engine', unset_default=True),
    seed: int | None = flag(SimulateConfig, 'seed', unset_default=True),
    threads: int | None = flag(SimulateConfig, 'threads', unset_default=True),
    device: str | None = flag(SimulateConfig, 'device', unset_default=True),
    workers: int | None = flag(SimulateConfig, 'workers', unset_default=True),
    ray_address: str | None = flag(SimulateConfig, 'ray_address', unset_default=True),
    client_cpus: float | None = flag(SimulateConfig, 'client_cpus', unset_default=True),
    client_gpus: float | None = flag(SimulateConfig, 'client_gpus', unset_default=True),
    hn_lr: float | None = flag(SimulateConfig, 'hn_lr', unset_default=True),
    retain_top_k: int | None = flag(SimulateConfig, 'retain_top_k', unset_default=True),
    distill_lambdas: str | None = flag(SimulateConfig, 'distill_lambdas', unset_default=True),
    distill_temperatures: str | None = flag(SimulateConfig, 'distill_temperatures', unset_default=True),
    distill_epochs: int | None = flag(SimulateConfig, 'distill_epochs', unset_default=True),
    distill_lr: float | None = flag(SimulateConfig, 'distill_lr', unset_default=True),
    distill_variant: str | None = flag(SimulateConfig, 'distill_variant', unset_default=True),
) -> None:
    """Run many clients and a server strategy in one process; results.json, a table and accuracy.png."""
    from edgepfl.errors import UsageError
    from edgepfl.simulate.config import config_from_json, read_config_file

    given = {name: value for name, value in ctx.params.items() if value is not None and name != "config_file"}
    values = {**(read_config_file(config_file) if config_file is not None else {}), **given}
    if "out" not in values:
        raise UsageError("simulate needs a run folder", "pass --out runs/NAME (or out in the --config file)")
    config = config_from_json(values, origin=str(config_file) if config_file else "options", flags=given)
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
    plot = plot_runs([results], Path(config.out) / PLOT_FILE)
    console.print(f"wrote {Path(config.out) / 'results.json'} and {plot}")


@app.command()
def plot(
    runs: Annotated[list[Path], typer.Argument(help="run folders written by edgepfl simulate")],
    out: Annotated[
        Path | None, typer.Option(help="PNG to write (default: RUN/accuracy.png for one run, else accuracy.png)")
    ] = None,
) -> None:
    """Overlay the accuracy curves of one or more simulated runs in one PNG."""
    from edgepfl.simulate.plots import plot_run_folders

    path = plot_run_folders(runs, out)
    typer.echo(f"wrote {path}")


@app.command()
def demo(
    rounds: int = flag(DemoOptions, "rounds"),
    workdir: Path | None = flag(DemoOptions, "workdir"),
    port: int = flag(DemoOptions, "port"),
    keep: bool = flag(DemoOptions, "keep"),
) -> None:
    """FedPer vs FedAvg on 4 devices: a real `edgepfl serve` and 4 `edgepfl device run` processes on loopback."""
    options = validated(DemoOptions, {"rounds": rounds, "workdir": workdir, "port": port, "keep": keep})
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
