"""`--personal SPEC`: its grammar, the adapters and LoRA export inserts, the roles it gives, and every engine
training a personal part that is not the last blocks (the base bit-identical in the personal-only step)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import write_stand_in_digits

from edgepfl.errors import BundleError, UsageError
from edgepfl.manifest import Manifest, load_manifest
from edgepfl.personal import PersonalSpec, as_spec, parse_spec, personal_choice

torch = pytest.importorskip("torch")

from edgepfl.device_runtime.engine import open_engine, training_build_installed  # noqa: E402
from edgepfl.export.bundle import export_bundle, zoo_target  # noqa: E402
from edgepfl.export.models import ModelSpec  # noqa: E402
from edgepfl.export.options import ExportCommand, ExportOptions  # noqa: E402
from edgepfl.export.personal import check_personal_set, personalized, tensor_roles  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MLP = ModelSpec(name="mlp", input_size=6, in_channels=1, num_classes=3, norm="none")
BN_CNN = ModelSpec(name="cnn", input_size=28, in_channels=1, num_classes=3, norm="batch")
RTOL = 1e-5  # tests/test_portable.py's agreement bound between the engines
ENGINES = ("ort-training", "portable") if training_build_installed() else ("portable",)


# --- the spec ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spec", "canonical"),
    [
        ("output:2", PersonalSpec(output=2), "output:2"),
        ("adapters:16", PersonalSpec(adapters=16), "adapters:16"),
        ("lora:4,input", PersonalSpec(input=True, lora=4), "input,lora:4"),
        (" names:*.bias , output:1", PersonalSpec(output=1, names=("*.bias",)), "output:1,names:*.bias"),
        ("names:a*,names:b*", PersonalSpec(names=("a*", "b*")), "names:a*,names:b*"),
        ("output:0", PersonalSpec(), "output:0"),
    ],
)
def test_specs_parse_to_a_typed_spec_with_one_canonical_string(text, spec, canonical):
    assert parse_spec(text) == spec
    assert str(spec) == canonical
    assert parse_spec(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty item"),
        ("adapters:4,", "empty item"),
        ("head", "not one of"),
        ("input:3", "not one of"),
        ("names:", "not one of"),
        ("adapters", "not one of"),
        ("adapters:0", "whole number >= 1"),
        ("lora:two", "whole number"),
        ("output:-1", "whole number"),
        ("output:1,output:2", "output twice"),
        ("input,input", "input twice"),
        ("names:x,names:x", "repeats"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_item(text, problem):
    with pytest.raises(UsageError, match=problem) as caught:
        parse_spec(text)
    assert "\n" not in str(caught.value) and caught.value.fix


def test_kp_is_output_k_and_giving_both_is_refused():
    assert personal_choice(None, None) == 2
    assert personal_choice(1, None) == 1 and as_spec(1) == (PersonalSpec(output=1), False)
    assert personal_choice(None, "adapters:4") == "adapters:4" and as_spec("adapters:4")[1]
    with pytest.raises(UsageError, match="both --kp 1 and --personal adapters:4"):
        personal_choice(1, "adapters:4")
    with pytest.raises(UsageError, match="both"):
        ExportCommand(model="mlp", kp=1, personal="input").split()
    with pytest.raises(UsageError, match="not one of"):
        ExportCommand(model="mlp", personal="head")
    assert ExportCommand(model="mlp").split() == 2


# --- what export inserts, and the roles -------------------------------------------------------------------------


@pytest.mark.parametrize("model", [MLP, BN_CNN], ids=["mlp", "bn-cnn"])
@pytest.mark.parametrize("text", ["adapters:4", "lora:2", "adapters:3,lora:1"])
def test_inserted_parts_start_as_the_identity(model, text):
    target = zoo_target(model, seed=0)
    original = target.module.eval()
    changed = personalized(original, target.blocks, target.input_shape, parse_spec(text), seed=1).eval()
    assert len(list(changed.parameters())) > len(list(original.parameters()))  # the original was copied, not changed
    x = torch.randn(5, *target.input_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(changed(x), original(x))
    for name, tensor in original.state_dict().items():  # every original tensor kept its name and value
        assert torch.equal(changed.state_dict()[name], tensor)


def _roles(model: ModelSpec, text: str) -> dict[str, str]:
    target = zoo_target(model, seed=0)
    spec = parse_spec(text)
    module = personalized(target.module, target.blocks, target.input_shape, spec, seed=0)
    return {t.name: t.role for t in tensor_roles(module, target.blocks, spec)}


def test_roles_of_each_item_on_the_mlp():
    assert _roles(MLP, "output:1") == {
        "hidden.weight": "base",
        "hidden.bias": "base",
        "classifier.weight": "personal",
        "classifier.bias": "personal",
    }
    assert _roles(MLP, "input") == {
        "hidden.weight": "personal",
        "hidden.bias": "personal",
        "classifier.weight": "base",
        "classifier.bias": "base",
    }
    adapters = _roles(MLP, "adapters:4")
    assert {n for n, r in adapters.items() if r == "personal"} == {
        f"hidden.adapter.{layer}.{t}" for layer in ("down", "up") for t in ("weight", "bias")
    }  # no adapter after the output layer; the mlp has no norm layer
    assert {n for n, r in adapters.items() if r == "base"} == {
        "hidden.weight",
        "hidden.bias",
        "classifier.weight",
        "classifier.bias",
    }
    lora = _roles(MLP, "lora:2")
    assert {n for n, r in lora.items() if r == "personal"} == {
        f"{layer}.lora_{f}" for layer in ("hidden", "classifier") for f in "AB"
    }
    assert _roles(MLP, "names:*.bias") == {
        "hidden.weight": "base",
        "hidden.bias": "personal",
        "classifier.weight": "base",
        "classifier.bias": "personal",
    }
    union = _roles(MLP, "input,lora:1")
    assert union["hidden.weight"] == "personal" and union["classifier.lora_B"] == "personal"
    assert union["classifier.weight"] == "base"


def test_roles_on_a_batchnorm_cnn_keep_the_norms_personal_with_adapters():
    adapters = _roles(BN_CNN, "adapters:2")
    assert adapters["conv1.1.weight"] == adapters["conv2.1.bias"] == "personal"  # the blocks' norms
    assert adapters["conv1.adapter.up.weight"] == adapters["fc2.adapter.down.bias"] == "personal"
    assert "classifier.adapter.up.weight" not in adapters
    assert adapters["conv1.0.weight"] == adapters["fc1.weight"] == adapters["classifier.bias"] == "base"
    assert adapters["conv1.1.running_mean"] == "buffer"
    lora = _roles(BN_CNN, "lora:1")
    assert lora["conv1.1.weight"] == "base" and lora["fc1.lora_A"] == "personal"
    assert "conv1.0.lora_A" not in lora  # a 5x5 convolution gets no LoRA update
    assert _roles(BN_CNN, "input")["conv1.1.weight"] == "personal"


def test_a_spec_matching_no_or_every_parameter_is_one_line():
    target = zoo_target(MLP, seed=0)
    for text, problem in (("names:nothing*", "matches no parameter"), ("output:2", "every parameter")):
        spec = parse_spec(text)
        with pytest.raises(UsageError, match=problem) as caught:
            check_personal_set(spec, tensor_roles(target.module, target.blocks, spec), "mlp")
        assert "\n" not in str(caught.value)


def test_export_refuses_an_unmatched_spec_before_writing(tmp_path):
    with pytest.raises(UsageError, match="matches no parameter"):
        export_bundle(MLP, "names:fc9.*", tmp_path / "b", ExportOptions(engines=("portable",)))
    assert not (tmp_path / "b").exists()
    convolutions = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten())
    with pytest.raises(UsageError, match="has no Linear or 1x1 Conv2d"):
        export_bundle(
            convolutions, "lora:1", tmp_path / "c", ExportOptions(engines=("portable",)), input_shape=(1, 6, 6)
        )


# --- the manifest --------------------------------------------------------------------------------------------------


def _manifest(model: ModelSpec, text: str) -> Manifest:
    from edgepfl.kinds import ImageKind, InputSpec

    target = zoo_target(model, seed=0)
    spec = parse_spec(text)
    module = personalized(target.module, target.blocks, target.input_shape, spec, seed=0)
    tensors = tensor_roles(module, target.blocks, spec)
    from edgepfl.personal import trailing_personal_blocks

    roles = [(t.block, t.role == "personal") for t in tensors if t.role != "buffer"]
    kp = trailing_personal_blocks(roles, len(target.blocks))
    return Manifest(
        model=model.to_dict(),
        kind=ImageKind(input=InputSpec(shape=model.input_shape)),
        num_classes=3,
        kp=kp,
        blocks=tuple(n for n, _ in target.blocks),
        tensors=tensors,
        personal=str(spec),
    )


def test_manifest_records_the_spec_and_shares_only_base_layers_buffers():
    adapters = _manifest(BN_CNN, "adapters:2")
    assert adapters.kp == 0 and adapters.to_json()["personal"] == "adapters:2"
    assert Manifest.from_json(adapters.to_json()) == adapters
    assert adapters.base_buffers() == []  # every BatchNorm is personal with adapters: so are its statistics
    original = {name for name, _ in zoo_target(BN_CNN, 0).module.named_parameters()}
    assert set(adapters.names("base")) == original - set(adapters.names("personal"))  # all but the norms
    lora = _manifest(BN_CNN, "lora:1,output:1")
    assert lora.kp == 1
    assert [t.name for t in lora.base_buffers()] == lora.batchnorm_statistics()  # the norms are base with LoRA


def test_a_bundle_from_before_specs_loads_as_output_kp(tmp_path):
    manifest = _manifest(MLP, "output:1")
    data = manifest.to_json()
    del data["personal"]  # what exports before --personal wrote
    old = Manifest.from_json(data)
    assert old.personal_spec == PersonalSpec(output=1) and old == manifest
    tampered = {**_manifest(MLP, "input").to_json(), "kp": 1}
    with pytest.raises(BundleError, match="kp=1 does not match"):
        Manifest.from_json(tampered)
    with pytest.raises(BundleError, match="re-export"):
        Manifest.from_json({**data, "personal": "wings:2"})


def test_the_page_shares_the_same_buffers_as_python(tmp_path):
    """algorithms.js travellingNames (run by Node) against Manifest.shared for a non-suffix personal set."""
    if shutil.which("node") is None:
        pytest.skip("needs node")
    for text in ("adapters:2", "lora:1", "output:2"):
        manifest = _manifest(BN_CNN, text)
        path = tmp_path / "manifest.json"
        path.write_text(json.dumps(manifest.to_json()))
        module = (REPO / "device_runtime" / "web" / "src" / "algorithms.js").as_uri()
        script = (
            f"import {{ travellingNames }} from '{module}'; import {{ readFileSync }} from 'node:fs';"
            f"const m = JSON.parse(readFileSync({json.dumps(str(path))}, 'utf8'));"
            "console.log(JSON.stringify(travellingNames(m, { share_buffers: true })));"
        )
        done = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, check=True)
        assert json.loads(done.stdout) == [t.name for t in manifest.shared(True)], text


# --- every engine trains it ----------------------------------------------------------------------------------------


IMAGE_CASES = {
    "mlp-adapters-lora": (MLP, "adapters:4,lora:2"),
    "mlp-input-names": (MLP, "input,names:classifier.bias"),
    "bn-cnn-adapters-lora": (BN_CNN, "adapters:2,lora:1"),
}
TEXT_CASES = {  # tiny text models over tests/test_text_models.py's corpus
    "transformer-adapters": ("transformer", "adapters:4", {"layers": 1, "seq_len": 4}),
    "lstm-input-lora": ("lstm", "input,lora:2", {"seq_len": 3}),
}


@pytest.fixture(scope="module")
def personal_bundles(tmp_path_factory):
    """case id -> its bundle (both engines), exported on first use."""
    from test_text_models import CORPUS, export_sequence

    folders: dict[str, Path] = {}

    def bundle(case: str) -> Path:
        if case not in folders:
            folder = tmp_path_factory.mktemp("personal") / "bundle"
            if case in IMAGE_CASES:
                model, text = IMAGE_CASES[case]
                export_bundle(model, text, folder, ExportOptions(engines=ENGINES, portable_batch=8, seed=3))
            else:
                name, text, knobs = TEXT_CASES[case]
                corpus = folder.parent / "corpus.txt"
                corpus.write_text(CORPUS, encoding="utf-8")
                export_sequence(folder, name, text, vocab=corpus, **knobs)
            folders[case] = folder
        return folders[case]

    return bundle


@pytest.fixture(params=list(IMAGE_CASES))
def personal_bundle(request, personal_bundles):
    """An image bundle with a personal part that is not its last blocks."""
    return personal_bundles(request.param)


@pytest.fixture(params=[*IMAGE_CASES, *TEXT_CASES])
def any_personal_bundle(request, personal_bundles):
    """Each image and each text bundle with a personal part that is not its last blocks."""
    return personal_bundles(request.param)


def _engines(folder: Path) -> dict:
    from edgepfl.simulate.torch_engine import TorchEngine

    engines = {name: open_engine(folder, name, threads=1) for name in ENGINES}
    manifest = load_manifest(folder)
    engines["torch"] = TorchEngine(folder, manifest, engines["portable"].get_tensors(), threads=1)
    return engines


def _batch(manifest: Manifest, seed: int, count: int = 8):
    """Seeded input of the bundle's kind (pixels or token ids) and labels: tests/test_text_models.py's."""
    from test_text_models import batch

    return batch(manifest, count, seed)


@pytest.mark.slow
def test_the_exported_graphs_start_equal_to_the_original_model(personal_bundle):
    manifest = load_manifest(personal_bundle)
    spec = ModelSpec(**manifest.model)
    original = zoo_target(spec, seed=3).module.eval()
    engine = open_engine(personal_bundle, "portable", threads=1)
    x, _ = _batch(manifest, seed=5)
    np.testing.assert_allclose(engine.logits(x), original(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_every_engine_trains_the_personal_part_alone_and_they_agree(any_personal_bundle):
    engines = _engines(any_personal_bundle)
    manifest = engines["portable"].manifest
    assert "personal" in engines["portable"].available_sets()
    initial = engines["portable"].get_tensors()
    base, personal = manifest.names("base"), manifest.names("personal")
    assert "frozen" in manifest.engines["portable"]["steps"]["personal"]  # the base as the variant's initializers
    for step in range(3):  # repeated personal-only steps: the third runs the portable engine's frozen variant
        x, y = _batch(manifest, seed=step)
        losses = {name: engine.train_step(x, y, lr=0.1, trainable="personal") for name, engine in engines.items()}
        assert max(losses.values()) == pytest.approx(min(losses.values()), rel=RTOL), losses
    after = {name: engine.get_tensors() for name, engine in engines.items()}
    for name, tensors in after.items():
        assert all(np.array_equal(tensors[n], initial[n]) for n in base), f"{name} moved a base tensor"
        assert any(not np.array_equal(tensors[n], initial[n]) for n in personal), f"{name} trained nothing"
    _assert_agree(after)
    x, y = _batch(manifest, seed=9)  # and the full step, as FedSim takes it
    losses = {name: engine.train_step(x, y, lr=0.1, trainable="full") for name, engine in engines.items()}
    assert max(losses.values()) == pytest.approx(min(losses.values()), rel=RTOL), losses
    _assert_agree({name: engine.get_tensors() for name, engine in engines.items()})


def _assert_agree(after: dict, reference_engine: str = "torch") -> None:
    reference = after[reference_engine]
    for name, tensors in after.items():
        for tensor, value in tensors.items():
            # the floor: an adapter's bias that the next BatchNorm cancels stays at zero up to rounding
            scale = max(float(np.abs(reference[tensor]).max()), 1e-3)
            error = float(np.abs(value.astype(np.float64) - reference[tensor]).max()) / scale
            assert error <= RTOL, f"{name} {tensor}: relative error {error:.1e}"


@pytest.mark.slow
def test_export_model_carries_the_trained_personal_part_in_fp32_and_int8(any_personal_bundle, tmp_path):
    """`device export-model` of a device whose personal part moved: fp32 is the engine's model, adapters and LoRA
    included; int8 (calibrated on the device's samples) loads and gives probabilities."""
    import onnxruntime
    from test_text_models import _Windows

    from edgepfl.device_runtime.model_export import export_device_model
    from edgepfl.device_runtime.predict import open_device_model

    model = open_device_model(any_personal_bundle, tmp_path / "state", "portable")
    manifest = model.engine.manifest
    x, y = _batch(manifest, seed=1, count=16)
    untrained = model.engine.predict(x)
    # a personal part far from its start (a zero LoRA factor or adapter projection learns slowly in a few steps)
    rng = np.random.default_rng(0)
    personal = model.engine.get_tensors(manifest.names("personal"))
    model.engine.set_tensors({n: v + rng.normal(0, 0.3, v.shape).astype(v.dtype) for n, v in personal.items()})
    trained = model.engine.predict(x)
    assert float(np.abs(trained - untrained).max()) > 1e-3, "the personal part changed nothing to export"
    fp32 = export_device_model(model, tmp_path / "fp32.onnx")
    assert fp32.max_difference <= 1e-4
    session = onnxruntime.InferenceSession(str(tmp_path / "fp32.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["probabilities"], {"input": x})[0], trained, atol=1e-5)
    int8 = export_device_model(model, tmp_path / "int8.onnx", "int8", _Windows(x, y, manifest.kind), 16)  # type: ignore[arg-type]
    assert int8.calibration_samples == 16 and int8.val_accuracy is not None
    quantized = onnxruntime.InferenceSession(str(tmp_path / "int8.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(quantized.run(["probabilities"], {"input": x})[0].sum(1), 1, atol=1e-4)


# --- simulate ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_npz(tmp_path_factory):
    """Tiny 6x6 stand-in digits of 4 classes (learnable, seeded)."""
    path = tmp_path_factory.mktemp("digits") / "digits.npz"
    return write_stand_in_digits(path, classes=4, side=6, train=160, test=40, noise=30.0)


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "engine"), [("fedalt", "portable"), ("fedsim", "torch")])
def test_simulate_with_adapters_uploads_the_original_network_only(digits_npz, tmp_path, algorithm, engine):
    from edgepfl.simulate.config import SimulateConfig
    from edgepfl.simulate.loop import run_simulation
    from edgepfl.simulate.rounds import final_global_base

    out = tmp_path / algorithm
    config = SimulateConfig(
        out=str(out),
        model="mlp",
        personal="adapters:4",
        algorithm=algorithm,
        dataset=str(digits_npz),
        data_root=str(digits_npz.parent),
        partition="classes:2",
        clients=3,
        rounds=2,
        epochs=1,
        batch_size=16,
        lr=0.05,
        engine=engine,
        threads=1,
    )
    results = run_simulation(config)
    document = json.loads((out / "results.json").read_text())
    assert document["info"]["personal"] == "adapters:4" and document["info"]["kp"] == 0
    assert len(results.rounds) == 2
    manifest = load_manifest(out / "bundle")
    assert set(final_global_base(out)) == set(manifest.names("base"))  # the original network's tensors only
    assert not any("adapter" in name for name in manifest.names("base"))
    # the base is the whole original mlp: 36*100+100 + 100*4+4 float32 values, once per client and round
    assert all(r.bytes_up >= 3 * 4 * (36 * 100 + 100 + 100 * 4 + 4) for r in results.rounds)


def test_simulate_refuses_personal_where_the_algorithm_personalizes_nothing(digits_npz, tmp_path):
    from edgepfl.simulate.config import SimulateConfig

    with pytest.raises(UsageError, match="--personal does not apply"):
        SimulateConfig(out=str(tmp_path), model="mlp", personal="adapters:4", algorithm="fedavg")
    with pytest.raises(UsageError, match="both --kp 1 and --personal"):
        SimulateConfig(out=str(tmp_path), model="mlp", kp=1, personal="adapters:4")


def test_the_browser_engine_trains_the_personal_part_as_python_does(personal_bundle, tmp_path):
    """engine.js (Node, onnxruntime-web's wasm) on the same batches as the Python portable engine: personal steps."""
    web = REPO / "device_runtime" / "web"
    if shutil.which("node") is None or not (web / "node_modules" / "onnxruntime-web").is_dir():
        pytest.skip("needs node and `npm ci --prefix device_runtime/web`")
    python = open_engine(personal_bundle, "portable", threads=1)
    manifest = python.manifest
    initial = python.get_tensors()
    batches = [_batch(manifest, seed=step) for step in range(3)]
    losses = [python.train_step(x, y, lr=0.1, trainable="personal") for x, y in batches]
    feeds = [{"x": x.ravel().tolist(), "y": y.tolist()} for x, y in batches]
    (tmp_path / "feeds.json").write_text(json.dumps(feeds))
    script = f"""
import * as ort from 'onnxruntime-web';
import {{ readFileSync, readdirSync, statSync }} from 'node:fs';
import {{ join, relative }} from 'node:path';
import {{ openEngine }} from './src/engine.js';
const root = {json.dumps(str(personal_bundle))};
const manifest = JSON.parse(readFileSync(join(root, 'manifest.json'), 'utf8'));
const files = new Map();
const walk = (dir) => {{
  for (const name of readdirSync(dir)) {{
    const path = join(dir, name);
    if (statSync(path).isDirectory()) walk(path);
    else files.set(relative(root, path), new Uint8Array(readFileSync(path)));
  }}
}};
walk(root);
const engine = await openEngine(ort, manifest, files, {{ threads: 1 }});
const feeds = JSON.parse(readFileSync({json.dumps(str(tmp_path / "feeds.json"))}, 'utf8'));
const losses = [];
for (const {{ x, y }} of feeds) {{
  losses.push(await engine.trainStep(Float32Array.from(x), Int32Array.from(y), y.length, 0.1, 'personal'));
}}
const tensors = Object.fromEntries(Object.entries(await engine.getTensors()).map(([n, t]) => [n, Array.from(t.data)]));
console.log(JSON.stringify({{ losses, tensors }}));
"""
    done = subprocess.run(["node", "--input-type=module", "-e", script], cwd=web, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    browser = json.loads(done.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(browser["losses"], losses, rtol=RTOL)
    tensors = {n: np.asarray(v, dtype=np.float32).reshape(initial[n].shape) for n, v in browser["tensors"].items()}
    assert all(np.array_equal(tensors[n], initial[n]) for n in manifest.names("base")), "the page moved a base tensor"
    _assert_agree({"portable": python.get_tensors(), "browser": tensors}, reference_engine="portable")
