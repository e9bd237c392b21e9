// @ts-check
// The browser engine: onnxruntime-web sessions over a bundle's portable step graphs (mirrors
// device_runtime/portable_engine.py). `ort` is passed in, so the same code runs in the page (the wasm-only build,
// or the WebGPU build on a GPU) and under Node (tests, wasm only). Tensors are addressed by manifest name; state
// stays as ort.Tensor, on the GPU between WebGPU steps (read back only by getTensors: the upload and the save).

import { EngineError } from './errors.js';
import { FrozenVariants } from './frozen.js';
import { inputType, portableEntry, portableFiles, personalSpec, stepUpdates } from './manifest.js';
import { ModelState } from './modelstate.js';
import { decodeSafetensors } from './safetensors.js';
import { inChunks, predictWith } from './predict.js';
import { LAYOUTS, Sessions, inMemory, releaseTensor } from './sessions.js';
import { checkSha256 } from './sha256.js';
import { paddedTargets, targetSpec } from './targets.js';

/** @typedef {typeof import('onnxruntime-web')} Ort */
/** @typedef {import('onnxruntime-web').Tensor} OrtTensor */
/** @typedef {import('./safetensors.js').Tensors} Tensors */
/** @typedef {import('./manifest.js').TensorSpec} TensorSpec */
/** @typedef {import('./manifest.js').InputSpec} InputSpec */
/** @typedef {import('./manifest.js').ModelInput} ModelInput */
/** @typedef {import('./manifest.js').Graph} Graph */
/** @typedef {import('./manifest.js').PortableEntry} PortableEntry */
/** @typedef {import('./manifest.js').Manifest} Manifest */
/** @typedef {import('./sessions.js').Backend} Backend */
/** @typedef {import('./sessions.js').Placement} Placement */
/** @typedef {import('./sessions.js').Layout} Layout */
/** @typedef {import('./sessions.js').Opened} Opened */
/** @typedef {import('./sessions.js').SessionOptions} SessionOptions */
/** Summed loss, correct count and count of an evaluation. @typedef {{lossSum: number, correct: number, count: number}} EvalResult */

// the engine's API in one place for the page's modules: the error, the manifest's files and spec, the variants' count
export { EngineError } from './errors.js';
export { BAKE_AFTER_STEPS } from './frozen.js';
export { personalSpec, portableFiles } from './manifest.js';
export { softmax, topClasses } from './predict.js';

const ROLES = ['base', 'personal', 'buffer'];

/** @typedef {{dtype: 'int64', array: BigInt64ArrayConstructor, of: (n: number) => bigint} | {dtype: 'int32', array: Int32ArrayConstructor, of: (n: number) => number}} LabelType */
/** @type {Record<string, LabelType>} */
const LABEL_TYPES = {
  int64: { dtype: 'int64', array: BigInt64Array, of: BigInt },
  int32: { dtype: 'int32', array: Int32Array, of: Number },
};

/**
 * Open the portable graphs of a bundle. `files` maps bundle-relative paths to bytes and holds at least the
 * portable entry's graphs and `initial` tensors; each file the manifest lists a sha256 for is checked.
 * The steps' frozen variants in `files` are used unless `bakeFrozen` is false (see frozen.js).
 * `threads` > 1 needs a cross-origin isolated page (SharedArrayBuffer); it applies to the first engine
 * opened in a page, because onnxruntime-web starts its wasm runtime once. `backend` 'webgpu' (with `ort` the
 * WebGPU build) puts each graph that the GPU takes whole there (see Sessions.open); `onPlacement(path, placement)`
 * hears where each graph went when its session opens; `layout` is the WebGPU convolutions' ('NCHW', the page's;
 * 'NHWC' for measurements). `logSeverityLevel` 0 logs onnxruntime's node placements.
 * @param {Ort} ort
 * @param {Manifest} manifest
 * @param {Map<string, Uint8Array>} files
 * @param {{threads?: number, bakeFrozen?: boolean, backend?: Backend, layout?: Layout, onPlacement?: (path: string, placement: Placement) => void, logSeverityLevel?: 0 | 1 | 2 | 3 | 4}} [options]
 */
export async function openEngine(
  ort,
  manifest,
  files,
  { threads = 1, bakeFrozen = true, backend = 'wasm', layout = 'NCHW', onPlacement, logSeverityLevel } = {},
) {
  if (!['wasm', 'webgpu'].includes(backend))
    throw new EngineError(`unknown back end ${JSON.stringify(backend)}`, "use 'wasm' or 'webgpu'");
  if (!LAYOUTS.includes(layout))
    throw new EngineError(`unknown layout ${JSON.stringify(layout)}`, `use one of ${LAYOUTS.join(', ')}`);
  const { required, variants } = portableFiles(manifest);
  const present = bakeFrozen ? variants.filter((path) => files.has(path)) : [];
  const file = (/** @type {string} */ path) => {
    const bytes = files.get(path);
    if (!bytes)
      throw new EngineError(`bundle file ${path} was not loaded`, 'download every file of manifest.engines.portable');
    return bytes;
  };
  for (const path of [...required, ...present]) {
    const expected = manifest.files && manifest.files[path];
    const bytes = file(path);
    if (expected) await checkSha256(bytes, expected, `bundle file ${path}`);
  }
  ort.env.wasm.numThreads = Math.max(1, Math.floor(threads));
  const entry = portableEntry(manifest);
  const graphs = new Map(required.slice(1).map((path) => [path, file(path)]));
  const frozen = new Map(present.map((path) => [path, file(path)]));
  const engine = new Engine(ort, manifest, entry, graphs, frozen, { backend, layout, onPlacement, logSeverityLevel });
  engine.setTensors(decodeSafetensors(file(entry.initial), entry.initial).tensors, { exact: true });
  return engine;
}

/** The portable graphs of one bundle in onnxruntime-web sessions, with the model's state (every param and buffer). */
export class Engine {
  /**
   * @param {Ort} ort
   * @param {Manifest} manifest
   * @param {PortableEntry} entry
   * @param {Map<string, Uint8Array>} graphs
   * @param {Map<string, Uint8Array>} variants
   * @param {SessionOptions} [options]
   */
  constructor(ort, manifest, entry, graphs, variants, options = {}) {
    this.ort = ort;
    this.manifest = manifest;
    this.entry = entry;
    this.sessions = new Sessions(ort, graphs, options);
    this.frozen = new FrozenVariants(variants, this.sessions);
    this.batchSize = Number(entry.batch_size);
    // one sample: (C, H, W) pixels, (C, T) sensor values or (T) token ids, of the manifest's input dtype
    this.sampleShape = manifest.input.shape.slice();
    this.sampleSize = this.sampleShape.reduce((size, dim) => size * dim, 1);
    this.inputType = inputType(manifest.input);
    // one sample's targets: one label, or a next token at each position (targets.js)
    this.targets = targetSpec(manifest);
    this.targetSize = this.targets.size;
    // graph inputs and outputs list the state tensors in this order: params, then buffers
    this.stateNames = [...entry.params, ...entry.buffers];
    this.model = new ModelState(ort, manifest, this.stateNames);
    const labels = LABEL_TYPES[entry.label_dtype || 'int64']; // int32 since the graphs run on WebGPU
    if (!labels)
      throw new EngineError(
        `the bundle's labels are ${entry.label_dtype}`,
        're-export the bundle with this edgepfl version',
      );
    this.labelType = labels;
  }

  /** The model's tensors by name (ort.Tensor, some on the GPU). */
  get state() {
    return this.model.tensors;
  }

  /** Where the engine runs its graphs. */
  get backend() {
    return this.sessions.backend;
  }

  /** Graph path -> where each opened graph runs. */
  get placements() {
    return this.sessions.placements;
  }

  /** Steps run on a frozen variant, for tests and benchmarks. */
  get variantSteps() {
    return this.frozen.steps;
  }

  /** The manifest's entry of a tensor; a name it does not list throws. */
  spec(/** @type {string} */ name) {
    return this.model.spec(name);
  }

  /** Tensor names of one manifest role ('base' | 'personal' | 'buffer'), in manifest order. */
  namesByRole(/** @type {string} */ role) {
    if (!ROLES.includes(role))
      throw new EngineError(`unknown tensor role ${JSON.stringify(role)}`, `use one of ${ROLES.join(', ')}`);
    return this.manifest.tensors.filter((t) => t.role === role).map((t) => t.name);
  }

  /** Trainable sets this bundle has, like Engine.available_sets: kp=0 has no 'personal', kp=max no 'base'. */
  trainableSets() {
    const hasBase = this.namesByRole('base').length > 0;
    const hasPersonal = this.namesByRole('personal').length > 0;
    return [
      ...(hasBase || hasPersonal ? ['full'] : []),
      ...(hasPersonal ? ['personal'] : []),
      ...(hasBase ? ['base'] : []),
    ];
  }

  /**
   * Copies of the named tensors (all params and buffers by default) as {name: {dtype, shape, data}}; of a
   * `snapshot()` when given. A tensor on the GPU is read back and stays in memory from then on (the next WebGPU
   * step uploads it once).
   * @param {readonly string[]} [names]
   * @param {Map<string, OrtTensor>} [state]
   * @returns {Promise<Tensors>}
   */
  getTensors(names = this.stateNames, state = this.state) {
    return this.model.get(names, state);
  }

  /** Overwrite the named tensors; names, shapes, dtypes and finite values are checked against the manifest. */
  setTensors(/** @type {Tensors} */ tensors, { exact = false } = {}) {
    this.model.set(tensors, { exact });
  }

  /** One SGD step on `count` <= batchSize samples of x (float32 NCHW) and y; a short batch is padded and masked. */
  async trainStep(
    /** @type {ModelInput} */ x,
    /** @type {Int32Array | BigInt64Array} */ y,
    /** @type {number} */ count,
    /** @type {number} */ lr,
    trainable = 'full',
  ) {
    if (!(Number.isFinite(lr) && lr > 0))
      throw new EngineError(`learning rate ${lr} is not a positive number`, 'the round settings must give lr > 0');
    const results = await this.runStep(x, y, count, lr, trainable);
    for (const [name, tensor] of results.state) this.model.replace(name, tensor);
    return results.loss;
  }

  /** A training-mode pass that moves the BatchNorm running statistics and no weight (engine.py statistics_step). */
  async statisticsStep(
    /** @type {ModelInput} */ x,
    /** @type {Int32Array | BigInt64Array} */ y,
    /** @type {number} */ count,
  ) {
    const sets = this.trainableSets(); // the cheapest set whose step runs the whole forward (engine.py statistics_set)
    const results = await this.runStep(x, y, count, 0, sets.includes('personal') ? 'personal' : sets[0]);
    const buffers = new Set(this.entry.buffers);
    for (const [name, tensor] of results.state) {
      if (buffers.has(name)) this.model.replace(name, tensor);
      else releaseTensor(tensor);
    }
  }

  /**
   * Each BatchNorm running statistic's momentum by tensor name (engine.py statistics_momenta).
   * @returns {Record<string, number>}
   */
  statisticsMomenta() {
    const names = this.manifest.tensors
      .filter((t) => t.role === 'buffer' && /\.running_(mean|var)$/.test(t.name))
      .map((t) => t.name);
    const momentum = this.entry.bn_momentum ?? 0.1;
    if (Array.isArray(momentum))
      throw new EngineError(
        'the bundle lists its BatchNorm momenta without their layers (an older export)',
        're-export the bundle with this edgepfl version',
      );
    return Object.fromEntries(
      names.map((name) => [name, Number(typeof momentum === 'object' ? momentum[name] : momentum)]),
    );
  }

  /**
   * Run one step graph on the current state; returns the loss and the new state by tensor name. A step with a
   * frozen variant leaves out its frozen tensors (they pass through unchanged: the graph has no outputs for them, or
   * in older bundles copies, not fetched), so that the state keeps the very same tensor objects and the next step
   * can tell they did not change (portable_engine.py _run_step).
   * @param {ModelInput} x
   * @param {Int32Array | BigInt64Array} y
   * @param {number} count
   * @param {number} lr
   * @param {string} trainable
   * @returns {Promise<{loss: number, state: Map<string, OrtTensor>}>}
   */
  async runStep(x, y, count, lr, trainable) {
    this.checkSet(trainable);
    this.checkBatch(x, y, count);
    if (count > this.batchSize) {
      throw new EngineError(
        `a batch of ${count} samples exceeds the portable graphs' batch size ${this.batchSize}`,
        `train with batches of at most ${this.batchSize}`,
      );
    }
    const key = `step_${trainable}`;
    const graph = this.entry.steps[trainable];
    const n = this.stateNames.length;
    const byInput = new Map(graph.inputs.slice(0, n).map((input, i) => [input, this.stateNames[i]]));
    const byOutput = stepUpdates(graph, this.stateNames);
    const stateOf = (/** @type {Map<string, string>} */ by, /** @type {string} */ name) =>
      /** @type {string} */ (by.get(name));
    // the frozen tensors stay as they are (a plain graph's copies of them are not fetched), with or without a variant
    const kept = new Set(graph.frozen ? graph.frozen.initializers.map((input) => stateOf(byInput, input)) : []);
    const frozen = graph.frozen && this.frozen.has(graph.frozen) ? graph.frozen : null;
    const values = frozen ? [...kept].map((name) => /** @type {OrtTensor} */ (this.state.get(name))) : [];
    const baked = frozen && (await this.frozen.session(key, frozen, values));
    const [opened, inputs, outputs] =
      baked && frozen
        ? [baked, frozen.inputs, frozen.outputs]
        : [await this.session(key, graph), graph.inputs, graph.outputs];
    const stateInputs = inputs.filter((input) => byInput.has(input));
    const batchInputs = inputs.slice(stateInputs.length);
    const { feeds } = await this.feeds(
      opened,
      stateInputs.map((input) => [input, stateOf(byInput, input)]),
      batchInputs,
      x,
      y,
      0,
      count,
    );
    feeds[batchInputs[3]] = new this.ort.Tensor('float32', Float32Array.of(lr), []);
    const fetched = outputs.filter((output, i) => i === 0 || !kept.has(stateOf(byOutput, output)));
    const results = await opened.session.run(feeds, fetched);
    if (frozen) this.frozen.ran(key, values, Boolean(baked));
    return {
      loss: Number(results[outputs[0]].data[0]),
      state: new Map(fetched.slice(1).map((output) => [stateOf(byOutput, output), results[output]])),
    };
  }

  /**
   * Summed loss and correct count of the current model over any number of samples (run in graph-sized chunks).
   * @param {ModelInput} x
   * @param {Int32Array | BigInt64Array} y
   * @param {number} count
   * @returns {Promise<EvalResult>}
   */
  async evaluate(x, y, count) {
    this.checkBatch(x, y, count);
    const graph = this.entry.eval;
    let lossSum = 0;
    let correct = 0;
    let scored = 0;
    const chunks = inChunks(this, 'eval', graph, x, y, count, graph.outputs.slice(1), this.state, true);
    for await (const { weights, results } of chunks) {
      // the graph's loss is the mean over the targets the metric counts
      if (weights) lossSum += Number(results[graph.outputs[1]].data[0]) * weights;
      correct += Number(results[graph.outputs[2]].data[0]);
      scored += weights;
    }
    return { lossSum, correct, count: scored };
  }

  /**
   * Class probabilities (count x classes, float32, row by row) of the model on `count` pre-processed inputs, in
   * inference mode: the eval graph's logits, softmax in float64 (engine.py predict). `held` (a `snapshot()`)
   * predicts with the tensors held then instead of the current ones, e.g. while a round trains.
   * @param {ModelInput} x
   * @param {number} count
   * @param {Map<string, OrtTensor>} [held]
   * @returns {Promise<Float32Array>}
   */
  predict(x, count, held = this.state) {
    return predictWith(this, x, count, held);
  }

  /** Open the session that predicts one input now, so that the first prediction does not wait for it. */
  async preparePredict() {
    const key = this.predictGraph(1);
    await this.session(key, /** @type {Graph} */ (this.entry[key]));
  }

  /**
   * The graph that predicts `count` inputs: the one-sample predict graph for up to its manifest's `up_to` (none in
   * a bundle exported before it), else the eval graph's padded batches (portable_engine.py predict_graph).
   * @param {number} count
   * @returns {'predict' | 'eval'}
   */
  predictGraph(count) {
    return count <= (this.entry.predict?.up_to ?? 0) ? 'predict' : 'eval';
  }

  /**
   * The model's tensors as they are now, kept aside (no copy: a step replaces tensors, never writes into them).
   * Those on the GPU are read back first: a later step gives the GPU buffers of the tensors it replaces back.
   * @returns {Promise<Map<string, OrtTensor>>}
   */
  snapshot() {
    return this.model.snapshot();
  }

  /** Free the sessions' memory and the state's GPU buffers; the engine cannot be used afterwards. */
  async release() {
    await this.sessions.release();
    await this.frozen.release();
    this.model.release();
  }

  checkSet(/** @type {string} */ trainable) {
    if (!this.trainableSets().includes(trainable)) {
      throw new EngineError(
        `this bundle (personal ${personalSpec(this.manifest)}) has no ${JSON.stringify(trainable)} trainable set`,
        `choose one of: ${this.trainableSets().join(', ')}`,
      );
    }
  }

  checkBatch(/** @type {ModelInput} */ x, /** @type {Int32Array | BigInt64Array} */ y, /** @type {number} */ count) {
    if (!Number.isInteger(count) || count < 1)
      throw new EngineError(`batch count ${count} is not a positive integer`, 'pass at least one sample');
    if (!(x instanceof this.inputType.array) || x.length !== count * this.sampleSize) {
      const given = x instanceof this.inputType.array ? `${x.length} values` : `a ${x && x.constructor.name}`;
      throw new EngineError(
        `inputs hold ${given} for ${count} samples of [${this.sampleShape}] ${this.inputType.dtype}`,
        `pass a ${this.inputType.array.name} of ${count} x ${this.sampleSize} pre-processed values`,
      );
    }
    if (!(y instanceof Int32Array || y instanceof BigInt64Array) || y.length !== count * this.targetSize) {
      throw new EngineError(
        `labels are not an Int32Array or BigInt64Array of ${count * this.targetSize}`,
        this.targetSize === 1 ? 'pass one label per input' : `pass ${this.targetSize} next tokens per input`,
      );
    }
    const classes = this.manifest.num_classes;
    for (let i = 0; i < y.length; i++) {
      const label = Number(y[i]);
      if (!(label >= 0 && label < classes))
        throw new EngineError(
          `label ${label} is not a class of this model (0..${classes - 1})`,
          'relabel the examples',
        );
    }
  }

  /**
   * Feeds of one graph batch for the `opened` session: the state tensors by [input, name] pairs (a wasm session
   * gets those on the GPU read back first), and x, y, w (the first three of `batchInputs`) holding `count` real
   * samples from `start`, zero-padded to `size` (the step graphs' batch by default), each target weighed as the
   * loss (`scoring`: the metric) counts it and padding 0; `weights` is their sum.
   * @param {Opened} opened
   * @param {[string, string][]} stateInputs
   * @param {string[]} batchInputs
   * @param {ModelInput} x
   * @param {Int32Array | BigInt64Array} y
   * @param {number} start
   * @param {number} count
   * @param {{state?: Map<string, OrtTensor>, size?: number, scoring?: boolean}} [options] the tensors to feed (the
   * current ones by default), the batch size (the step graphs') and whether targets are weighed as the metric counts
   * @returns {Promise<{feeds: Record<string, OrtTensor>, weights: number}>}
   */
  async feeds(opened, stateInputs, batchInputs, x, y, start, count, options = {}) {
    const { state = this.state, size = this.batchSize, scoring = false } = options;
    /** @type {Record<string, OrtTensor>} */
    const feeds = {};
    for (const [input, name] of stateInputs) {
      const t = /** @type {OrtTensor} */ (state.get(name));
      feeds[input] = opened.backend === 'webgpu' ? t : await inMemory(t);
    }
    const bx = new this.inputType.array(size * this.sampleSize); // padding: zeros (<pad> for token ids)
    bx.set(/** @type {any} */ (x).subarray(start * this.sampleSize, (start + count) * this.sampleSize));
    const labels = this.labelType;
    const { by, bw, weights, shape } = paddedTargets(this.targets, labels, y, start, count, size, scoring);
    feeds[batchInputs[0]] = new this.ort.Tensor(
      /** @type {'float32'} */ (this.inputType.dtype),
      /** @type {Float32Array} */ (bx),
      [size, ...this.sampleShape],
    );
    if (batchInputs.length > 1) {
      // a predict graph that reads the last position itself takes the inputs only (export/lastposition.py)
      feeds[batchInputs[1]] = new this.ort.Tensor(labels.dtype, /** @type {Int32Array} */ (by), shape);
      feeds[batchInputs[2]] = new this.ort.Tensor('float32', bw, shape);
    }
    return { feeds, weights };
  }

  /** The session of `graph` (a manifest graph entry), opened on first use. */
  session(/** @type {string} */ key, /** @type {Graph} */ graph) {
    return this.sessions.session(key, graph);
  }
}
