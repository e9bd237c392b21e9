"""`edgepfl device predict | export-model`: the device uses what it learned (registered on `device_app`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from edgepfl.device_runtime.cli import AsJson, Bundle, State, _local, _print_result, device_app
from edgepfl.device_runtime.options import LocalOptions, ModelExportOptions, PredictOptions
from edgepfl.options import flag, validated

if TYPE_CHECKING:
    from edgepfl.device_runtime.predict import DeviceModel, Prediction


@device_app.command()
def predict(
    inputs: Annotated[list[Path], typer.Argument(help="image files, folders of images, or .npz files (images as x)")],
    bundle: Bundle,
    state: State,
    top: int = flag(PredictOptions, "top"),
    engine: str = flag(LocalOptions, "engine"),
    threads: int | None = flag(LocalOptions, "threads"),
    as_json: AsJson = False,
) -> None:
    """Each input's most likely classes by this device's model: its personal part with the current base.

    Images are pre-processed exactly as training data. The state folder is only read, so this also works
    while `device run` uses it; without a trained model it says so and uses the bundle's initial one.
    """
    from edgepfl.device_runtime.predict import open_device_model, predict_inputs, top_classes

    options = validated(PredictOptions, {"top": top})
    local = validated(LocalOptions, {"engine": engine, "threads": threads})
    model = open_device_model(bundle, state, local.engine, local.threads)
    names, probabilities = predict_inputs(inputs, model.engine)
    labels = model.engine.manifest.class_labels
    _print_predictions(model, top_classes(names, probabilities, labels, options.top), as_json)


@device_app.command("export-model")
def export_model(
    bundle: Bundle,
    state: State,
    out: Annotated[Path, typer.Option(help="the .onnx file to write")],
    quantize: str = flag(ModelExportOptions, "quantize"),
    data: Annotated[
        Path | None, typer.Option(help="the device's data (.npz or image folder): calibrates int8, measures accuracy")
    ] = None,
    calibration_samples: int = flag(ModelExportOptions, "calibration_samples"),
    engine: str = flag(LocalOptions, "engine"),
    val_fraction: float = flag(LocalOptions, "val_fraction"),
    seed: int = flag(LocalOptions, "seed"),
    threads: int | None = flag(LocalOptions, "threads"),
    as_json: AsJson = False,
) -> None:
    """Write this device's model as one plain ONNX inference model that any onnxruntime loads without edgepfl.

    The current base, personal part and BatchNorm statistics are baked in; metadata_props say how to
    pre-process an image. --quantize int8 needs --data (its training part calibrates, its held-out part
    measures both models' accuracy).
    """
    from edgepfl.device_runtime.data import load_device_data
    from edgepfl.device_runtime.model_export import export_device_model
    from edgepfl.device_runtime.predict import open_device_model

    options = validated(ModelExportOptions, {"quantize": quantize, "calibration_samples": calibration_samples})
    local = _local(engine, val_fraction, seed, threads)
    model = open_device_model(bundle, state, local.engine, local.threads)
    local_data = load_device_data(data, model.engine.manifest, local.val_fraction, local.seed) if data else None
    exported = export_device_model(model, out, options.quantize, local_data, options.calibration_samples)
    result = {key: str(value) if isinstance(value, Path) else value for key, value in vars(exported).items()}
    _print_result({**result, "model": model.description}, as_json, "device export-model")


def _print_predictions(model: DeviceModel, predictions: list[Prediction], as_json: bool) -> None:
    """JSON for machines (--json), a table for people."""
    if as_json:
        document = {
            "model": {
                "trained": model.trained,
                "last_completed_round": model.last_completed_round,
                "engine": model.engine.name,
                "description": model.description,
            },
            "predictions": [prediction.to_json() for prediction in predictions],
        }
        typer.echo(json.dumps(document))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"device predict: {model.description}")
    table.add_column("input")
    for rank in range(len(predictions[0].top)):
        table.add_column(f"#{rank + 1}")
    for prediction in predictions:
        table.add_row(prediction.input, *(f"{name} {p:.1%}" for _, name, p in prediction.top))
    Console().print(table)
