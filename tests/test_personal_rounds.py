"""Personal parts that are not the last blocks (`input`, `adapters:DIM`, `lora:RANK`) through the served round
engine's paths: FedBuff steps, secure aggregation, DP and int8 uploads. Only the manifest's base tensors leave a
client (the uploads and the secure vector), personal tensors change on the clients only, and a spec naming the
last block (`names:classifier.*`) runs exactly as `--kp 1` does."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")

from test_simulate import tiny_config, tiny_npz  # noqa: E402, F401 - tiny_npz is a fixture
from test_simulate_sequences import text_config, text_folder  # noqa: E402, F401 - text_folder is a fixture

from edgepfl.device_runtime import secure_round  # noqa: E402
from edgepfl.encoding import SCALE_SUFFIX  # noqa: E402
from edgepfl.manifest import load_manifest  # noqa: E402
from edgepfl.server.uploads import Upload  # noqa: E402
from edgepfl.simulate import loop  # noqa: E402
from edgepfl.simulate.bundle import initial_file, initial_tensors  # noqa: E402
from edgepfl.simulate.loop import run_simulation  # noqa: E402
from edgepfl.simulate.rounds import final_global_base  # noqa: E402

FLEET = "dropout:0,speed:lognormal:2.0,sample-time:0.01,seed:1"
PATHS = {
    "fedbuff": {"aggregation": "fedbuff", "buffer_size": 2, "max_staleness": 10, "fleet": FLEET, "round_timeout": 60.0},
    "secure": {"secure_aggregation": True, "min_clients": 3},
    "dp": {"dp_noise_multiplier": 0.5, "dp_clip": 1.0, "min_clients": 3},
    "int8": {"upload_encoding": "int8", "min_clients": 3},  # int8 deltas with error feedback
}
# (model, spec): the tiny image mlp with each item, the tiny transformer's adapters and the lstm's input layer + LoRA
CASES = [("mlp", "input"), ("mlp", "adapters:4,lora:2"), ("transformer", "adapters:4"), ("lstm", "input,lora:2")]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    """Each (model, spec, dataset)'s bundle, exported by the first run that needs it."""
    return {}


@pytest.fixture
def export_once(exports, monkeypatch, tmp_path_factory) -> None:
    """Runs of one model and spec on each path share one export (the child export is most of a tiny run)."""
    ensure = loop.ensure_bundle

    def cached(config, folder, *args, **kwargs):
        key = (config.model, config.personal, config.kp, config.data.dataset)
        if key not in exports:
            exports[key] = tmp_path_factory.mktemp("export") / "bundle"
            ensure(config, exports[key], *args, **kwargs)
        for source in (exports[key], initial_file(exports[key])):
            if source.is_dir():
                shutil.copytree(source, folder.parent / source.name)
            elif source.is_file():
                shutil.copy(source, folder.parent / source.name)
        return load_manifest(folder)

    monkeypatch.setattr(loop, "ensure_bundle", cached)


class Leaving:
    """What leaves the clients (each plain upload's tensor names, each secure delta's names and its vector's size),
    and the simulated clients, whose tensors are what stays on each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.uploads: list[set[str]] = []
        self.secure: list[tuple[set[str], int]] = []
        self.clients: list = []
        parse, quantize, make_client = Upload.parse.__func__, secure_round.quantize_delta, loop._make_client

        def parsed(cls, payload, *args, **kwargs):
            upload = parse(cls, payload, *args, **kwargs)
            self.uploads.append({name.removesuffix(SCALE_SUFFIX) for name in upload.tensors})  # int8's scales
            return upload

        def quantized(delta, weight, book, rng=None):
            self.secure.append((set(delta), book.base_size))
            return quantize(delta, weight, book, rng)

        def made(*args, **kwargs):
            self.clients.append(make_client(*args, **kwargs))
            return self.clients[-1]

        monkeypatch.setattr(Upload, "parse", classmethod(parsed))
        monkeypatch.setattr(secure_round, "quantize_delta", quantized)
        monkeypatch.setattr(loop, "_make_client", made)


def run_config(model: str, spec: str, path: str, out, tiny_npz, text_folder):  # noqa: F811
    """FedAlt with the spec personal on the path's rounds: the tiny mlp on digits, a sequence model on the texts."""
    changes = {"algorithm": "fedalt", "personal": spec, "kp": None, "rounds": 3 if path == "fedbuff" else 2}
    changes.update(PATHS[path])
    if model == "mlp":
        return tiny_config(tiny_npz, out, **changes)
    return text_config(text_folder, out, model=model, **changes)


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("model", "spec"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_only_base_tensors_leave_and_personal_ones_train_on_the_clients(
    model,
    spec,
    path,
    tmp_path,
    monkeypatch,
    export_once,
    tiny_npz,  # noqa: F811
    text_folder,  # noqa: F811
):
    if path == "dp":
        pytest.importorskip("dp_accounting")
    leaving = Leaving(monkeypatch)
    out = tmp_path / "run"
    results = run_simulation(run_config(model, spec, path, out, tiny_npz, text_folder))
    manifest = load_manifest(out / "bundle")
    base, personal = set(manifest.names("base")), set(manifest.names("personal"))
    assert str(manifest.personal_spec) == spec and personal and not base & personal
    if path == "secure":
        assert not leaving.uploads and leaving.secure, "a secure round sends masked vectors, not uploads"
        size = sum(int(np.prod(t.shape)) for t in manifest.by_role("base"))
        assert all(names == base and values == size for names, values in leaving.secure)
    else:
        assert leaving.uploads and all(names == base for names in leaving.uploads)
    assert set(final_global_base(out)) == base
    assert all(record.sampled for record in results.rounds)
    if path == "secure":
        summaries = [row["secure_aggregation"] for row in json.loads((out / "results.json").read_text())["rounds"]]
        assert all(summary["phase"] == "done" for summary in summaries)
    initial = initial_tensors(out / "bundle")
    for tensor in personal:  # each client trained its own copy: changed, and not one shared value
        copies = [client.tensors[tensor] for client in leaving.clients]
        assert any(not np.array_equal(copy, initial[tensor]) for copy in copies), tensor
        assert any(not np.array_equal(copy, copies[0]) for copy in copies[1:]), f"every client holds one {tensor}"


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_a_spec_naming_the_last_block_runs_as_kp_1_does(path, tmp_path, export_once, tiny_npz):  # noqa: F811
    """`names:classifier.*` is the mlp's output layer by name: the spec's code path, not the suffix one; every
    number of the run and the final global model equal `--kp 1`'s."""
    if path == "dp":
        pytest.importorskip("dp_accounting")
    runs = {}
    for label, split in (("suffix", {"kp": 1}), ("named", {"kp": None, "personal": "names:classifier.*"})):
        changes = {"algorithm": "fedalt", "rounds": 3 if path == "fedbuff" else 2, **split, **PATHS[path]}
        run_simulation(tiny_config(tiny_npz, tmp_path / label, **changes))
        runs[label] = json.loads((tmp_path / label / "results.json").read_text())
    assert load_manifest(tmp_path / "named" / "bundle").personal_spec.names == ("classifier.*",)
    suffix, named = final_global_base(tmp_path / "suffix"), final_global_base(tmp_path / "named")
    assert set(suffix) == set(named) == {"hidden.weight", "hidden.bias"}
    for tensor in suffix:
        np.testing.assert_array_equal(named[tensor], suffix[tensor], err_msg=tensor)
    for mine, theirs in zip(runs["named"]["rounds"], runs["suffix"]["rounds"], strict=True):
        assert mine["test_accuracy"] == theirs["test_accuracy"] and mine["train_loss"] == theirs["train_loss"]
