"""PersFL's distillation step in both engines: the loss and one step against PyTorch, frozen sets, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.device_runtime.engine import DistillStep, open_engine

torch = pytest.importorskip("torch")
F = torch.nn.functional

RTOL = 1e-5
KP = 2  # the cnn's classifier and fc2 are personal


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """Largest deviation as a fraction of the reference tensor's largest magnitude."""
    reference = np.asarray(reference, dtype=np.float64)
    return float(np.abs(np.asarray(ours, dtype=np.float64) - reference).max() / max(np.abs(reference).max(), 1e-12))


def reference_loss(student, teacher, y, temperature: float, lam: float, variant: str):
    """The textbook forms with PyTorch's own functions: Hinton KD via kl_div, GD via soft-target cross-entropy."""
    hard = F.cross_entropy(student, y)
    if variant == "kd":
        soft = F.kl_div(
            F.log_softmax(student / temperature, 1), F.softmax(teacher / temperature, 1), reduction="batchmean"
        )
        return (1 - lam) * hard + lam * temperature**2 * soft
    return (1 - lam) * hard + lam * F.cross_entropy(student / temperature, F.softmax(teacher / temperature, 1))


@pytest.fixture(scope="module")
def bundle(bundle_factory):
    # the same export as tests/test_portable.py's case bundle, so a full run exports it once
    return bundle_factory("cnn", KP, engines=("ort-training", "portable"), norm="batch", distill=True)


def batch(engine, seed: int = 0, count: int = 32):
    rng = np.random.default_rng(seed)
    shape = tuple(engine.manifest.input.shape)
    x = rng.standard_normal((count, *shape)).astype(np.float32)
    y = rng.integers(0, engine.manifest.num_classes, count).astype(np.int64)
    teacher = (3 * rng.standard_normal((count, engine.manifest.num_classes))).astype(np.float32)
    return x, y, teacher


@pytest.mark.parametrize("variant", ["kd", "gd"])
@pytest.mark.parametrize("temperature, lam", [(1.0, 0.1), (4.0, 0.7)])
def test_distillation_loss_equals_pytorch_reference(variant, temperature, lam):
    from edgepfl.export.portable import distillation_loss

    rng = np.random.default_rng(1)
    student = torch.from_numpy(rng.standard_normal((16, 10)) * 3)
    teacher = torch.from_numpy(rng.standard_normal((16, 10)) * 3)
    y = torch.from_numpy(rng.integers(0, 10, 16))
    ours = distillation_loss(
        student,
        teacher,
        y,
        torch.ones(16, dtype=torch.float64),
        torch.tensor(temperature, dtype=torch.float64),
        torch.tensor(lam, dtype=torch.float64),
        variant,
    )
    expected = reference_loss(student, teacher, y, temperature, lam, variant)
    assert float(ours) == pytest.approx(float(expected), rel=1e-12)
    # padding (w = 0) counts for nothing
    padded = distillation_loss(
        torch.cat([student, 50 * student[:3]]),
        torch.cat([teacher, teacher[:3]]),
        torch.cat([y, y[:3]]),
        torch.cat([torch.ones(16), torch.zeros(3)]).double(),
        torch.tensor(temperature, dtype=torch.float64),
        torch.tensor(lam, dtype=torch.float64),
        variant,
    )
    assert float(padded) == pytest.approx(float(expected), rel=1e-12)


def test_gd_differs_from_kd_by_the_temperature_scaling():
    from edgepfl.export.portable import distillation_loss

    rng = np.random.default_rng(2)
    student = torch.from_numpy(rng.standard_normal((8, 10))).requires_grad_()
    teacher = torch.from_numpy(rng.standard_normal((8, 10)))
    y = torch.from_numpy(rng.integers(0, 10, 8))
    w = torch.ones(8, dtype=torch.float64)
    grads = {}
    for variant in ("kd", "gd"):
        # λ = 1 isolates the distillation term: gd's gradient is kd's divided by T²
        loss = distillation_loss(
            student,
            teacher,
            y,
            w,
            torch.tensor(4.0, dtype=torch.float64),
            torch.tensor(1.0, dtype=torch.float64),
            variant,
        )
        grads[variant] = torch.autograd.grad(loss, student)[0]
    torch.testing.assert_close(grads["gd"] * 16, grads["kd"])


def test_bundle_lists_distillation_graphs(bundle):
    from edgepfl.manifest import load_manifest

    manifest = load_manifest(bundle, verify_files=True)
    distill = manifest.engines["portable"]["distill"]
    assert set(distill) == {"kd", "gd"} and all(set(sets) == {"full", "personal"} for sets in distill.values())
    graph = distill["kd"]["full"]
    assert graph["inputs"][-4:] == ["teacher_logits", "T", "lambda", "lr"]
    assert (bundle / graph["model"]).is_file() and graph["model"] in manifest.files


def test_bundle_lists_ort_training_distillation_artifacts(bundle):
    from edgepfl.manifest import load_manifest

    manifest = load_manifest(bundle, verify_files=True)
    distill = manifest.engines["ort-training"]["distill"]
    assert set(distill) == {"kd", "gd"}
    assert all(set(entry["sets"]) == {"full", "personal"} for entry in distill.values())
    assert distill["kd"]["inputs"] == ["input", "labels", "teacher_logits", "T", "lambda"]
    assert distill["kd"]["bn_stats"]  # the cnn's BatchNorm statistics are written back after distillation steps too
    for entry in distill.values():
        assert all(path in manifest.files for path in entry["sets"]["full"].values() if "checkpoint" not in path)


@pytest.mark.parametrize("engine_name", ["portable", "ort-training"])
@pytest.mark.parametrize("variant", ["kd", "gd"])
@pytest.mark.parametrize("count", [None, 5])  # a full batch, and a partial one (padded in the portable graphs)
def test_one_distillation_step_matches_pytorch_float32(bundle, engine_name, variant, count):
    from edgepfl.export.models import ModelSpec, build_model

    engine = open_engine(bundle, engine_name, threads=2)
    x, y, teacher = batch(engine, seed=3, count=32 if count is None else count)
    temperature, lam, lr = 4.0, 0.7, 0.05
    initial = engine.get_tensors()
    loss = engine.distill_step(DistillStep(x, y, teacher, lr=lr, temperature=temperature, lam=lam, variant=variant))

    torch.set_num_threads(2)
    model = build_model(ModelSpec(**engine.manifest.model)).train()
    model.load_state_dict({n: torch.from_numpy(v) for n, v in initial.items()}, strict=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    expected = reference_loss(
        model(torch.from_numpy(x)), torch.from_numpy(teacher), torch.from_numpy(y), temperature, lam, variant
    )
    expected.backward()
    optimizer.step()
    assert loss == pytest.approx(expected.item(), rel=RTOL)
    after = engine.get_tensors()
    state = model.state_dict()
    errors = {n: relative_error(after[n], state[n].detach().numpy()) for n in after}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RTOL, f"{worst}: relative error {errors[worst]:.2e}"
    assert any(not np.array_equal(initial[n], after[n]) for n in engine.manifest.names("base"))


@pytest.mark.parametrize("engine_name", ["portable", "ort-training"])
def test_personal_distillation_leaves_base_bit_identical(bundle, engine_name):
    engine = open_engine(bundle, engine_name, threads=2)
    base_before = engine.tensors_by_role("base")
    personal_before = engine.tensors_by_role("personal")
    for seed in range(3):
        x, y, teacher = batch(engine, seed=seed)
        engine.distill_step(
            DistillStep(x, y, teacher, lr=0.1, temperature=2.0, lam=0.5, variant="gd", trainable="personal")
        )
    base_after = engine.tensors_by_role("base")
    assert base_before and all(np.array_equal(base_before[n], base_after[n]) for n in base_before)
    personal_after = engine.tensors_by_role("personal")
    assert all(not np.array_equal(personal_before[n], personal_after[n]) for n in personal_before)


@pytest.mark.parametrize("engine_name", ["portable", "ort-training"])
def test_distill_step_refuses_bad_input_with_one_line_errors(bundle, engine_name):
    from edgepfl.errors import DataError, UsageError

    engine = open_engine(bundle, engine_name, threads=2)
    x, y, teacher = batch(engine)
    with pytest.raises(DataError, match="teacher logits have shape"):
        engine.distill_step(DistillStep(x, y, teacher[:, :3], lr=0.1, temperature=2.0, lam=0.5))
    with pytest.raises(UsageError, match="temperature"):
        engine.distill_step(DistillStep(x, y, teacher, lr=0.1, temperature=0.0, lam=0.5))
    with pytest.raises(UsageError, match="lambda"):
        engine.distill_step(DistillStep(x, y, teacher, lr=0.1, temperature=2.0, lam=1.5))
    with pytest.raises(Exception, match="'xx' distillation"):
        engine.distill_step(DistillStep(x, y, teacher, lr=0.1, temperature=2.0, lam=0.5, variant="xx"))


@pytest.mark.parametrize("engine_name", ["portable", "ort-training"])
def test_logits_match_the_eval_graph_loss(bundle, engine_name):
    engine = open_engine(bundle, engine_name, threads=2)
    x, y, _ = batch(engine, count=39)
    logits = engine.logits(x)
    assert logits.shape == (len(x), engine.manifest.num_classes)
    expected = F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(y), reduction="sum").item()
    assert engine.eval_batch(x, y).loss_sum == pytest.approx(expected, rel=1e-5)


def test_ort_training_and_portable_distil_alike_over_steps(bundle):
    engines = [open_engine(bundle, name, threads=2) for name in ("portable", "ort-training")]
    losses = {e.name: [] for e in engines}
    for seed in range(5):
        x, y, teacher = batch(engines[0], seed=seed)
        for engine in engines:
            loss = engine.distill_step(DistillStep(x, y, teacher, lr=0.05, temperature=2.0, lam=0.5, variant="kd"))
            losses[engine.name].append(loss)
    np.testing.assert_allclose(losses["portable"], losses["ort-training"], rtol=1e-4)
    after = [e.get_tensors() for e in engines]
    worst = max(relative_error(after[1][n], after[0][n]) for n in after[0])
    assert worst <= 1e-4
    # the engine's own training and evaluation still work after its distillation set was used
    x, y, _ = batch(engines[1], seed=9)
    assert np.isfinite(engines[1].train_step(x, y, lr=0.01)) and engines[1].eval_batch(x, y).count == 32


@pytest.mark.slow
def test_export_without_distillation_writes_none_and_engines_say_so(tmp_path):
    from edgepfl.errors import BundleError
    from edgepfl.export.bundle import ExportOptions, export_bundle
    from edgepfl.export.models import ModelSpec, default_spec

    spec = ModelSpec(**{**default_spec("mlp").to_dict(), "input_size": 8, "num_classes": 4})
    torch.set_num_threads(2)
    manifest = export_bundle(
        spec, 1, tmp_path / "b", ExportOptions(engines=("ort-training", "portable"), distill=False)
    )
    assert manifest.engines["portable"]["distill"] == {} and manifest.engines["ort-training"]["distill"] == {}
    assert not [path for path in manifest.files if "distill" in path]
    for name in ("portable", "ort-training"):
        engine = open_engine(tmp_path / "b", name)
        x, y, teacher = batch(engine, count=4)
        with pytest.raises(BundleError, match="re-export"):
            engine.distill_step(DistillStep(x, y, teacher, lr=0.1, temperature=2.0, lam=0.5))
