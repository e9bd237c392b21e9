"""A next-word model's output-layer products in the page's WebAssembly against the native engine, one thread each.

Issue 53 asks the page's text step to run at >= 0.5 of the native engine's speed at one thread; it runs at about 0.3
(docs/text-models.md). Most of a next-word step is three matrix products of the output layer and the blocks' linear
layers: the forward `X·Wᵀ`, the input's gradient `dY·W` and the weight's gradient `dYᵀ·X`. This times each as a
one-node ONNX graph (Gemm, as the step graphs have them) at a bundle's shapes: in native onnxruntime (MLAS, this
machine's AVX2/AVX-512 kernels) and in onnxruntime-web's WebAssembly build under Node (128-bit SIMD), both at one
thread, the same inputs. Their ratio bounds the whole step's: a step whose products run at that ratio cannot run much
above it.

Shapes (rows = batch x seq_len positions, d the model width, V the vocabulary): `page` is the page benchmark's text
bundle (transformer x0.25: d 64, 2,004 words, batch 32 x 20 positions), `fedalt` FedAlt's StackOverflow transformer
(d 256, 10,004 words), and each one's feed-forward product (d x 4d).

Prints JSON and writes it to --out (default: nothing written). Needs `npm ci` in device_runtime/web (onnxruntime-web).
Usage: python bench/wasm_gemm.py [--repeats 20] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "device_runtime" / "web"
# name: (rows, inner, outer) of the forward product X (rows x inner) · Wᵀ (outer x inner)
SHAPES = {
    "page output layer": (640, 64, 2004),
    "page feed-forward": (640, 64, 256),
    "fedalt output layer": (640, 256, 10004),
    "fedalt feed-forward": (640, 256, 1024),
}
# the three products of a linear layer as Gemm attributes: (A's shape, B's shape, transA, transB)
PRODUCTS = {
    "forward X·Wᵀ": lambda r, i, o: ((r, i), (o, i), 0, 1),
    "input grad dY·W": lambda r, i, o: ((r, o), (o, i), 0, 0),
    "weight grad dYᵀ·X": lambda r, i, o: ((r, o), (r, i), 1, 0),
}
NODE_TIMER = """
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
const ort = createRequire(process.argv[3])('onnxruntime-web'); // resolved from device_runtime/web, its node build
ort.env.wasm.numThreads = 1;
const cases = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const out = {};
for (const c of cases) {
  const session = await ort.InferenceSession.create(readFileSync(c.model), { executionProviders: ['wasm'] });
  const feeds = {
    a: new ort.Tensor('float32', new Float32Array(readFileSync(c.a).buffer.slice(0)), c.shapeA),
    b: new ort.Tensor('float32', new Float32Array(readFileSync(c.b).buffer.slice(0)), c.shapeB),
  };
  for (let i = 0; i < 3; i++) await session.run(feeds);
  const times = [];
  for (let i = 0; i < c.repeats; i++) {
    const start = performance.now();
    await session.run(feeds);
    times.push((performance.now() - start) / 1000);
  }
  times.sort((x, y) => x - y);
  out[c.name] = times[Math.floor(times.length / 2)];
  await session.release();
}
console.log(JSON.stringify(out));
"""


def gemm_model(shape_a: tuple[int, int], shape_b: tuple[int, int], trans_a: int, trans_b: int) -> bytes:
    """A one-node graph: y = Gemm(a, b) with the given transposes."""
    import onnx
    from onnx import TensorProto, helper

    rows = shape_a[1] if trans_a else shape_a[0]
    cols = shape_b[0] if trans_b else shape_b[1]
    node = helper.make_node("Gemm", ["a", "b"], ["y"], transA=trans_a, transB=trans_b)
    graph = helper.make_graph(
        [node],
        "gemm",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, list(shape_a)),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, list(shape_b)),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, cols])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def native_seconds(model: Path, a: np.ndarray, b: np.ndarray, repeats: int) -> float:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    feeds = {"a": a, "b": b}
    for _ in range(3):
        session.run(None, feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cases = []
        for shape_name, dims in SHAPES.items():
            for product, make in PRODUCTS.items():
                shape_a, shape_b, trans_a, trans_b = make(*dims)
                name = f"{shape_name}: {product}"
                stem = folder / f"case{len(cases)}"
                model = stem.with_suffix(".onnx")
                model.write_bytes(gemm_model(shape_a, shape_b, trans_a, trans_b))
                a = rng.standard_normal(shape_a, dtype=np.float32)
                b = rng.standard_normal(shape_b, dtype=np.float32)
                a.tofile(f"{stem}-a.bin")
                b.tofile(f"{stem}-b.bin")
                flops = 2 * dims[0] * dims[1] * dims[2]
                native = native_seconds(model, a, b, args.repeats)
                rows.append({"case": name, "gflop": flops / 1e9, "native_s": native})
                cases.append(
                    {
                        "name": name,
                        "model": str(model),
                        "a": f"{stem}-a.bin",
                        "b": f"{stem}-b.bin",
                        "shapeA": list(shape_a),
                        "shapeB": list(shape_b),
                        "repeats": args.repeats,
                    }
                )
        (folder / "cases.json").write_text(json.dumps(cases))
        script = folder / "timer.mjs"
        script.write_text(NODE_TIMER)
        command = ["node", str(script), str(folder / "cases.json"), str(WEB / "package.json")]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        wasm = json.loads(done.stdout.strip().splitlines()[-1])
    for row in rows:
        row["wasm_s"] = wasm[row["case"]]
        row["native_gflops"] = round(row["gflop"] / row["native_s"], 2)
        row["wasm_gflops"] = round(row["gflop"] / row["wasm_s"], 2)
        row["wasm_over_native"] = round(row["native_s"] / row["wasm_s"], 3)
    by_shape = {}
    for shape_name in SHAPES:
        mine = [r for r in rows if r["case"].startswith(shape_name + ":")]
        by_shape[shape_name] = round(sum(r["native_s"] for r in mine) / sum(r["wasm_s"] for r in mine), 3)
    report = {
        "what": "one-node Gemm graphs, native onnxruntime vs onnxruntime-web wasm under Node, 1 thread each",
        "machine": platform.processor() or platform.machine(),
        "repeats": args.repeats,
        "products": rows,
        "wasm_over_native_by_layer": by_shape,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
