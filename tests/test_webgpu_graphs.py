"""The portable graphs a browser's GPU can run whole: no int64 labels, no LogSoftmax, no scatter, and the exporter's
check that names a node it could not (tests/test_web_browser.py checks the placement in a real browser)."""

from __future__ import annotations

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from edgepfl.export.webgpu import MAX_LISTED, webgpu_problems  # noqa: E402


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def test_the_check_names_each_node_the_gpu_would_leave_to_the_cpu_and_why():
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 3])
    nodes = [
        helper.make_node("LogSoftmax", ["logits"], ["logp"], name="loss_log_softmax", axis=1),
        helper.make_node("ArgMax", ["logits"], ["best"], name="pick", axis=1),
        helper.make_node("Cast", ["logits"], ["wide"], name="widen", to=TensorProto.DOUBLE),
        helper.make_node("Reshape", ["logits", "shape"], ["flat"], name="flatten"),  # an int64 shape input is fine
        helper.make_node(
            "BatchNormalization", ["map", "c", "c", "c", "c"], ["norm", "mean", "var"], name="bn", training_mode=1
        ),
        helper.make_node("BatchNormalization", ["map", "c", "c", "c", "c"], ["scaled"], name="affine"),
    ]
    outputs = [
        helper.make_tensor_value_info("logp", TensorProto.FLOAT, [4, 3]),
        helper.make_tensor_value_info("best", TensorProto.INT64, [4, 1]),
        helper.make_tensor_value_info("wide", TensorProto.DOUBLE, [4, 3]),
        helper.make_tensor_value_info("flat", TensorProto.FLOAT, [12]),
        helper.make_tensor_value_info("norm", TensorProto.FLOAT, [2, 3, 2, 2]),
        helper.make_tensor_value_info("scaled", TensorProto.FLOAT, [2, 3, 2, 2]),
    ]
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [12])
    channel = helper.make_tensor("c", TensorProto.FLOAT, [3], [1.0, 1.0, 1.0])
    maps = helper.make_tensor_value_info("map", TensorProto.FLOAT, [2, 3, 2, 2])
    problems = webgpu_problems(_model(nodes, [logits, maps], outputs, [shape, channel]))
    assert problems == [
        "node loss_log_softmax (LogSoftmax): no WebGPU kernel",
        "node pick (ArgMax): best is int64, which no WebGPU kernel takes",
        "node widen (Cast): wide is float64, which no WebGPU kernel takes",
        "node bn (BatchNormalization): training-mode BatchNormalization has no WebGPU kernel (inference mode has)",
    ]
    dynamic = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    relu = [helper.make_node("Relu", ["x"], ["y"], name=f"relu{i}") for i in range(1)]
    assert webgpu_problems(_model(relu, [dynamic], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])) == [
        "input x has no fixed shape"
    ]
    many = [helper.make_node("LogSoftmax", ["logits"], [f"o{i}"], name=f"n{i}") for i in range(MAX_LISTED + 2)]
    listed = webgpu_problems(_model(many, [logits], [helper.make_tensor_value_info("o0", TensorProto.FLOAT, [4, 3])]))
    assert len(listed) == MAX_LISTED + 1 and listed[-1] == "and 2 more"


def test_the_flat_update_concatenates_and_splits_through_nodes_of_few_tensors():
    torch = pytest.importorskip("torch")
    from edgepfl.export import fanout

    generator = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 9, (23,), generator=generator)]
    tensors = [torch.randn(n, generator=generator) for n in sizes]
    flat = fanout.cat(tensors)
    assert torch.equal(flat, torch.cat(tensors))
    assert all(torch.equal(a, b) for a, b in zip(fanout.split(flat, sizes), tensors))
    assert len(fanout.split(flat, sizes)) == len(sizes) and fanout.split(flat, [flat.numel()])[0] is flat
    # cat's tree read backwards: as few Split nodes as outputs of at most MAX_FANOUT allow, or one more
    from torch.fx.experimental.proxy_tensor import make_fx

    for count in (8, 23, 54):
        pieces = [1 + i % 3 for i in range(count)]
        traced = make_fx(lambda values: fanout.split(values, pieces))(torch.zeros(sum(pieces)))  # noqa: B023
        nodes = [node for node in traced.graph.nodes if node.op == "call_function" and "split" in str(node.target)]
        fewest = -(-(count - 1) // (fanout.MAX_FANOUT - 1))
        assert fewest <= len(nodes) <= fewest + 1, count
        assert all(len(node.args[1]) <= fanout.MAX_FANOUT for node in nodes)


@pytest.mark.slow
def test_the_cnn_bundle_has_int32_labels_and_no_graph_with_a_known_webgpu_problem(bundle_factory):
    bundle = bundle_factory("cnn", 2, engines=("portable",), norm="batch")
    entry = json.loads((bundle / "manifest.json").read_text())["engines"]["portable"]
    assert entry["label_dtype"] == "int32"
    graphs = [entry["eval"], entry["predict"], *entry["steps"].values()]
    graphs += [s["frozen"] for s in entry["steps"].values() if "frozen" in s]
    assert len(graphs) == 7
    for graph in graphs:
        assert graph["webgpu_problems"] == [], graph["model"]
        proto = onnx.load(str(bundle / graph["model"]), load_external_data=False)
        assert webgpu_problems(proto) == []
        ops = {node.op_type for node in proto.graph.node}
        # the loss's label gather and scatter take the int32 labels (webgpu_problems would name an int64 one)
        assert not ops & {"LogSoftmax", "ArgMax", "MaxPool"}, graph["model"]


@pytest.mark.slow
def test_a_mobilenet_step_has_no_known_webgpu_problem():
    torch = pytest.importorskip("torch")
    from edgepfl.export import portable
    from edgepfl.export.models import ModelSpec, build_model

    torch.manual_seed(0)
    model = build_model(ModelSpec(name="mobilenet", width=0.25))
    params = [n for n, _ in model.named_parameters()]
    buffers = [n for n, _ in model.named_buffers() if not n.endswith("num_batches_tracked")]
    proto = portable.export_step(portable.MaskedModel(model), params, buffers, params, batch_size=4)
    assert webgpu_problems(proto) == []


def test_the_export_notes_once_per_reason_the_graphs_browsers_run_on_webassembly():
    from edgepfl.export.bundle import _webgpu_notes

    entry = {
        "steps": {
            "full": {"webgpu_problems": ["node a (LogSoftmax): no WebGPU kernel", "and 1 more"]},
            "personal": {},
            "base": {"webgpu_problems": ["node a (LogSoftmax): no WebGPU kernel"]},
        },
        "eval": {"webgpu_problems": ["node e (Gather): x is int64"]},
    }
    assert _webgpu_notes(entry) == [
        "note: browsers run step_full, step_base on WebAssembly, not the GPU: node a (LogSoftmax): no WebGPU kernel",
        "note: browsers run eval on WebAssembly, not the GPU: node e (Gather): x is int64",
    ]


def test_cross_entropy_and_correct_count_equal_pytorch_ties_and_padding_included():
    torch = pytest.importorskip("torch")
    from edgepfl.export.crossentropy import correct_count, weighted_cross_entropy

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 5, dtype=torch.float64, generator=generator) * 30  # far apart, as trained logits are
    logits[3] = 0.0  # a row of ties: argmax picks class 0
    logits[4, 1] = logits[4, 3] = logits[4].max() + 1  # two tied maxima: the first one counts
    y = torch.tensor([0, 1, 2, 0, 3, 4, 0, 1, 2, 3, 4, 0], dtype=torch.int32)
    w = torch.ones(12, dtype=torch.float64)
    w[-2:] = 0  # padding
    leaf = logits.clone().requires_grad_()
    ours = weighted_cross_entropy(leaf, y, w)
    ours.backward(torch.tensor(0.5, dtype=torch.float64))  # the step seeds its backward with lr
    reference = leaf.detach().clone().requires_grad_()
    theirs = torch.nn.functional.cross_entropy(reference[:-2], y[:-2].long())
    (0.5 * theirs).backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-12, atol=1e-12)
    assert not leaf.grad[-2:].any()  # padding trains nothing
    expected = ((logits.argmax(1) == y.long()) & (w > 0)).sum()
    assert correct_count(logits, y, w).dtype == torch.float32 and int(correct_count(logits, y, w)) == int(expected)


@pytest.mark.parametrize("kernel", [2, 3])
def test_a_tiling_max_pool_and_its_backward_equal_pytorch_ties_included(kernel):
    torch = pytest.importorskip("torch")
    from edgepfl.export.decompositions import _max_pool, _max_pool_backward

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 2 * kernel, 3 * kernel, dtype=torch.float64, generator=generator)
    x[0, 0, :kernel, :kernel] = 0.5  # a window of ties: its gradient goes to its first element
    x[1, 2] = torch.relu(x[1, 2])  # zeros from a ReLU, tied
    leaf = x.clone().requires_grad_()
    values, indices = torch.nn.functional.max_pool2d(leaf, kernel, return_indices=True)
    grad_out = torch.randn(values.shape, dtype=torch.float64, generator=generator)
    values.backward(grad_out)
    ours, _ = _max_pool(x, [kernel, kernel], [kernel, kernel])
    torch.testing.assert_close(ours, values.detach(), rtol=0, atol=0)
    grad = _max_pool_backward(grad_out, x, [kernel, kernel], [kernel, kernel], [0, 0], [1, 1], False, indices)
    torch.testing.assert_close(grad, leaf.grad, rtol=0, atol=0)
    # an overlapping pool is left to the default decomposition
    assert _max_pool(x, [3, 3], [2, 2]) is NotImplemented


def test_labels_of_any_integer_type_reach_the_step_as_the_manifest_says(bundle_factory):
    from edgepfl.device_runtime.portable_engine import PortableEngine
    from edgepfl.manifest import load_manifest

    bundle = bundle_factory("cnn", 2, engines=("portable",), norm="batch")
    manifest = load_manifest(bundle)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, *manifest.input.shape)).astype(np.float32)
    y = rng.integers(0, manifest.num_classes, 5)
    losses = []
    for labels in (y.astype(np.int64), y.astype(np.int32), y.astype(np.uint8)):
        engine = PortableEngine(bundle, manifest)
        assert engine.label_dtype == np.int32
        losses.append(engine.train_step(x, labels, 0.05))
    assert losses[0] == losses[1] == losses[2]


@pytest.mark.slow
def test_a_chained_k_step_graph_trains_as_the_one_step_graph_run_k_times(bundle_factory):
    """bench/kstep.py's K steps in one graph (issue 39, item 2): the same tensors and losses, bit for bit."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from kstep import batch_of, carried, chain, first_feeds, one_step_runs, run_steps, session

    bundle = bundle_factory("cnn", 1, engines=("portable",), norm="batch")
    manifest = json.loads((bundle / "manifest.json").read_text())
    step = onnx.load(bundle / manifest["engines"]["portable"]["steps"]["full"]["model"])
    k = 3
    chained = chain(step, k)
    assert len(chained.graph.node) == k * len(step.graph.node) + 3  # K copies and one Split each for x, y and w
    feeds = first_feeds(bundle, step, k)
    got, _ = run_steps(session(chained, 1), feeds, 1)
    state, losses = one_step_runs(session(step, 1), feeds, batch_of(step), k)
    assert all(np.array_equal(got[f"loss{s}"], loss) for s, loss in enumerate(losses))
    new = carried(got)
    assert new and all(np.array_equal(value, state[name]) for name, value in new.items())
    # the tensors moved: the check compares trained values, not the initial ones passed through
    assert any(not np.array_equal(value, feeds[name]) for name, value in new.items())
