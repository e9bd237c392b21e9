// @ts-check
// What the model says of inputs (edgepfl's predict.py and engine.py predict): class probabilities in inference
// mode, the softmax of the eval graph's logits in float64, and the most likely classes; and a graph run over any
// number of inputs in chunks of its batch (the eval graph's loss and correct count too).

/** @typedef {import('onnxruntime-web').Tensor} OrtTensor */
/** @typedef {import('./engine.js').Engine} Engine */
/** @typedef {import('./manifest.js').Graph} Graph */
/** @typedef {import('./manifest.js').ModelInput} ModelInput */

/**
 * Class probabilities (count x classes, float32, row by row) of `engine`'s model on `count` pre-processed inputs,
 * with the tensors `held` (a snapshot, or the current ones): Engine.predict.
 * @param {Engine} engine
 * @param {ModelInput} x
 * @param {number} count
 * @param {Map<string, OrtTensor>} held
 */
export async function predictWith(engine, x, count, held) {
  const y = new Int32Array(count * engine.targetSize);
  engine.checkBatch(x, y, count);
  const key = engine.predictGraph(count);
  const graph = /** @type {Graph} */ (engine.entry[key]);
  const classes = engine.manifest.num_classes;
  const probabilities = new Float32Array(count * classes);
  for await (const { start, chunk, results } of inChunks(engine, key, graph, x, y, count, [graph.outputs[0]], held)) {
    const output = results[graph.outputs[0]];
    const logits = /** @type {Float32Array} */ (output.data);
    const everyPosition = output.dims.length > 2; // a predict graph reads the last position itself (export/lastposition.py)
    for (let row = 0; row < chunk; row++) {
      const at = everyPosition ? (row * engine.targetSize + readAt(engine, x, start + row)) * classes : row * classes;
      probabilities.set(softmax(logits.subarray(at, at + classes)), (start + row) * classes);
    }
  }
  return probabilities;
}

/**
 * Which of a sample's positions a prediction reads: 0 for a model with one output a sample; for one with an output
 * at every position (a next-word model), the last input id that is not <pad> (0) of the right-padded phrase
 * (edgepfl/text.py last_positions).
 * @param {Engine} engine
 * @param {ModelInput} x
 * @param {number} sample
 */
function readAt(engine, x, sample) {
  if (engine.targetSize === 1) return 0;
  const size = engine.sampleSize;
  for (let t = size - 1; t > 0; t--) if (Number(x[sample * size + t]) !== 0) return t;
  return 0;
}

/**
 * `graph` (opened as `key`) run over `count` samples of x, y in chunks of its batch (the manifest's `batch_size`
 * for the graph, else the step graphs'), fed the tensors `held` (the current ones by default): each chunk's first
 * sample, its number of samples, the sum of its targets' weights (`scoring`: as the metric counts them) and the
 * results of `outputs` (Engine.evaluate, predictWith).
 * @param {Engine} engine
 * @param {string} key
 * @param {Graph} graph
 * @param {ModelInput} x
 * @param {Int32Array | BigInt64Array} y
 * @param {number} count
 * @param {string[]} outputs
 * @param {Map<string, OrtTensor>} [held]
 * @param {boolean} [scoring]
 * @returns {AsyncGenerator<{start: number, chunk: number, weights: number, results: Record<string, OrtTensor>}>}
 */
export async function* inChunks(engine, key, graph, x, y, count, outputs, held = engine.state, scoring = false) {
  const size = graph.batch_size ?? engine.batchSize;
  const opened = await engine.session(key, graph);
  const n = engine.stateNames.length;
  const stateInputs = graph.inputs
    .slice(0, n)
    .map((input, i) => /** @type {[string, string]} */ ([input, engine.stateNames[i]]));
  for (let start = 0; start < count; start += size) {
    const chunk = Math.min(size, count - start);
    const batch = graph.inputs.slice(n);
    const options = { state: held, size, scoring };
    const { feeds, weights } = await engine.feeds(opened, stateInputs, batch, x, y, start, chunk, options);
    yield { start, chunk, weights, results: await opened.session.run(feeds, outputs) };
  }
}

/** Softmax of one row of logits, computed in float64 and rounded to float32 (engine.py softmax). */
export function softmax(/** @type {ArrayLike<number>} */ logits) {
  let max = -Infinity;
  for (let i = 0; i < logits.length; i++) max = Math.max(max, logits[i]);
  const exponentials = Float64Array.from(logits, (v) => Math.exp(v - max));
  const total = exponentials.reduce((sum, v) => sum + v, 0);
  return Float32Array.from(exponentials, (v) => v / total);
}

/**
 * The `k` most likely classes of one row of probabilities, most likely first; ties: the lower class first
 * (predict.py top_classes).
 * @param {ArrayLike<number>} probabilities
 * @param {string[]} names the classes' names (classNames(manifest))
 * @param {number} k
 * @returns {{index: number, name: string, probability: number}[]}
 */
export function topClasses(probabilities, names, k) {
  const order = Array.from({ length: probabilities.length }, (_, i) => i).sort(
    (a, b) => probabilities[b] - probabilities[a] || a - b,
  );
  return order
    .slice(0, Math.min(k, order.length))
    .map((index) => ({ index, name: names[index], probability: probabilities[index] }));
}
