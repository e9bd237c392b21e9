"""`edgepfl device predict | export-model`: the device uses what it learned (registered on `device_app`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from edgepfl.commands import command
from edgepfl.device_runtime.cli import _print_result, device_app
from edgepfl.device_runtime.options import ExportModelCommand, PredictCommand

if TYPE_CHECKING:
    from edgepfl.device_runtime.predict import DeviceModel, Prediction


@device_app.command()
@command(PredictCommand)
def predict(options: PredictCommand) -> None:
    """Each input's most likely classes by this device's model: its personal part with the current base.

    Images are pre-processed exactly as training data. The state folder is only read, so this also works
    while `device run` uses it; without a trained model it says so and uses the bundle's initial one.
    """
    from edgepfl.device_runtime.predict import Prediction, next_words, open_device_model, predict_inputs, top_classes
    from edgepfl.errors import UsageError

    local, phrase = options.local, options.predict.text
    if phrase is not None and options.inputs:
        raise UsageError("device predict got both input files and --text", "pass files, or --text 'a phrase'")
    if phrase is None and not options.inputs:
        raise UsageError("device predict has nothing to predict", "pass image or .npz files, or --text 'a phrase'")
    model = open_device_model(options.files.bundle, options.files.state, local.engine, local.threads)
    if phrase is not None:
        words = next_words(model.engine, phrase, options.predict.top, Path(options.files.state))
        predictions = [Prediction(phrase, words)]
    else:
        names, probabilities = predict_inputs(options.inputs, model.engine)
        labels = model.engine.manifest.class_labels
        predictions = top_classes(names, probabilities, labels, options.predict.top)
    _print_predictions(model, predictions, options.output.as_json)


@device_app.command("export-model")
@command(ExportModelCommand)
def export_model(options: ExportModelCommand) -> None:
    """Write this device's model as one plain ONNX inference model that any onnxruntime loads without edgepfl.

    The current base, personal part and BatchNorm statistics are baked in; metadata_props say how to
    pre-process an image. --quantize int8 needs --data (its training part calibrates, its held-out part
    measures both models' accuracy).
    """
    from edgepfl.data import load_device_data
    from edgepfl.device_runtime.model_export import export_device_model
    from edgepfl.device_runtime.predict import open_device_model

    local, export = options.local, options.export
    model = open_device_model(options.files.bundle, options.files.state, local.engine, local.threads)
    data = options.data
    local_data = (
        load_device_data(data, model.engine.manifest, local.val_fraction, local.seed, model.engine.bundle_dir)
        if data
        else None
    )
    exported = export_device_model(model, options.out, export.quantize, local_data, export.calibration_samples)
    result = {key: str(value) if isinstance(value, Path) else value for key, value in vars(exported).items()}
    _print_result({**result, "model": model.description}, options.output.as_json, "device export-model")


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
