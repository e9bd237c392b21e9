"""The base/personal split for every zoo model and every K_P, and the layout hash."""

from __future__ import annotations

import dataclasses

import pytest

from edgepfl.kinds import ImageKind, InputSpec
from edgepfl.manifest import Manifest, layout_hash, split_roles

torch = pytest.importorskip("torch")
from edgepfl.export.models import MODEL_NAMES, ModelSpec, build_model, default_spec  # noqa: E402

EXPECTED_BLOCKS = {"mobilenet": 15, "cnn": 5, "mlp": 2, "resnet34": 18}


@pytest.fixture(scope="module", params=MODEL_NAMES)
def zoo_model(request):
    torch.manual_seed(0)
    return build_model(default_spec(request.param))


def manifest_for(model, kp: int) -> Manifest:
    params, buffers = model.state_tensors()
    return Manifest(
        model=model.spec.to_dict(),
        kind=ImageKind(input=InputSpec(shape=model.spec.input_shape)),
        num_classes=model.spec.num_classes,
        kp=kp,
        blocks=tuple(model.block_names()),
        tensors=split_roles(params, buffers, len(model.block_modules), kp),
    )


def test_every_kp_splits_at_block_boundary(zoo_model):
    blocks = zoo_model.block_names()
    assert len(blocks) == EXPECTED_BLOCKS[zoo_model.spec.name]
    assert blocks[-1] == "classifier"
    for kp in range(len(blocks) + 1):
        manifest = manifest_for(zoo_model, kp)
        manifest.check()
        first_personal = len(blocks) - kp
        for spec in manifest.tensors:
            if spec.role == "buffer":
                assert "running" in spec.name
            else:
                assert spec.role == ("personal" if spec.block >= first_personal else "base"), spec
        personal_blocks = {s.block for s in manifest.by_role("personal")}
        assert personal_blocks == set(range(first_personal, len(blocks)))
        if kp == 0:
            assert manifest.by_role("personal") == []
        if kp == len(blocks):
            assert manifest.by_role("base") == []
        n_params = sum(1 for _ in zoo_model.parameters())
        assert len(manifest.by_role("base")) + len(manifest.by_role("personal")) == n_params


def test_kp1_is_the_classifier_alone(zoo_model):
    manifest = manifest_for(zoo_model, 1)
    assert {s.name.split(".")[0] for s in manifest.by_role("personal")} == {"classifier"}


def test_mobilenet_has_13_depthwise_blocks_and_widths():
    for width in (0.25, 0.5, 0.75, 1.0):
        model = build_model(ModelSpec(width=width))
        assert [b for b in model.block_names() if b.startswith("dw")] == [f"dw{i}" for i in range(1, 14)]
        x = torch.zeros(2, 3, 32, 32)
        assert model.eval()(x).shape == (2, 10)
    big = build_model(ModelSpec(input_size=224, width=0.25))
    assert big.eval()(torch.zeros(1, 3, 224, 224)).shape == (1, 10)


def test_cnn_and_mlp_match_the_papers_shapes():
    cnn = build_model(default_spec("cnn"))
    assert cnn.fc1.in_features == 400 and cnn.fc1.out_features == 120 and cnn.fc2.out_features == 84
    mlp = build_model(default_spec("mlp"))
    assert (mlp.hidden.in_features, mlp.hidden.out_features) == (784, 100)
    assert sum(p.numel() for p in mlp.parameters()) == 784 * 100 + 100 + 100 * 10 + 10


def test_resnet34_has_16_basic_blocks():
    model = build_model(default_spec("resnet34"))
    assert sum(1 for b in model.block_names() if b.startswith("layer")) == 16
    assert model.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_group_norm_matches_torch_group_norm():
    from edgepfl.export.models import GroupNorm

    torch.manual_seed(1)
    ours, reference = GroupNorm(4, 16), torch.nn.GroupNorm(4, 16)
    with torch.no_grad():
        ours.weight.normal_(), ours.bias.normal_()
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(3, 16, 5, 5)
    torch.testing.assert_close(ours(x), reference(x), rtol=1e-5, atol=1e-5)


def test_layout_hash_changes_with_the_base():
    model = build_model(default_spec("cnn"))
    kp2, kp3 = manifest_for(model, 2), manifest_for(model, 3)
    assert kp2.base_layout_hash != kp3.base_layout_hash
    other = build_model(ModelSpec(name="cnn", norm="none", num_classes=10, input_size=28))
    assert manifest_for(other, 2).base_layout_hash != kp2.base_layout_hash
    # personal-only changes (a different number of classes) leave the base layout alone
    more_classes = build_model(ModelSpec(name="cnn", norm="none", num_classes=20))
    assert manifest_for(more_classes, 2).base_layout_hash == kp2.base_layout_hash
    base = kp2.by_role("base")
    renamed = [dataclasses.replace(base[0], shape=(1, *base[0].shape))] + base[1:]
    assert layout_hash(renamed) != layout_hash(base)


def test_manifest_round_trips_and_rejects_tampering(tmp_path):
    import json

    manifest = manifest_for(build_model(default_spec("mlp")), 1)
    manifest.save(tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert Manifest.from_json(data) == manifest
    data["tensors"][0]["role"] = "personal"
    from edgepfl.errors import BundleError

    with pytest.raises(BundleError):
        Manifest.from_json(data)
