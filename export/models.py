"""The model zoo: each model is an nn.Module whose layers are grouped into an ordered list of blocks."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgepfl.errors import UsageError
from edgepfl.export import blocks

MODEL_NAMES = ("mobilenet", "cnn", "mlp", "resnet34")
WIDTHS = (0.25, 0.5, 0.75, 1.0)
NORMS = ("batch", "group", "none")
MOBILENET_INPUT_SIZES = (28, 32, 224)

# Normalisation recorded in the manifest: CIFAR-10 statistics for colour inputs, MNIST for grey.
_RGB_MEAN, _RGB_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
_GREY_MEAN, _GREY_STD = (0.1307,), (0.3081,)


@dataclass(frozen=True)
class ModelSpec:
    """What to build: a zoo name and its knobs. Recorded verbatim in the manifest."""

    name: str = "mobilenet"
    width: float = 1.0
    input_size: int = 32
    in_channels: int = 3
    num_classes: int = 10
    norm: str = "batch"

    def to_dict(self) -> dict:
        """JSON form for the manifest."""
        return asdict(self)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """Per-sample input shape, channels first."""
        return (self.in_channels, self.input_size, self.input_size)

    @property
    def normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(mean, std) per channel applied to pixels scaled to [0, 1]."""
        if self.in_channels == 1:
            return _GREY_MEAN, _GREY_STD
        if self.in_channels == 3:
            return _RGB_MEAN, _RGB_STD
        return (0.5,) * self.in_channels, (0.5,) * self.in_channels


def default_spec(name: str) -> ModelSpec:
    """The seed papers' default setting for each zoo model."""
    if name == "mlp":
        return ModelSpec(name="mlp", input_size=28, in_channels=1, norm="none")
    if name == "cnn":
        return ModelSpec(name="cnn", norm="none")
    return ModelSpec(name=name)


def validate_spec(spec: ModelSpec) -> None:
    """Reject unknown models and knobs with one line naming the valid choices."""
    if spec.name not in MODEL_NAMES:
        raise UsageError(f"unknown model {spec.name!r}", f"choose one of: {', '.join(MODEL_NAMES)}")
    if spec.width not in WIDTHS:
        raise UsageError(f"width {spec.width} is not allowed", f"choose one of: {', '.join(map(str, WIDTHS))}")
    if spec.norm not in NORMS:
        raise UsageError(f"unknown norm {spec.norm!r}", f"choose one of: {', '.join(NORMS)}")
    if spec.num_classes < 2:
        raise UsageError(f"num-classes {spec.num_classes} is too small", "use at least 2 classes")
    if spec.in_channels < 1:
        raise UsageError(f"in-channels {spec.in_channels} must be positive", "use 1 (grey) or 3 (colour)")
    if spec.name == "mobilenet" and spec.input_size not in MOBILENET_INPUT_SIZES:
        raise UsageError(
            f"mobilenet input size {spec.input_size} is not supported",
            f"choose one of: {', '.join(map(str, MOBILENET_INPUT_SIZES))}",
        )
    if spec.name in ("cnn", "resnet34") and spec.input_size not in (28, 32):
        raise UsageError(f"{spec.name} input size {spec.input_size} is not supported", "choose 28 or 32")
    if spec.name == "mlp" and spec.input_size < 1:
        raise UsageError(f"mlp input size {spec.input_size} must be positive", "use 28 for MNIST")
    if spec.name == "mlp" and spec.norm != "none":
        raise UsageError("the mlp model has no normalisation layers", "use --norm none with mlp")


def build_model(spec: ModelSpec) -> BlockModel:
    """Instantiate a zoo model (deterministic under torch.manual_seed)."""
    validate_spec(spec)
    norm = _norm_factory(spec.norm)
    if spec.name == "mobilenet":
        return MobileNetV1(spec, norm)
    if spec.name == "cnn":
        return CifarCNN(spec, norm)
    if spec.name == "mlp":
        return MnistMLP(spec)
    return ResNet34(spec, norm)


class BlockModel(nn.Module):
    """An nn.Module that names its blocks: `block_modules` lists, in forward order, each block's submodules."""

    spec: ModelSpec
    block_modules: list[tuple[str, list[str]]]

    def block_names(self) -> list[str]:
        """Block names from the input end to the classifier."""
        return [name for name, _ in self.block_modules]

    def block_of(self, tensor_name: str) -> int:
        """Index of the block that owns a parameter or buffer name."""
        return blocks.block_of(self.block_modules, tensor_name)

    def state_tensors(self) -> tuple[list[tuple], list[tuple]]:
        """(params, buffers) as (name, shape, dtype, block); num_batches_tracked is not model state here."""
        return blocks.state_tensors(self, self.block_modules)


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm written with primitive ops: ONNX Runtime has no gradient for InstanceNormalization."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[0], x.shape[1]
        grouped = x.reshape(n, self.num_groups, -1)
        mean = grouped.mean(-1, keepdim=True)
        centred = grouped - mean
        var = (centred * centred).mean(-1, keepdim=True)
        y = (centred / torch.sqrt(var + self.eps)).reshape(x.shape)
        per_channel = (1, c, *([1] * (x.dim() - 2)))
        return y * self.weight.view(per_channel) + self.bias.view(per_channel)


def _norm_factory(norm: str):
    if norm == "batch":
        return lambda channels: nn.BatchNorm2d(channels)
    if norm == "none":
        return lambda channels: nn.Identity()
    # at most 8 groups, and a divisor of the channel count (MobileNet x0.25 has 8 channels in its stem)
    return lambda channels: GroupNorm(next(g for g in (8, 4, 2, 1) if channels % g == 0), channels)


class MobileNetV1(BlockModel):
    """MobileNet-v1 (Howard et al. 2017): stem, 13 depthwise-separable blocks, classifier."""

    CHANNELS = (64, 128, 128, 256, 256, 512, 512, 512, 512, 512, 512, 1024, 1024)
    STRIDES = (1, 2, 1, 2, 1, 2, 1, 1, 1, 1, 1, 2, 1)

    def __init__(self, spec: ModelSpec, norm):
        super().__init__()
        self.spec = spec

        def scaled(channels: int) -> int:
            return max(8, int(channels * spec.width))

        stem_channels = scaled(32)
        stem_stride = 2 if spec.input_size >= 64 else 1  # CIFAR geometry keeps the 32x32 resolution
        self.stem = nn.Sequential(
            nn.Conv2d(spec.in_channels, stem_channels, 3, stem_stride, 1, bias=False),
            norm(stem_channels),
            nn.ReLU(),
        )
        layers, cin = [], stem_channels
        for channels, stride in zip(self.CHANNELS, self.STRIDES):
            cout = scaled(channels)
            layers.append(
                nn.Sequential(
                    nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),
                    norm(cin),
                    nn.ReLU(),
                    nn.Conv2d(cin, cout, 1, 1, 0, bias=False),
                    norm(cout),
                    nn.ReLU(),
                )
            )
            cin = cout
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(cin, spec.num_classes)
        self.block_modules = (
            [("stem", ["stem"])]
            + [(f"dw{i + 1}", [f"features.{i}"]) for i in range(len(layers))]
            + [("classifier", ["classifier"])]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(self.stem(x))
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class CifarCNN(BlockModel):
    """The CIFAR CNN of PersFL/pFedMe: conv5x5-6, pool, conv5x5-16, pool, FC 400-120-84-C."""

    def __init__(self, spec: ModelSpec, norm):
        super().__init__()
        self.spec = spec
        self.conv1 = nn.Sequential(nn.Conv2d(spec.in_channels, 6, 5), norm(6), nn.ReLU(), nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(6, 16, 5), norm(16), nn.ReLU(), nn.MaxPool2d(2))
        side = ((spec.input_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.classifier = nn.Linear(84, spec.num_classes)
        self.block_modules = [
            ("conv1", ["conv1"]),
            ("conv2", ["conv2"]),
            ("fc1", ["fc1"]),
            ("fc2", ["fc2"]),
            ("classifier", ["classifier"]),
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.conv2(self.conv1(x)), 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.classifier(x)


class MnistMLP(BlockModel):
    """The MNIST network of PersFL/pFedMe: 784-100-C with ReLU."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.hidden = nn.Linear(spec.in_channels * spec.input_size * spec.input_size, 100)
        self.classifier = nn.Linear(100, spec.num_classes)
        self.block_modules = [("hidden", ["hidden"]), ("classifier", ["classifier"])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(F.relu(self.hidden(torch.flatten(x, 1))))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class ResNet34(BlockModel):
    """torchvision's ResNet-34 layout (3-4-6-3 basic blocks) with a 3x3 stride-1 stem for 32x32 inputs."""

    def __init__(self, spec: ModelSpec, norm):
        super().__init__()
        self.spec = spec
        self.stem = nn.Sequential(nn.Conv2d(spec.in_channels, 64, 3, 1, 1, bias=False), norm(64), nn.ReLU())
        blocks, cin, names = [], 64, []
        for stage, (count, channels) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
            for index in range(count):
                stride = 2 if index == 0 and stage > 0 else 1
                blocks.append(_BasicBlock(cin, channels, stride, norm))
                names.append(f"layer{stage + 1}.{index}")
                cin = channels
        self.layers = nn.Sequential(*blocks)
        self.classifier = nn.Linear(512, spec.num_classes)
        self.block_modules = (
            [("stem", ["stem"])]
            + [(name, [f"layers.{i}"]) for i, name in enumerate(names)]
            + [("classifier", ["classifier"])]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
