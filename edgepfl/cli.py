"""The `edgepfl` command. Components are imported inside each command, so a device never loads torch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from edgepfl.boundary import ErrorBoundary, fail
from edgepfl.device_runtime.cli import device_app
from edgepfl.errors import EdgePFLError
from edgepfl.server.cli import serve_app

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
    engines: Annotated[
        str | None,
        typer.Option(help="comma list of: ort-training, portable [default: both, or portable alone]"),
    ] = None,
    optimizer: Annotated[str, typer.Option(help="ORT-training optimizer: sgd | adamw")] = "sgd",
    seed: Annotated[int, typer.Option(help="seed of the initial weights (and of a new head)")] = 0,
    force: Annotated[bool, typer.Option("--force", help="replace a non-empty output folder")] = False,
    distill: Annotated[
        bool, typer.Option(help="also write PersFL distillation graphs for `device distill` (doubles export time)")
    ] = False,
) -> None:
    """Export a model split at K_P into an artifact bundle (manifest, ORT training, portable)."""
    try:
        from edgepfl.export import bundle, source
        from edgepfl.export.blocks import block_rows
        from edgepfl.export.models import ModelSpec, default_spec
    except ImportError as exc:
        fail(EdgePFLError(f"export needs torch and onnx ({exc.name} is missing)", "pip install 'edgepfl[export]'"))
    from edgepfl.errors import UsageError

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
        target = bundle.zoo_target(spec, seed)
        if weights is not None:
            source.load_weights(target.module, source.read_state_dict(weights), f"weights file {weights}")
    else:
        given = [name for name, value in zoo_options.items() if value is not None]
        if given:
            raise UsageError(f"{given[0]} applies to zoo models only", "use --input-shape/--num-classes")
        shape = source.parse_input_shape(input_shape) if input_shape is not None else None
        loaded = source.build_from_string(parsed, shape, weights, num_classes, seed)
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
    options = bundle.ExportOptions(
        engines=bundle.default_engines()
        if engines is None
        else tuple(e.strip() for e in engines.split(",") if e.strip()),
        optimizer=optimizer,
        seed=seed,
        force=force,
        distill=distill,
    )
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
    config_file: Annotated[Path | None, typer.Option("--config", help="JSON or TOML file of these options")] = None,
    out: Annotated[str | None, typer.Option(help="run folder (results.json, accuracy.png); rerun to resume")] = None,
    model: Annotated[
        str | None, typer.Option(help="zoo model: mobilenet, cnn, mlp, resnet34 (default: mobilenet)")
    ] = None,
    width: Annotated[float | None, typer.Option(help="MobileNet width: 0.25|0.5|0.75|1.0 (default: 0.25)")] = None,
    kp: Annotated[int | None, typer.Option(help="personal blocks from the classifier (default: 2)")] = None,
    norm: Annotated[str | None, typer.Option(help="batch | group | none (default: the model's default)")] = None,
    algorithm: Annotated[
        str | None,
        typer.Option(
            help="fedavg | local | fedper (=fedsim) | fedalt | fedper-ft | pfedla | heurpfedla | persfl [fedper]"
        ),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(help="mnist, fashion-mnist, emnist[-SPLIT], cifar10, cifar100, or .npz (default: cifar10)"),
    ] = None,
    data_root: Annotated[str | None, typer.Option(help="folder that holds the dataset (default: data)")] = None,
    download: Annotated[bool | None, typer.Option("--download", help="download the dataset if missing")] = None,
    checksums: Annotated[str | None, typer.Option(help="md5 list (JSON or CSV) of a known dataset copy")] = None,
    partition: Annotated[
        str | None,
        typer.Option(help="iid | classes:K | dirichlet:A | ds3 | dominant:D | file:PATH.json (default: classes:4)"),
    ] = None,
    clients: Annotated[int | None, typer.Option(help="number of clients (default: 10)")] = None,
    split: Annotated[
        str | None, typer.Option(help="each client's train,val,test fractions (default: 0.6,0.2,0.2)")
    ] = None,
    fraction: Annotated[float | None, typer.Option(help="fraction of clients sampled per round (default: 1.0)")] = None,
    rounds: Annotated[int | None, typer.Option(help="rounds (default: 50)")] = None,
    epochs: Annotated[int | None, typer.Option(help="local epochs per round (default: 4)")] = None,
    batch_size: Annotated[int | None, typer.Option(help="local batch size (default: 128)")] = None,
    lr: Annotated[float | None, typer.Option(help="SGD learning rate (default: 0.01)")] = None,
    finetune_epochs: Annotated[
        int | None, typer.Option(help="fedper-ft: fine-tuning epochs per round (default: 1)")
    ] = None,
    personal_epochs: Annotated[int | None, typer.Option(help="fedalt: personal-phase epochs (default: 1)")] = None,
    engine: Annotated[str | None, typer.Option(help="torch | portable | ort-training (default: torch)")] = None,
    seed: Annotated[
        int | None, typer.Option(help="seed of partition, init, sampling and shuffling (default: 0)")
    ] = None,
    threads: Annotated[int | None, typer.Option(help="CPU threads of the engine")] = None,
    workers: Annotated[
        int | None, typer.Option(help="train a round's clients in this many Ray actors (default: 1, no Ray)")
    ] = None,
    ray_address: Annotated[
        str | None, typer.Option(help="join this Ray cluster (e.g. ray://head:10001 or auto) instead of a local Ray")
    ] = None,
    client_cpus: Annotated[float | None, typer.Option(help="CPUs each Ray actor reserves (default: 1)")] = None,
    client_gpus: Annotated[float | None, typer.Option(help="GPUs each Ray actor reserves (default: 0)")] = None,
    hn_lr: Annotated[
        float | None, typer.Option(help="pfedla, heurpfedla: hypernetwork learning rate (default: 0.005)")
    ] = None,
    retain_top_k: Annotated[
        int | None, typer.Option(help="heurpfedla: tensors each client keeps instead of exchanging (default: 1)")
    ] = None,
    distill_lambdas: Annotated[
        str | None, typer.Option(help="persfl: λ grid, comma-separated (default: 0.1,0.3,0.5,0.7,0.9)")
    ] = None,
    distill_temperatures: Annotated[
        str | None, typer.Option(help="persfl: temperature grid, comma-separated (default: 1,2,4,8)")
    ] = None,
    distill_epochs: Annotated[int | None, typer.Option(help="persfl: epochs per (λ, T) (default: 5)")] = None,
    distill_lr: Annotated[float | None, typer.Option(help="persfl: distillation learning rate (default: 0.05)")] = None,
    distill_variant: Annotated[
        str | None, typer.Option(help="persfl: kd (soft-label KL) | gd (PersFL-GD, Eq. 7) (default: kd)")
    ] = None,
) -> None:
    """Run many clients and a server strategy in one process; results.json, a table and accuracy.png."""
    from edgepfl.errors import UsageError

    given = {
        "out": out,
        "model": model,
        "width": width,
        "kp": kp,
        "norm": norm,
        "algorithm": algorithm,
        "dataset": dataset,
        "data_root": data_root,
        "download": download,
        "checksums": checksums,
        "partition": partition,
        "clients": clients,
        "split": split,
        "fraction": fraction,
        "rounds": rounds,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "finetune_epochs": finetune_epochs,
        "personal_epochs": personal_epochs,
        "engine": engine,
        "seed": seed,
        "threads": threads,
        "workers": workers,
        "ray_address": ray_address,
        "client_cpus": client_cpus,
        "client_gpus": client_gpus,
        "hn_lr": hn_lr,
        "retain_top_k": retain_top_k,
        "distill_lambdas": distill_lambdas,
        "distill_temperatures": distill_temperatures,
        "distill_epochs": distill_epochs,
        "distill_lr": distill_lr,
        "distill_variant": distill_variant,
    }
    try:
        from edgepfl.simulate.config import config_from_json, read_config_file

        values = read_config_file(config_file) if config_file is not None else {}
        values = {**values, **{key: value for key, value in given.items() if value is not None}}
        if "out" not in values:
            raise UsageError("simulate needs a run folder", "pass --out runs/NAME (or out in the --config file)")
        config = config_from_json(values, origin=str(config_file) if config_file else "options")
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
    rounds: Annotated[int, typer.Option(help="federated rounds per run (3-5 recommended)")] = 4,
    workdir: Annotated[
        Path | None, typer.Option(help="folder for bundles, server state and logs (default: a temp folder)")
    ] = None,
    port: Annotated[int, typer.Option(help="loopback port of the demo server (0: pick a free one)")] = 0,
    keep: Annotated[bool, typer.Option("--keep", help="keep the work folder")] = False,
) -> None:
    """FedPer vs FedAvg on 4 devices: a real `edgepfl serve` and 4 `edgepfl device run` processes on loopback."""
    try:
        from edgepfl.simulate.demo import DemoOptions, run_demo

        run_demo(DemoOptions(rounds=rounds, workdir=workdir, port=port, keep=keep))
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
