"""The zoo's sequence models (transformer, lstm, har-cnn): export, every engine, predict --text, export-model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from edgepfl import text
from edgepfl.device_runtime.cli import device_app
from edgepfl.device_runtime.engine import open_engine
from edgepfl.errors import BundleError, DataError, UsageError
from edgepfl.manifest import load_manifest
from edgepfl.ortbuild import training_build_installed

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

CORPUS = "\n".join(
    [
        "to be or not to be that is the question",
        "whether tis nobler in the mind to suffer",
        "the slings and arrows of outrageous fortune",
        "or to take arms against a sea of troubles",
        "and by opposing end them to die to sleep",
    ]
)
ENGINES = ("portable", "ort-training") if training_build_installed() else ("portable",)
SEQ_LEN = 4


def export_sequence(out: Path, name: str, kp: int = 1, **knobs) -> Path:
    """A tiny sequence-model bundle exported as `edgepfl export NAME` does."""
    from edgepfl.export.bundle import ExportOptions, export_target
    from edgepfl.export.sequence_options import SequenceOptions
    from edgepfl.export.textmodels import sequence_target

    torch.set_num_threads(2)
    options = SequenceOptions(**knobs)
    target = sequence_target(name, options, seed=0, width=0.25)
    export_options = ExportOptions(engines=ENGINES, force=True, portable_batch=8)
    export_target(target, kp, out, export_options, notice=lambda _: None)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(CORPUS, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def transformer_bundle(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("transformer") / "bundle"
    return export_sequence(out, "transformer", vocab=corpus, seq_len=SEQ_LEN, layers=1)


@pytest.fixture(scope="module")
def lstm_bundle(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("lstm") / "bundle"
    return export_sequence(out, "lstm", vocab=corpus, vocab_size=12, seq_len=3, layers=1)


@pytest.fixture(scope="module")
def har_bundle(tmp_path_factory) -> Path:
    return export_sequence(tmp_path_factory.mktemp("har") / "bundle", "har-cnn", window=16)


@pytest.fixture
def bundles(request) -> Path:
    return request.getfixturevalue(request.param)


def batch(manifest, count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Seeded model input of the bundle's kind (token ids or sensor values) and labels (a next-word sample's: a
    target at every position, some of them <pad>, which the loss leaves out)."""
    rng = np.random.default_rng(seed)
    shape = (count, *manifest.input.shape)
    if manifest.input.dtype == "int64":
        x = rng.integers(0, manifest.num_classes, shape)
    else:
        x = rng.normal(size=shape).astype(np.float32)
    y = rng.integers(0, manifest.num_classes, (count, *manifest.kind.target_shape))
    if y.ndim > 1:
        y[::2, -1] = text.PAD_ID  # a line ended before the sequence did
        y[:, 0] = np.maximum(y[:, 0], text.OOV_ID)  # every sequence trains at least one target
    return x, y


def test_the_transformer_defaults_are_fedalts_stackoverflow_model_and_width_scales_it():
    from edgepfl.export.textmodels import build_sequence_model, default_sequence_spec

    spec = default_sequence_spec("transformer")
    model = build_sequence_model(spec)
    assert (spec.layers, spec.seq_len, spec.vocab_size) == (4, 20, 10_004)
    assert model.embedding.tokens.weight.shape == (10_004, 256)
    assert model.layers[0].attention.heads == 4 and model.layers[0].ff[0].out_features == 1024
    assert model.block_names() == ["embedding", "layer1", "layer2", "layer3", "layer4", "output"]
    assert model.adapter_axis(1) == -1
    small = build_sequence_model(type(spec)(width=0.25))
    assert small.embedding.tokens.weight.shape == (10_004, 64) and small.layers[0].ff[0].out_features == 256
    logits = small(torch.randint(0, 10_004, (2, 20)))
    assert logits.shape == (2, 20, 10_004)  # the next word at every position


def test_the_lstm_cell_computes_what_nn_lstm_computes():
    from edgepfl.export.textmodels import _LSTMLayer

    torch.manual_seed(0)
    cell = _LSTMLayer(5, 7)
    reference = torch.nn.LSTM(5, 7, batch_first=True)
    with torch.no_grad():
        reference.weight_ih_l0.copy_(cell.input.weight)
        reference.bias_ih_l0.copy_(cell.input.bias)
        reference.weight_hh_l0.copy_(cell.recurrent.weight)
        reference.bias_hh_l0.zero_()
    x = torch.randn(3, 6, 5)
    torch.testing.assert_close(cell(x), reference(x)[0])


@pytest.mark.slow
def test_a_text_bundle_says_its_token_input_vocabulary_and_blocks(transformer_bundle):
    manifest = load_manifest(transformer_bundle, verify_files=True)
    assert (manifest.kind.name, manifest.input.dtype, manifest.input.shape) == ("next-word", "int64", (SEQ_LEN,))
    assert manifest.blocks == ("embedding", "layer1", "output")
    assert {t.block for t in manifest.by_role("personal")} == {2}  # --kp 1: the output layer is personal
    kind = manifest.kind
    vocabulary = kind.vocabulary(transformer_bundle)
    assert kind.seq_len == SEQ_LEN and kind.bundle_files == ("vocab.json",)
    assert len(vocabulary) == manifest.num_classes == kind.vocab_size
    assert vocabulary.words[:4] == text.SPECIALS and "to" in vocabulary.words
    assert manifest.files["vocab.json"] == kind.vocab_sha256
    # the page learns why the step runs on WebAssembly: WebGPU takes no int64
    assert "int64" in manifest.engines["portable"]["steps"]["full"]["webgpu_problems"][0]


@pytest.mark.slow
def test_the_embeddings_gradient_is_standard_onnx_that_plain_onnxruntime_runs(transformer_bundle):
    from edgepfl.export.portable import default_domain_violations

    manifest = load_manifest(transformer_bundle)
    proto = onnx.load(str(transformer_bundle / manifest.engines["portable"]["steps"]["full"]["model"]))
    onnx.checker.check_model(proto, full_check=True)
    assert default_domain_violations(proto) == []
    scatters = [n for n in proto.graph.node if n.op_type == "ScatterND"]
    assert scatters and all(
        onnx.helper.get_attribute_value(a) == b"add" for n in scatters for a in n.attribute if a.name == "reduction"
    )
    engine = open_engine(transformer_bundle, "portable")
    x, y = batch(manifest, 5)
    y = np.maximum(y, text.OOV_ID)  # every position trains, so every id read gets a gradient
    before = engine.get_tensors(["embedding.tokens.weight"])["embedding.tokens.weight"]
    engine.train_step(x, y, 0.5)
    after = engine.get_tensors(["embedding.tokens.weight"])["embedding.tokens.weight"]
    moved = np.flatnonzero(np.abs(after - before).sum(1))
    assert set(moved) == set(np.unique(x))  # exactly the rows of the ids the batch read


@pytest.mark.slow
@pytest.mark.parametrize("bundles", ["transformer_bundle", "lstm_bundle", "har_bundle"], indirect=True)
def test_every_engine_trains_the_sequence_models_alike(bundles):
    from edgepfl.simulate.torch_engine import TorchEngine

    manifest = load_manifest(bundles)
    x, y = batch(manifest, 6)
    initial = open_engine(bundles, "portable").get_tensors()
    engines = [open_engine(bundles, name, threads=2) for name in ENGINES]
    engines.append(TorchEngine(bundles, manifest, initial, threads=2))
    results = []
    for engine in engines:
        losses = [engine.train_step(x, y, 0.1, "full")]
        # three personal steps on the same base: the portable engine's third runs the step's frozen variant
        losses += [engine.train_step(x[:3], y[:3], 0.1, "personal") for _ in range(3)]
        results.append((losses, engine.get_tensors(), engine.logits(x)))
    reference = results[0]
    for engine, (losses, tensors, logits) in zip(engines[1:], results[1:]):
        np.testing.assert_allclose(losses, reference[0], rtol=1e-5, err_msg=engine.name)
        for name, value in tensors.items():
            np.testing.assert_allclose(value, reference[1][name], rtol=1e-4, atol=1e-6, err_msg=f"{engine.name} {name}")
        np.testing.assert_allclose(logits, reference[2], rtol=1e-4, atol=1e-5, err_msg=engine.name)
    assert "step_personal" in engines[0]._baked or not engines[0].bake_frozen, "the portable engine baked a variant"
    base = manifest.names("base")
    assert any(not np.array_equal(reference[1][n], initial[n]) for n in base), "the full step trains the base"


@pytest.mark.parametrize("bundles", ["transformer_bundle", "lstm_bundle"], indirect=True)
def test_the_one_phrase_predict_graph_applies_the_output_layer_at_the_last_word_only(bundles):
    """A keyboard asks what follows the words typed: the predict graph gives (1, words) logits, the output layer
    applied at the last real position only, and predicts what the eval graph's every-position logits say there."""
    engine = open_engine(bundles, "portable")
    predict, evaluate = (onnx.load(str(bundles / engine.entry[key]["model"])) for key in ("predict", "eval"))
    words = engine.manifest.num_classes
    assert engine.entry["predict"]["outputs"] == ["logits"]
    dims = [d.dim_value for d in predict.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, words]
    x, _ = batch(engine.manifest, 5, seed=3)
    x[1, 1:] = text.PAD_ID  # one word typed
    x[2, :] = text.PAD_ID  # nothing typed yet
    one_by_one = np.concatenate([engine.logits(x[i : i + 1]) for i in range(len(x))])  # the predict graph
    np.testing.assert_allclose(one_by_one, engine.logits(x), rtol=1e-4, atol=1e-5)  # the eval graph, 5 > up_to

    def output_layer_rows(proto: onnx.ModelProto) -> list[int]:  # the rows each product giving a value per word takes
        inferred = onnx.shape_inference.infer_shapes(proto).graph
        shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*inferred.value_info]}
        products = [node.output[0] for node in inferred.node if node.op_type in ("MatMul", "Gemm")]
        return [int(np.prod(shapes[name][:-1])) for name in products if shapes.get(name, [0])[-1] == words]

    steps, size = engine.manifest.input.shape[0], engine.entry["batch_size"]
    assert (output_layer_rows(predict), output_layer_rows(evaluate)) == ([1], [size * steps])


def test_an_output_layer_that_mixes_positions_keeps_the_eval_graphs_form():
    """The last-position graph is kept only when it gives the eval graph's logits there: an output layer whose
    logits at a position sum those of every position up to it cannot be applied at one position."""
    from torch import nn

    from edgepfl.export.masked import MaskedModel, StepShape
    from edgepfl.export.portable import export_predict

    class Summing(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(6, 9)

        def forward(self, h):
            return self.linear(h).cumsum(1)

    class Tiny(nn.Module):
        def __init__(self, output: nn.Module):
            super().__init__()
            self.embedding, self.output = nn.Embedding(9, 6), output

        def forward(self, ids):
            return self.output(self.embedding(ids))

    torch.manual_seed(0)
    shape = StepShape((4,), 9, "int64", (4,))
    forms = []
    for output in (nn.Linear(6, 9), Summing()):
        model = Tiny(output)
        params = [name for name, _ in model.named_parameters()]
        proto = export_predict(MaskedModel(model, shape), params, [])
        forms.append([d.dim_value for d in proto.graph.output[0].type.tensor_type.shape.dim])
    assert forms == [[1, 9], [1, 4, 9]]


@pytest.mark.slow
@pytest.mark.parametrize("bundles", ["transformer_bundle", "lstm_bundle"], indirect=True)
def test_a_next_word_step_is_the_mean_cross_entropy_over_every_non_pad_position(bundles):
    """Every engine's loss and gradients are torch's causal language-model loss with <pad> targets ignored (FedAlt's
    sequence training): pinned on a tiny transformer and lstm against F.cross_entropy(ignore_index=<pad>)."""
    from edgepfl.export.personal import rebuild_personal
    from edgepfl.export.source import rebuild_module

    manifest = load_manifest(bundles)
    x, y = batch(manifest, 5, seed=3)
    assert (y == text.PAD_ID).any() and (y != text.PAD_ID).any()
    initial = open_engine(bundles, "portable").get_tensors()
    model = rebuild_personal(rebuild_module(manifest.model), manifest.tensors)
    model.load_state_dict({name: torch.from_numpy(value) for name, value in initial.items()}, strict=False)
    logits = model(torch.from_numpy(x))
    assert logits.shape == (5, manifest.kind.seq_len, manifest.num_classes)  # a prediction at every position
    want = torch.nn.functional.cross_entropy(
        logits.reshape(-1, manifest.num_classes), torch.from_numpy(y).reshape(-1), ignore_index=text.PAD_ID
    )
    want.backward()
    lr = 0.1
    expected = {n: (p - lr * p.grad).detach().numpy() for n, p in model.named_parameters() if p.grad is not None}
    for name in ENGINES:
        engine = open_engine(bundles, name, threads=2)
        assert engine.train_step(x, y, lr, "full") == pytest.approx(float(want), rel=1e-5), name
        got = engine.get_tensors(list(expected))
        for tensor, value in expected.items():
            np.testing.assert_allclose(got[tensor], value, rtol=1e-4, atol=1e-6, err_msg=f"{name} {tensor}")
    # held-out accuracy counts the positions whose target is neither <pad> nor <oov>
    result = open_engine(bundles, "portable").eval_batch(x, y)
    counted = (y != text.PAD_ID) & (y != text.OOV_ID)
    hits = (logits.argmax(-1).numpy() == y) & counted
    assert (result.count, result.correct) == (int(counted.sum()), int(hits.sum()))


def test_a_text_bundle_exported_with_one_label_a_sample_is_refused_in_one_line(transformer_bundle):
    from edgepfl.kinds import parse_kind
    from edgepfl.kinds.nextword import NextWordKind

    manifest = load_manifest(transformer_bundle)
    entry = manifest.kind.entry()
    assert entry["targets"] == "every-position" and entry["target_shape"] == [SEQ_LEN]
    old = {key: value for key, value in entry.items() if key not in ("targets", "target_shape", "loss_ignores")}
    with pytest.raises(BundleError, match="one label") as refused:
        parse_kind(old, manifest.input, manifest.num_classes)
    assert "re-export" in refused.value.fix
    assert isinstance(parse_kind(entry, manifest.input, manifest.num_classes), NextWordKind)


def test_persfl_is_refused_on_a_next_word_model_in_one_line(transformer_bundle):
    from edgepfl.device_runtime.persfl import check_distillable

    with pytest.raises(UsageError, match="PersFL distils one label a sample"):
        check_distillable(load_manifest(transformer_bundle).kind)
    assert not load_manifest(transformer_bundle).engines["portable"]["distill"]  # no graphs it could not use


def test_predict_text_gives_the_top_next_words_and_never_a_special_token(transformer_bundle, tmp_path):
    from edgepfl.device_runtime.predict import next_words
    from edgepfl.text import phrase_context

    engine = open_engine(transformer_bundle, "portable")
    vocabulary = engine.manifest.kind.vocabulary(transformer_bundle)
    context = phrase_context("To be, or NOT", vocabulary, SEQ_LEN)
    assert context.tolist() == vocabulary.encode(["be", ",", "or", "not"]).tolist()
    short = phrase_context("to", vocabulary, SEQ_LEN)
    assert short.tolist() == [text.BOS_ID, vocabulary.encode(["to"])[0], text.PAD_ID, text.PAD_ID]  # right-padded
    words = next_words(engine, "to be or not", len(vocabulary))  # <pad>, <oov>, <bos>, <eos>: nobody types them
    assert len(words) == len(vocabulary) - 4 and not {i for i, _, _ in words} & {0, 1, 2, 3}
    probabilities = engine.predict(phrase_context("to be or not", vocabulary, SEQ_LEN)[None])[0]
    assert [p for _, _, p in words] == sorted((float(p) for p in probabilities[4:]), reverse=True)
    # the person's own words the device keeps (device train/run learns them from its text) come in <oov>'s place
    notes = tmp_path / "notes.txt"
    notes.write_text("zorblax to be or not to be\nthat is the zorblax question\n", encoding="utf-8")
    train = ["train", "--bundle", str(transformer_bundle), "--data", str(notes), "--state", str(tmp_path / "s")]
    trained = CliRunner().invoke(device_app, [*train, "--engine", "portable", "--batch-size", "8", "--json"])
    assert trained.exit_code == 0, trained.output
    assert json.loads(trained.output)["lr"] == text.TRAINING_DEFAULTS["lr"]  # a next-word model's own default
    assert (tmp_path / "s" / "user-dictionary.json").is_file()  # kept beside the model, never uploaded
    learned = next_words(engine, "to be or not", len(vocabulary), tmp_path / "s")
    assert (1, "zorblax", float(probabilities[1])) in learned and len(learned) == len(vocabulary) - 4 + 1
    result = CliRunner().invoke(
        device_app,
        ["predict", "--bundle", str(transformer_bundle), "--state", str(tmp_path / "s"), "--text", "to be", "--json"],
    )
    assert result.exit_code == 0, result.output
    top = json.loads(result.output)["predictions"][0]["top"]
    # the device's trained model (its state folder's tensors) answers, with the person's words in <oov>'s place
    from edgepfl.device_runtime.predict import open_device_model

    device = open_device_model(transformer_bundle, tmp_path / "s", "portable").engine
    assert len(top) == 3 and top[0]["name"] == next_words(device, "to be", 1, tmp_path / "s")[0][1]


@pytest.mark.slow
def test_predict_reads_sensor_and_token_windows_and_refuses_bad_ones(har_bundle, transformer_bundle, tmp_path):
    from device_helpers import read_inputs

    engine = open_engine(har_bundle, "portable")
    x, _ = batch(engine.manifest, 3)
    np.savez(tmp_path / "windows.npz", x=x)
    names, model_input = read_inputs([tmp_path / "windows.npz"], engine)
    assert names == [f"{tmp_path / 'windows.npz'}[{i}]" for i in range(3)]
    np.testing.assert_array_equal(model_input, x)  # the export's identity normalisation
    for bad, message in ((x[:, :5], "channel"), (np.where(x > 1, np.nan, x), "NaN")):
        np.savez(tmp_path / "bad.npz", x=bad)
        with pytest.raises(DataError, match=message):
            read_inputs([tmp_path / "bad.npz"], engine)
    text_engine = open_engine(transformer_bundle, "portable")
    np.savez(tmp_path / "ids.npz", x=np.full((2, SEQ_LEN), text_engine.manifest.num_classes))
    with pytest.raises(DataError, match="token ids"):
        read_inputs([tmp_path / "ids.npz"], text_engine)
    result = CliRunner().invoke(
        device_app, ["predict", "--bundle", str(har_bundle), "--state", str(tmp_path / "s"), "--text", "hi"]
    )
    assert result.exit_code != 0 and "next-word bundle" in result.output


class _Windows:
    """A device's data as model input (what export-model reads of LocalData), for int8's calibration."""

    def __init__(self, x: np.ndarray, y: np.ndarray, kind):
        self.x, self.y, self.kind = x, y, kind
        self.num_train, self.num_val = len(x), len(x)

    def train_batches_in_order(self, size: int):
        yield self.x, self.y

    def val_batches(self, size: int):
        yield self.x, self.y


@pytest.mark.parametrize("bundles", ["transformer_bundle", "har_bundle"], indirect=True)
def test_export_model_fp32_equals_the_engine_and_int8_loads(bundles, tmp_path):
    import onnxruntime

    from edgepfl.device_runtime.model_export import export_device_model
    from edgepfl.device_runtime.predict import open_device_model

    model = open_device_model(bundles, tmp_path / "state", "portable")
    manifest = model.engine.manifest
    x, y = batch(manifest, 16, seed=1)
    fp32 = export_device_model(model, tmp_path / "fp32.onnx")
    assert fp32.max_difference <= 1e-4
    session = onnxruntime.InferenceSession(str(tmp_path / "fp32.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].type == ("tensor(int64)" if manifest.input.dtype == "int64" else "tensor(float)")
    np.testing.assert_allclose(session.run(["probabilities"], {"input": x})[0], model.engine.predict(x), atol=1e-5)
    metadata = onnx.load(str(tmp_path / "fp32.onnx")).metadata_props
    props = {entry.key: entry.value for entry in metadata}
    assert (props["input_layout"], props["input_dtype"], props["resize"]) == (
        manifest.kind.model_file["input_layout"],
        manifest.input.dtype,
        "none",
    )
    int8 = export_device_model(model, tmp_path / "int8.onnx", "int8", _Windows(x, y, manifest.kind), 16)  # type: ignore[arg-type]
    assert int8.calibration_samples == 16 and int8.val_accuracy is not None
    quantized = onnxruntime.InferenceSession(str(tmp_path / "int8.onnx"), providers=["CPUExecutionProvider"])
    probabilities = quantized.run(["probabilities"], {"input": x})[0]
    np.testing.assert_allclose(probabilities.sum(1), 1, atol=1e-4)


def test_a_vocabulary_that_does_not_match_the_manifest_is_refused(transformer_bundle, tmp_path):
    from edgepfl.device_runtime.predict import next_words

    copy = tmp_path / "bundle"
    shutil.copytree(transformer_bundle, copy)
    vocabulary = load_manifest(copy).kind.vocabulary(copy)
    swapped = text.Vocabulary(vocabulary.words[:4] + tuple(reversed(vocabulary.words[4:])))
    text.write_vocabulary(copy, swapped)
    with pytest.raises(BundleError, match="vocab.json"):
        open_engine(copy, "portable")  # the bundle's file list names its sha256
    manifest = load_manifest(copy)  # read without checking files: the device's own check of the vocabulary
    engine = type(open_engine(transformer_bundle, "portable"))(copy, manifest)
    with pytest.raises(BundleError, match="not the vocabulary this bundle was exported with"):
        next_words(engine, "to be", 3)


def test_export_refuses_a_text_model_without_its_corpus_and_knobs_of_the_other_kind(tmp_path, corpus):
    from edgepfl.cli import app
    from edgepfl.export.sequence_options import SequenceOptions
    from edgepfl.export.textmodels import sequence_target

    runner = CliRunner()
    for args, message in (
        (["export", "transformer"], "needs its vocabulary's corpus"),
        (["export", "lstm", "--vocab", str(corpus), "--channels", "a,b"], "--channels does not apply"),
        (["export", "har-cnn", "--vocab", str(corpus)], "--vocab does not apply"),
        (["export", "cnn", "--seq-len", "5"], "--seq-len applies to text and sensor models only"),
        (["export", "har-cnn", "--window", "20"], "multiple of 8"),
    ):
        result = runner.invoke(app, [*args, "--out", str(tmp_path / "b")])
        assert result.exit_code != 0 and message in result.output, (args, result.output)
        assert "Traceback" not in result.output
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        sequence_target("transformer", SequenceOptions(vocab=tmp_path / "latin1.txt"), 0)
    with pytest.raises(UsageError, match="names a channel twice"):
        sequence_target("har-cnn", SequenceOptions(channels=("a", "a")), 0)


@pytest.mark.slow
def test_a_sensor_models_activities_are_named_by_its_export_never_by_its_class_count(tmp_path):
    """Only the HAPT model itself (no channel, window or class option) takes UCI HAPT's activity names; any other
    sensor model names its own, or is refused in one line (a person recording picks an activity by its name)."""
    from edgepfl.cli import app

    out = tmp_path / "har"
    args = ["export", "har-cnn", "--window", "16", "--width", "0.25", "--engines", "portable", "--portable-batch", "8"]
    refused = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert refused.exit_code != 0 and "needs its activities' names" in refused.output and not out.exists()
    names = ["still", "walk", "run", "climb", "sit", "lie"]
    result = CliRunner().invoke(app, [*args, "--class-names", ",".join(names), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert load_manifest(out).class_names == tuple(names)


def test_bench_sequence_accuracys_two_forms_score_the_same_targets():
    """bench/sequence_accuracy.py compares one target a sample with every position on the same text: both forms must
    hold the same targets (a line longer than a row included), so that an epoch is the same pass over the text."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from sequence_accuracy import one_target_samples

    lines = ["to be or not to be", "", " ".join(f"w{i % 7}" for i in range(30)), "that is the question"]
    vocabulary = text.Vocabulary.from_counts({w: 2 for line in lines for w in text.tokenize(line)}, 50)
    seq_len = 8
    before_x, before_y = one_target_samples(lines, vocabulary, seq_len)
    after_x, after_y = text.next_word_samples(lines, vocabulary, seq_len)
    assert before_x.shape == (len(before_y), seq_len)
    assert sorted(before_y.tolist()) == sorted(after_y[after_y != text.PAD_ID].tolist())
    # a window reads the seq_len tokens before its target, left-padded within its own line
    first = text.line_ids(lines[0], vocabulary)
    assert before_x[0].tolist() == [text.PAD_ID] * (seq_len - 1) + [text.BOS_ID] and before_y[0] == first[1]
    assert before_x[len(first) - 2][-1] == first[-2] and before_y[len(first) - 2] == text.EOS_ID
