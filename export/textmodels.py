"""The zoo's sequence models: a next-word `transformer` and `lstm` over token ids, and `har-cnn` over sensor windows.

A next-word model (causal) gives the next token's logits at EVERY position, (batch, seq_len, vocabulary): every
engine's loss is the mean cross-entropy over the non-<pad> targets (edgepfl.text); a prediction reads the last real
position. Every engine differentiates these ops: the LSTM's cell is spelled out (MatMul, Sigmoid, Tanh, unrolled)
instead of nn.LSTM (the ONNX LSTM op has no portable gradient), and HAR's 1-D convolutions are (1, k) 2-D ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from edgepfl import text
from edgepfl.errors import UsageError
from edgepfl.export.models import WIDTHS, BlockModel, _norm_factory
from edgepfl.export.sequence_options import (
    HAPT_ACTIVITIES,
    HAPT_CHANNELS,
    HAPT_RATE_HZ,
    HAPT_WINDOW,
    SEQUENCE_MODELS,
    TEXT_MODELS,
    SequenceOptions,
)
from edgepfl.kinds import SampleKind
from edgepfl.kinds.nextword import NextWordKind
from edgepfl.kinds.sensor import SensorKind

if TYPE_CHECKING:
    from edgepfl.export.bundle import ExportTarget

MODEL_NAMES = SEQUENCE_MODELS
# FedAlt's StackOverflow transformer: 4 layers, 4 heads of 64 (d 256), feed-forward 1024; the LEAF LSTM: 2 of 256
TRANSFORMER = {"d": 256, "heads": 4, "ff": 1024, "layers": 4}
LSTM = {"embedding": 8, "hidden": 256, "layers": 2}
_MASKED = -1e9  # a causal mask's score: finite, so a fully padded row's softmax and gradient stay finite


@dataclass(frozen=True)
class TextSpec:
    """A next-word model: zoo name, width, layers, the vocabulary's size (specials included) and the window."""

    name: str = "transformer"
    width: float = 1.0
    layers: int = 4
    vocab_size: int = text.DEFAULT_VOCAB_SIZE + len(text.SPECIALS)
    seq_len: int = text.DEFAULT_SEQ_LEN

    input_dtype = "int64"

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample: `seq_len` token ids."""
        return (self.seq_len,)

    @property
    def num_classes(self) -> int:
        """One class per word of the vocabulary."""
        return self.vocab_size

    @property
    def target_shape(self) -> tuple[int, ...]:
        """One sample's targets: the next token at each position."""
        return (self.seq_len,)

    @property
    def normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Token ids are not normalised."""
        return (), ()

    def to_dict(self) -> dict:
        """JSON form for the manifest's `model`."""
        return asdict(self)


@dataclass(frozen=True)
class SensorSpec:
    """An activity-recognition model over (channels, window) sensor windows."""

    name: str = "har-cnn"
    width: float = 1.0
    channels: int = len(HAPT_CHANNELS)
    window: int = HAPT_WINDOW
    num_classes: int = HAPT_ACTIVITIES
    norm: str = "batch"

    input_dtype = "float32"

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample: channels × time."""
        return (self.channels, self.window)

    @property
    def normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per channel: identity (the recorded units), until an export names the data's statistics."""
        return (0.0,) * self.channels, (1.0,) * self.channels

    def to_dict(self) -> dict:
        """JSON form for the manifest's `model`."""
        return asdict(self)


SequenceSpec = TextSpec | SensorSpec


def default_sequence_spec(name: str) -> SequenceSpec:
    """Each sequence model's defaults (FedAlt's transformer, LEAF's LSTM, HAPT's CNN)."""
    if name == "transformer":
        return TextSpec(name, layers=TRANSFORMER["layers"])
    if name == "lstm":
        return TextSpec(name, layers=LSTM["layers"])
    if name == "har-cnn":
        return SensorSpec()
    raise UsageError(f"unknown sequence model {name!r}", f"choose one of: {', '.join(MODEL_NAMES)}")


def spec_from_description(description: dict[str, Any]) -> SequenceSpec:
    """The spec a manifest's `model` entry records."""
    kind = TextSpec if description.get("name") in TEXT_MODELS else SensorSpec
    return kind(**description)


def validate_sequence_spec(spec: SequenceSpec) -> None:
    """One line for a knob the model cannot take."""
    if spec.name not in MODEL_NAMES:
        raise UsageError(f"unknown model {spec.name!r}", f"choose one of: {', '.join(MODEL_NAMES)}")
    if spec.width not in WIDTHS:
        raise UsageError(f"width {spec.width} is not allowed", f"choose one of: {', '.join(map(str, WIDTHS))}")
    if isinstance(spec, TextSpec):
        if not 1 <= spec.layers <= 24:
            raise UsageError(
                f"--layers {spec.layers} is outside 1..24", f"use {default_sequence_spec(spec.name).layers}"
            )
        if spec.seq_len < 1:
            raise UsageError(f"--seq-len {spec.seq_len} reads no word", f"use {text.DEFAULT_SEQ_LEN}")
        if spec.vocab_size <= len(text.SPECIALS):
            raise UsageError("the vocabulary holds no word besides the specials", "name a larger corpus with --vocab")
        return
    if spec.norm not in ("batch", "group", "none"):
        raise UsageError(f"unknown norm {spec.norm!r}", "choose one of: batch, group, none")
    if spec.channels < 1 or spec.window < 8 or spec.window % 8:
        raise UsageError(
            f"har-cnn cannot read a {spec.channels}-channel window of {spec.window} steps (its three pools halve it)",
            f"use at least 1 channel and a multiple of 8 steps (HAPT: {len(HAPT_CHANNELS)} × {HAPT_WINDOW})",
        )
    if spec.num_classes < 2:
        raise UsageError(f"num-classes {spec.num_classes} is too small", "use at least 2 classes")


def build_sequence_model(spec: SequenceSpec) -> BlockModel:
    """Instantiate a sequence model (deterministic under torch.manual_seed)."""
    validate_sequence_spec(spec)
    if isinstance(spec, SensorSpec):
        return HarCNN(spec)
    return CausalTransformer(spec) if spec.name == "transformer" else WordLSTM(spec)


def _scaled(size: int, width: float, least: int = 8) -> int:
    return max(least, int(size * width))


class _Embedding(nn.Module):
    """Token embeddings plus learned positions (the transformer's input layer)."""

    def __init__(self, vocab_size: int, seq_len: int, d: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d)
        self.positions = nn.Parameter(torch.randn(seq_len, d) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions


class _Attention(nn.Module):
    """Causal multi-head self-attention written with MatMul/Softmax/Where, which every engine differentiates."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n, t, d = h.shape
        q, k, v = (
            part.reshape(n, t, self.heads, d // self.heads).transpose(1, 2) for part in self.qkv(h).chunk(3, dim=-1)
        )
        scores = (q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        position = torch.arange(t)
        future = position.unsqueeze(0) > position.unsqueeze(1)  # (query, key): a key after the query
        scores = torch.where(future, torch.full_like(scores, _MASKED), scores)
        mixed = torch.softmax(scores, dim=-1) @ v
        return self.out(mixed.transpose(1, 2).reshape(n, t, d))


class _TransformerLayer(nn.Module):
    """A pre-LN block: h + attention(norm(h)), then + feed-forward(norm(h))."""

    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attention = _Attention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.norm1(h))
        return h + self.ff(self.norm2(h))


class CausalTransformer(BlockModel):
    """FedAlt's StackOverflow next-word transformer: embeddings, pre-LN causal layers, a final norm, the output
    layer; the logits at every position. Blocks: embedding, layer1..L, output."""

    def __init__(self, spec: TextSpec):
        super().__init__()
        self.spec = spec  # type: ignore[assignment]
        heads = max(1, int(TRANSFORMER["heads"] * spec.width))
        d = heads * (TRANSFORMER["d"] // TRANSFORMER["heads"])  # heads of 64: width scales their number
        ff = _scaled(TRANSFORMER["ff"], spec.width)
        self.embedding = _Embedding(spec.vocab_size, spec.seq_len, d)
        self.layers = nn.ModuleList(_TransformerLayer(d, heads, ff) for _ in range(spec.layers))
        self.norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, spec.vocab_size)
        self.block_modules = (
            [("embedding", ["embedding"])]
            + [(f"layer{i + 1}", [f"layers.{i}"]) for i in range(spec.layers)]
            + [("output", ["norm", "output"])]
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def adapter_axis(self, block_index: int) -> int:
        """The feature axis of a block's output, (N, T, D): where a bottleneck adapter reads and adds."""
        return -1


class _LSTMLayer(nn.Module):
    """One LSTM layer with its cell spelled out (gates i, f, g, o as nn.LSTM orders them), unrolled over time."""

    def __init__(self, inputs: int, hidden: int):
        super().__init__()
        self.hidden_size = hidden
        self.input = nn.Linear(inputs, 4 * hidden)
        self.recurrent = nn.Linear(hidden, 4 * hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from_inputs = self.input(x)  # every step's input projection in one product
        outputs = []
        h = c = None
        for step in range(x.shape[1]):
            gates = from_inputs[:, step] if h is None else from_inputs[:, step] + self.recurrent(h)
            i, f, g, o = gates.chunk(4, dim=-1)
            # the first step starts from h = c = 0: no recurrent term and no forget term (no zeros to make)
            c = (
                torch.sigmoid(i) * torch.tanh(g)
                if c is None
                else torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            )
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        return torch.stack(outputs, dim=1)


class WordLSTM(BlockModel):
    """The LEAF/FedAvg Shakespeare LSTM over words: embedding 8, two LSTM layers of 256, the output layer.
    Blocks: embedding, lstm1..L, output."""

    def __init__(self, spec: TextSpec):
        super().__init__()
        self.spec = spec  # type: ignore[assignment]
        hidden = _scaled(LSTM["hidden"], spec.width)
        self.embedding = nn.Embedding(spec.vocab_size, LSTM["embedding"])
        sizes = [LSTM["embedding"]] + [hidden] * spec.layers
        self.lstm = nn.ModuleList(_LSTMLayer(a, b) for a, b in zip(sizes, sizes[1:]))
        self.output = nn.Linear(hidden, spec.vocab_size)
        self.block_modules = (
            [("embedding", ["embedding"])]
            + [(f"lstm{i + 1}", [f"lstm.{i}"]) for i in range(spec.layers)]
            + [("output", ["output"])]
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)
        for layer in self.lstm:
            h = layer(h)
        return self.output(h)

    def adapter_axis(self, block_index: int) -> int:
        """The feature axis of a block's output, (N, T, H)."""
        return -1


class HarCNN(BlockModel):
    """1-D convolutions over a sensor window: three (conv k=5, norm, ReLU, max-pool 2) blocks, average over time,
    a linear classifier. Blocks: conv1, conv2, conv3, classifier."""

    CHANNELS = (32, 64, 128)
    KERNEL = 5

    def __init__(self, spec: SensorSpec):
        super().__init__()
        self.spec = spec  # type: ignore[assignment]
        norm = _norm_factory(spec.norm)
        convs, cin = [], spec.channels
        for channels in self.CHANNELS:
            cout = _scaled(channels, spec.width)
            convs.append(
                nn.Sequential(
                    nn.Conv2d(cin, cout, (1, self.KERNEL), padding=(0, self.KERNEL // 2)),
                    norm(cout),
                    nn.ReLU(),
                    nn.MaxPool2d((1, 2)),
                )
            )
            cin = cout
        self.convs = nn.Sequential(*convs)
        self.classifier = nn.Linear(cin, spec.num_classes)
        self.block_modules = [(f"conv{i + 1}", [f"convs.{i}"]) for i in range(len(convs))] + [
            ("classifier", ["classifier"])
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.convs(x.unsqueeze(2))  # (N, C, T) as an (N, C, 1, T) map
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(features, 1), 1))

    def adapter_axis(self, block_index: int) -> int:
        """The channel axis of a block's output, (N, C, 1, T)."""
        return 1


def sequence_target(
    name: str,
    sequence: SequenceOptions,
    seed: int,
    width: float | None = None,
    norm: str | None = None,
    num_classes: int | None = None,
) -> ExportTarget:
    """`edgepfl export`'s text or sensor zoo model: a text model's vocabulary counted from `--vocab`, a sensor
    model's channels from `--channels`; a knob of the other kind is refused in one line."""
    if name in TEXT_MODELS:
        given = (
            sequence.given(("sensor models",))
            + ["--norm"] * (norm is not None)
            + ["--num-classes"] * (num_classes is not None)
        )
        if given:
            raise UsageError(
                f"{given[0]} does not apply to the text model {name}", "drop it (the vocabulary sets the classes)"
            )
        if sequence.vocab is None:
            raise UsageError(
                f"the text model {name} needs its vocabulary's corpus",
                f"pass --vocab FILE (edgepfl export {name} --vocab corpus.txt)",
            )
        vocabulary = text.Vocabulary.from_texts(
            text.read_text(sequence.vocab).splitlines(), sequence.vocab_size or text.DEFAULT_VOCAB_SIZE
        )
        return text_target(name, vocabulary, seed, width, sequence.layers, sequence.seq_len)
    if sequence.given(("text models",)):
        raise UsageError(f"{sequence.given(('text models',))[0]} does not apply to the sensor model {name}", "drop it")
    channels = sequence.channels or HAPT_CHANNELS
    return sensor_target(
        name, channels, seed, width, sequence.window, sequence.rate_hz, num_classes, norm, sequence.units
    )


def text_target(
    name: str,
    vocabulary: text.Vocabulary,
    seed: int,
    width: float | None = None,
    layers: int | None = None,
    seq_len: int | None = None,
) -> ExportTarget:
    """A next-word model with one class per word of `vocabulary`, which is written into the bundle (vocab.json, its
    sha256 in the manifest's sample entry): what `edgepfl export` and a simulation over a text dataset build."""
    base = default_sequence_spec(name)
    spec = TextSpec(
        name,
        width=base.width if width is None else width,
        layers=layers or base.layers,
        vocab_size=len(vocabulary),
        seq_len=seq_len or base.seq_len,
    )
    kind = NextWordKind.from_vocabulary(vocabulary, spec.seq_len)
    return _target(spec, seed, kind, {text.VOCAB_NAME: vocabulary.to_json()})


def sensor_target(
    name: str,
    channels: Sequence[str],
    seed: int,
    width: float | None = None,
    window: int | None = None,
    rate_hz: float | None = None,
    num_classes: int | None = None,
    norm: str | None = None,
    units: Sequence[str] | None = None,
) -> ExportTarget:
    """An activity model over windows of the named `channels` (in `units`: HAPT's by default), which the manifest's
    sample entry lists."""
    if len(set(channels)) != len(channels):
        raise UsageError(f"--channels names a channel twice ({', '.join(channels)})", "name each channel once")
    base = default_sequence_spec(name)
    assert isinstance(base, SensorSpec)
    spec = SensorSpec(
        name,
        width=base.width if width is None else width,
        channels=len(channels),
        window=window or base.window,
        num_classes=base.num_classes if num_classes is None else num_classes,
        norm=norm or base.norm,
    )
    if units is not None and len(units) != len(channels):
        raise UsageError(f"--units names {len(units)} units for {len(channels)} channels", "name one unit a channel")
    kind = SensorKind.of(tuple(channels), spec.window, rate_hz or HAPT_RATE_HZ, units=units)
    return _target(spec, seed, kind)


def _target(spec: SequenceSpec, seed: int, kind: SampleKind, files: dict[str, bytes] | None = None) -> ExportTarget:
    """The spec's model built under `seed`, with the kind of its samples and the files it carries."""
    from edgepfl.export.bundle import ExportTarget

    validate_sequence_spec(spec)
    torch.manual_seed(seed)
    model = build_sequence_model(spec).eval()
    return ExportTarget(
        model,
        spec.input_shape,
        spec.num_classes,
        model.block_modules,
        spec.normalization,
        spec.to_dict(),
        input_dtype=spec.input_dtype,
        kind=kind,
        files=files or {},
    )
