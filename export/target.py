"""What `edgepfl export` exports: the model its options name, built as an export target, and the export options."""

from __future__ import annotations

from edgepfl.datasets.har import HAR_ACTIVITIES
from edgepfl.errors import UsageError
from edgepfl.export import bundle, source
from edgepfl.export.bundle import ExportTarget
from edgepfl.export.models import ModelSpec, default_spec
from edgepfl.export.options import ExportCommand, ExportOptions, read_class_names_file
from edgepfl.export.sequence_options import SENSOR_MODELS, SEQUENCE_MODELS


def command_target(chosen: ExportCommand) -> tuple[ExportTarget, ExportOptions]:
    """The target `chosen` names (a zoo, text or sensor model, or torchvision:/factory; --weights loaded) and its
    export options (--class-names-file read; HAPT's activities by default); UsageError for an option that does not
    apply to that model."""
    zoo, options, model = chosen.zoo, chosen.options, chosen.model
    if chosen.class_names_file is not None:
        options = options.model_copy(update={"class_names": read_class_names_file(chosen.class_names_file)})
    parsed = source.parse_model(model)
    if model not in SEQUENCE_MODELS and chosen.sequence.given():
        raise UsageError(f"{chosen.sequence.given()[0]} applies to text and sensor models only", "drop it")
    if parsed.is_zoo and model in SEQUENCE_MODELS:
        if chosen.input_shape is not None or zoo.input_size is not None or zoo.in_channels is not None:
            raise UsageError(
                "--input-shape/--input-size/--in-channels do not apply to text and sensor models",
                "use --seq-len (text) or --channels/--window (sensors)",
            )
        from edgepfl.export.textmodels import sequence_target

        target = sequence_target(model, chosen.sequence, options.seed, zoo.width, zoo.norm, chosen.num_classes)
        if model in SENSOR_MODELS and not options.class_names:  # a person recording picks an activity by its name
            if chosen.sequence.given(("sensor models",)) or chosen.num_classes is not None:
                raise UsageError(
                    f"the sensor model {model} with its own channels, window or classes needs its activities' names",
                    "pass --class-names, one name per class in class order (e.g. --class-names walking,sitting)",
                )
            options = options.model_copy(update={"class_names": HAR_ACTIVITIES})  # UCI HAPT's, as `--dataset har`'s
    elif parsed.is_zoo:
        if chosen.input_shape is not None:
            raise UsageError("--input-shape is for torchvision:/factory models", "use --input-size/--in-channels")
        base = default_spec(model)
        spec = ModelSpec(
            name=model,
            width=base.width if zoo.width is None else zoo.width,
            input_size=base.input_size if zoo.input_size is None else zoo.input_size,
            in_channels=base.in_channels if zoo.in_channels is None else zoo.in_channels,
            num_classes=base.num_classes if chosen.num_classes is None else chosen.num_classes,
            norm=base.norm if zoo.norm is None else zoo.norm,
        )
        target = bundle.zoo_target(spec, options.seed)
    else:
        given = zoo.given()
        if given:
            raise UsageError(f"{given[0]} applies to zoo models only", "use --input-shape/--num-classes")
        shape = source.parse_input_shape(chosen.input_shape) if chosen.input_shape is not None else None
        loaded = source.build_from_string(parsed, shape, chosen.weights, chosen.num_classes, options.seed)
        target = bundle.module_target(loaded.module, loaded.input_shape, None, loaded.normalization, loaded.description)
    if parsed.is_zoo and chosen.weights is not None:
        source.load_weights(target.module, source.read_state_dict(chosen.weights), f"weights file {chosen.weights}")
    return target, options
