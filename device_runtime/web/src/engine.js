// @ts-check
// The browser engine: onnxruntime-web sessions over a bundle's portable step graphs (mirrors
// device_runtime/portable_engine.py). `ort` is passed in, so the same code runs in the page (the wasm-only build,
// or the WebGPU build on a GPU) and under Node (tests, wasm only). Tensors are addressed by manifest name; state
// stays as ort.Tensor, on the GPU between WebGPU steps (read back only by getTensors: the upload and the save).

import { concat } from './bytes.js';
import { DeviceError, describe } from './errors.js';
import { decodeSafetensors, numel, typedArrayOf } from './safetensors.js';
import { checkSha256 } from './sha256.js';

/** @typedef {typeof import('onnxruntime-web')} Ort */
/** @typedef {import('onnxruntime-web').Tensor} OrtTensor */
/** @typedef {import('onnxruntime-web').InferenceSession} Session */
/** @typedef {import('./safetensors.js').Tensor} Tensor */
/** @typedef {import('./safetensors.js').Tensors} Tensors */
/** One tensor of manifest.json: its role and block (the split) and its shape and dtype. @typedef {{name: string, role: string, block: number, shape: number[], dtype: string}} TensorSpec */
/** The model input (manifest.json `input`). @typedef {{shape: number[], mean: number[], std: number[], layout?: string, dtype?: string}} InputSpec */
/** A batch of model inputs: float32 pixels or sensor values, or int64 token ids (a text bundle). @typedef {Float32Array | BigInt64Array} ModelInput */
/** A step's frozen variant (export/frozen.py); webgpu_problems: why WebGPU cannot run it whole (export/webgpu.py). @typedef {{model: string, data_location: string, inputs: string[], outputs: string[], initializers: string[], webgpu_problems?: string[]}} FrozenVariant */
/** One graph of the portable engine: state inputs, then x, y, w (and lr); loss, then the new state (batch_size: the predict graph's 1, up_to: how many inputs it takes one by one). @typedef {{model: string, inputs: string[], outputs: string[], frozen?: FrozenVariant, webgpu_problems?: string[], batch_size?: number, up_to?: number}} Graph */
/**
 * manifest.json `engines.portable`.
 * @typedef {object} PortableEntry
 * @property {number} batch_size
 * @property {string[]} params
 * @property {string[]} buffers
 * @property {Record<string, Graph>} steps
 * @property {Graph} eval
 * @property {Graph} [predict] the eval graph for one sample (bundles exported since it exists)
 * @property {string} initial
 * @property {'int32' | 'int64'} [label_dtype] the labels' type (int64 before the graphs ran on WebGPU)
 * @property {number | Record<string, number> | number[]} [bn_momentum]
 */
/**
 * The parts of manifest.json the page reads.
 * @typedef {object} Manifest
 * @property {number} kp the trailing blocks whose parameters are all personal (output:K's K)
 * @property {string} [personal] the --personal spec (bundles exported before it have none: output:kp)
 * @property {{index: number}[]} blocks
 * @property {TensorSpec[]} tensors
 * @property {number} num_classes
 * @property {string[]} [class_names] the classes' names, in class order (edgepfl export --class-names)
 * @property {InputSpec} input
 * @property {string} base_layout_hash
 * @property {Record<string, string>} [files] bundle path -> sha256
 * @property {{portable?: PortableEntry}} [engines]
 */
/** Where the engine runs its graphs. @typedef {'wasm' | 'webgpu'} Backend */
/** Where one graph runs, and why not on the GPU when the back end is WebGPU. @typedef {{backend: Backend, reason?: string}} Placement */
/** An opened session and where it runs. @typedef {{session: Session, backend: Backend}} Opened */
/** Summed loss, correct count and count of an evaluation. @typedef {{lossSum: number, correct: number, count: number}} EvalResult */

const ROLES = ['base', 'personal', 'buffer'];

/** The bundle's personal spec as manifest.py writes it: its `personal`, or output:kp for bundles before specs. */
export function personalSpec(/** @type {Pick<Manifest, 'kp' | 'personal'>} */ manifest) {
  return manifest.personal || `output:${manifest.kp}`;
}
/** @type {import('onnxruntime-web').InferenceSession.SessionOptions} */
const WASM_OPTIONS = { executionProviders: ['wasm'], graphOptimizationLevel: 'all' };
// NCHW: onnxruntime-web 1.30's channels-last (NHWC) Conv computes wrong values where the input channels are a
// multiple of 3 but not of 4 (6 or 18; 3 itself is right), e.g. the cnn's second convolution (docs/web-device.md)
const WEBGPU_PROVIDER = { name: 'webgpu', preferredLayout: 'NCHW' };
/** @typedef {{dtype: 'int64', array: BigInt64ArrayConstructor, of: (n: number) => bigint} | {dtype: 'int32', array: Int32ArrayConstructor, of: (n: number) => number}} LabelType */
/** @type {Record<string, LabelType>} */
const LABEL_TYPES = { int64: { dtype: 'int64', array: BigInt64Array, of: BigInt }, int32: { dtype: 'int32', array: Int32Array, of: Number } };

/** A problem of the bundle, the model or its inputs, with the fix. */
export class EngineError extends DeviceError {}

/** Plain steps on the same frozen tensors before a step's frozen variant is built (portable_engine.py BAKE_AFTER_STEPS). */
export const BAKE_AFTER_STEPS = 2;

/**
 * The bundle paths of the portable engine (Manifest.portable_files): `required`, its initial tensors, eval and step
 * graphs; `variants`, the steps' frozen variants (export/frozen.py), which an engine uses where it has them.
 */
export function portableFiles(/** @type {Manifest} */ manifest) {
  const entry = portableEntry(manifest);
  const steps = Object.values(entry.steps);
  return {
    required: [entry.initial, entry.eval.model, ...(entry.predict ? [entry.predict.model] : []), ...steps.map((step) => step.model)],
    variants: steps.flatMap((step) => (step.frozen && step.frozen.data_location ? [step.frozen.model] : [])),
  };
}

/**
 * Open the portable graphs of a bundle. `files` maps bundle-relative paths to bytes and holds at least the
 * portable entry's graphs and `initial` tensors; each file the manifest lists a sha256 for is checked.
 * The steps' frozen variants in `files` are used unless `bakeFrozen` is false (see Engine.bakedSession).
 * `threads` > 1 needs a cross-origin isolated page (SharedArrayBuffer); it applies to the first engine
 * opened in a page, because onnxruntime-web starts its wasm runtime once. `backend` 'webgpu' (with `ort` the
 * WebGPU build) puts each graph that the GPU takes whole there (see openSession); `onPlacement(path, placement)`
 * hears where each graph went when its session opens. `logSeverityLevel` 0 logs onnxruntime's node placements.
 * @param {Ort} ort
 * @param {Manifest} manifest
 * @param {Map<string, Uint8Array>} files
 * @param {{threads?: number, bakeFrozen?: boolean, backend?: Backend, onPlacement?: (path: string, placement: Placement) => void, logSeverityLevel?: 0 | 1 | 2 | 3 | 4}} [options]
 */
export async function openEngine(ort, manifest, files, { threads = 1, bakeFrozen = true, backend = 'wasm', onPlacement, logSeverityLevel } = {}) {
  if (!['wasm', 'webgpu'].includes(backend)) throw new EngineError(`unknown back end ${JSON.stringify(backend)}`, "use 'wasm' or 'webgpu'");
  const { required, variants } = portableFiles(manifest);
  const present = bakeFrozen ? variants.filter((path) => files.has(path)) : [];
  const file = (/** @type {string} */ path) => {
    const bytes = files.get(path);
    if (!bytes) throw new EngineError(`bundle file ${path} was not loaded`, 'download every file of manifest.engines.portable');
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
  const engine = new Engine(ort, manifest, entry, graphs, new Map(present.map((path) => [path, file(path)])));
  Object.assign(engine, { backend, onPlacement, logSeverityLevel });
  engine.setTensors(decodeSafetensors(file(entry.initial), entry.initial).tensors, { exact: true });
  return engine;
}

/** The manifest's portable engine entry; a bundle without one throws. */
function portableEntry(/** @type {Manifest} */ manifest) {
  const entry = manifest.engines && manifest.engines.portable;
  if (!entry) throw new EngineError('the bundle has no portable graphs', 'ask the operator to export it with --engines portable');
  return entry;
}

/** The portable graphs of one bundle in onnxruntime-web sessions, with the model's state (every param and buffer). */
export class Engine {
  /**
   * @param {Ort} ort
   * @param {Manifest} manifest
   * @param {PortableEntry} entry
   * @param {Map<string, Uint8Array>} graphs
   * @param {Map<string, Uint8Array>} variants
   */
  constructor(ort, manifest, entry, graphs, variants) {
    this.ort = ort;
    this.manifest = manifest;
    this.entry = entry;
    this.graphs = graphs; // bytes of graphs without a session yet; dropped once their session exists
    this.variants = variants; // bytes of the frozen variants, kept: one is rebuilt whenever its frozen tensors change
    /** @type {Map<string, {values: OrtTensor[], steps: number}>} step key -> plain steps run on these frozen tensors */
    this.plainOn = new Map();
    /** @type {Map<string, {opened: Opened, values: OrtTensor[]}>} step key -> the variant built on these frozen tensors */
    this.baked = new Map();
    this.variantSteps = 0; // steps run on a frozen variant, for tests and benchmarks
    this.batchSize = Number(entry.batch_size);
    // one sample: (C, H, W) pixels, (C, T) sensor values or (T) token ids, of the manifest's input dtype
    this.sampleShape = manifest.input.shape.slice();
    this.sampleSize = this.sampleShape.reduce((size, dim) => size * dim, 1);
    this.inputType = inputType(manifest.input);
    // graph inputs and outputs list the state tensors in this order: params, then buffers
    this.stateNames = [...entry.params, ...entry.buffers];
    this.specs = new Map(manifest.tensors.map((t) => [t.name, t]));
    /** @type {Map<string, OrtTensor>} */
    this.state = new Map();
    /** @type {Set<OrtTensor>} tensors a snapshot is reading back from the GPU: not given back when replaced */
    this.pinned = new Set();
    /** @type {Map<string, Promise<Opened>>} */
    this.sessions = new Map();
    /** @type {Map<string, Placement>} graph path -> where each opened graph runs */
    this.placements = new Map();
    /** @type {Backend} */
    this.backend = 'wasm';
    /** @type {((path: string, placement: Placement) => void) | undefined} */
    this.onPlacement = undefined;
    /** @type {0 | 1 | 2 | 3 | 4 | undefined} */
    this.logSeverityLevel = undefined;
    const labels = LABEL_TYPES[entry.label_dtype || 'int64']; // int32 since the graphs run on WebGPU
    if (!labels) throw new EngineError(`the bundle's labels are ${entry.label_dtype}`, 're-export the bundle with this edgepfl version');
    this.labelType = labels;
  }

  /** The manifest's entry of a tensor; a name it does not list throws. */
  spec(/** @type {string} */ name) {
    const spec = this.specs.get(name);
    if (!spec) throw new EngineError(`tensor ${name} is not in the manifest`, 're-export the bundle');
    return spec;
  }

  /** Tensor names of one manifest role ('base' | 'personal' | 'buffer'), in manifest order. */
  namesByRole(/** @type {string} */ role) {
    if (!ROLES.includes(role)) throw new EngineError(`unknown tensor role ${JSON.stringify(role)}`, `use one of ${ROLES.join(', ')}`);
    return this.manifest.tensors.filter((t) => t.role === role).map((t) => t.name);
  }

  /** Trainable sets this bundle has, like Engine.available_sets: kp=0 has no 'personal', kp=max no 'base'. */
  trainableSets() {
    const hasBase = this.namesByRole('base').length > 0;
    const hasPersonal = this.namesByRole('personal').length > 0;
    return [...(hasBase || hasPersonal ? ['full'] : []), ...(hasPersonal ? ['personal'] : []), ...(hasBase ? ['base'] : [])];
  }

  /**
   * Copies of the named tensors (all params and buffers by default) as {name: {dtype, shape, data}}; of a
   * `snapshot()` when given. A tensor on the GPU is read back and stays in memory from then on (the next WebGPU
   * step uploads it once).
   * @param {readonly string[]} [names]
   * @param {Map<string, OrtTensor>} [state]
   * @returns {Promise<Tensors>}
   */
  async getTensors(names = this.stateNames, state = this.state) {
    const unknown = names.filter((n) => !state.has(n));
    if (unknown.length) throw new EngineError(`unknown tensor(s) ${unknown.slice(0, 3).join(', ')}`, "use names listed in the bundle's manifest.json");
    /** @type {Tensors} */
    const out = {};
    for (const name of names) {
      const t = await inMemory(/** @type {OrtTensor} */ (state.get(name)));
      out[name] = { dtype: t.type, shape: Array.from(t.dims), data: /** @type {import('./safetensors.js').TypedArray} */ (t.data).slice() };
    }
    return out;
  }

  /** Overwrite the named tensors; names, shapes, dtypes and finite values are checked against the manifest. */
  setTensors(/** @type {Tensors} */ tensors, { exact = false } = {}) {
    const names = Object.keys(tensors);
    const unknown = names.filter((n) => !this.stateNames.includes(n));
    if (unknown.length) throw new EngineError(`unknown tensor(s) ${unknown.slice(0, 3).join(', ')}`, "use names listed in the bundle's manifest.json");
    if (exact) {
      const missing = this.stateNames.filter((n) => !(n in tensors));
      if (missing.length) throw new EngineError(`tensor(s) ${missing.slice(0, 3).join(', ')} are missing`, 're-export the bundle');
    }
    const checked = names.map((name) => /** @type {const} */ ([name, this.checkTensor(name, tensors[name])]));
    for (const [name, t] of checked) {
      // a private copy: the caller keeps its array
      const data = /** @type {Float32Array} */ (t.data.slice()); // any of the typed arrays ort.Tensor takes for its dtype
      this.replace(name, new this.ort.Tensor(/** @type {'float32'} */ (t.dtype), data, t.shape.slice()));
    }
  }

  /** Hold `tensor` as the state tensor `name`; the one it replaces, if on the GPU, gives its buffer back. */
  replace(/** @type {string} */ name, /** @type {OrtTensor} */ tensor) {
    const held = this.state.get(name);
    this.state.set(name, tensor);
    if (held && held !== tensor && !this.pinned.has(held)) release(held);
  }

  checkTensor(/** @type {string} */ name, /** @type {Tensor} */ t) {
    const spec = this.spec(name);
    if (!t || !Array.isArray(t.shape) || t.shape.length !== spec.shape.length || t.shape.some((d, i) => d !== spec.shape[i])) {
      throw new EngineError(`tensor ${name} has shape [${t && t.shape}], the manifest says [${spec.shape}]`, 'export and train from the same bundle');
    }
    if (t.dtype !== spec.dtype || !(t.data instanceof typedArrayOf(spec.dtype)) || t.data.length !== numel(spec.shape)) {
      throw new EngineError(`tensor ${name} has dtype ${t.dtype}, the manifest says ${spec.dtype}`, "send tensors in the manifest's dtype");
    }
    if (t.data instanceof Float32Array || t.data instanceof Float64Array) {
      for (let i = 0; i < t.data.length; i++) {
        if (!Number.isFinite(t.data[i])) throw new EngineError(`tensor ${name} contains NaN or Inf`, 'lower the learning rate and retrain');
      }
    }
    return t;
  }

  /** One SGD step on `count` <= batchSize samples of x (float32 NCHW) and y; a short batch is padded and masked. */
  async trainStep(/** @type {ModelInput} */ x, /** @type {Int32Array | BigInt64Array} */ y, /** @type {number} */ count, /** @type {number} */ lr, trainable = 'full') {
    if (!(Number.isFinite(lr) && lr > 0)) throw new EngineError(`learning rate ${lr} is not a positive number`, 'the round settings must give lr > 0');
    const results = await this.runStep(x, y, count, lr, trainable);
    for (const [name, tensor] of results.state) this.replace(name, tensor);
    return results.loss;
  }

  /** A training-mode pass that moves the BatchNorm running statistics and no weight (engine.py statistics_step). */
  async statisticsStep(/** @type {ModelInput} */ x, /** @type {Int32Array | BigInt64Array} */ y, /** @type {number} */ count) {
    const sets = this.trainableSets(); // the cheapest set whose step runs the whole forward (engine.py statistics_set)
    const results = await this.runStep(x, y, count, 0, sets.includes('personal') ? 'personal' : sets[0]);
    const buffers = new Set(this.entry.buffers);
    for (const [name, tensor] of results.state) {
      if (buffers.has(name)) this.replace(name, tensor);
      else release(tensor);
    }
  }

  /**
   * Each BatchNorm running statistic's momentum by tensor name (engine.py statistics_momenta).
   * @returns {Record<string, number>}
   */
  statisticsMomenta() {
    const names = this.manifest.tensors.filter((t) => t.role === 'buffer' && /\.running_(mean|var)$/.test(t.name)).map((t) => t.name);
    const momentum = this.entry.bn_momentum ?? 0.1;
    if (Array.isArray(momentum)) throw new EngineError('the bundle lists its BatchNorm momenta without their layers (an older export)', 're-export the bundle with this edgepfl version');
    return Object.fromEntries(names.map((name) => [name, Number(typeof momentum === 'object' ? momentum[name] : momentum)]));
  }

  /**
   * Run one step graph on the current state; returns the loss and the new state by tensor name. A step with a
   * frozen variant leaves out its frozen tensors (they pass through unchanged), so that the state keeps the very
   * same tensor objects and the next step can tell they did not change (portable_engine.py _run_step).
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
      throw new EngineError(`a batch of ${count} samples exceeds the portable graphs' batch size ${this.batchSize}`, `train with batches of at most ${this.batchSize}`);
    }
    const key = `step_${trainable}`;
    const graph = this.entry.steps[trainable];
    const n = this.stateNames.length;
    const byInput = new Map(graph.inputs.slice(0, n).map((input, i) => [input, this.stateNames[i]]));
    const byOutput = new Map(graph.outputs.slice(1, n + 1).map((output, i) => [output, this.stateNames[i]]));
    const stateOf = (/** @type {Map<string, string>} */ by, /** @type {string} */ name) => /** @type {string} */ (by.get(name));
    // the frozen tensors stay as they are (a plain graph's copies of them are not fetched), with or without a variant
    const kept = new Set(graph.frozen ? graph.frozen.initializers.map((input) => stateOf(byInput, input)) : []);
    const frozen = graph.frozen && this.variants.has(graph.frozen.model) ? graph.frozen : null;
    const values = frozen ? [...kept].map((name) => /** @type {OrtTensor} */ (this.state.get(name))) : [];
    const baked = frozen && (await this.bakedSession(key, frozen, values));
    const [opened, inputs, outputs] = baked && frozen ? [baked, frozen.inputs, frozen.outputs] : [await this.session(key, graph), graph.inputs, graph.outputs];
    const stateInputs = inputs.filter((input) => byInput.has(input));
    const batchInputs = inputs.slice(stateInputs.length);
    const feeds = await this.feeds(opened, stateInputs.map((input) => [input, stateOf(byInput, input)]), batchInputs, x, y, 0, count);
    feeds[batchInputs[3]] = new this.ort.Tensor('float32', Float32Array.of(lr), []);
    const fetched = outputs.filter((output, i) => i === 0 || !kept.has(stateOf(byOutput, output)));
    const results = await opened.session.run(feeds, fetched);
    if (baked) this.variantSteps += 1;
    else if (frozen) {
      const held = this.plainOn.get(key);
      this.plainOn.set(key, { values, steps: held && sameTensors(held.values, values) ? held.steps + 1 : 1 });
    }
    return { loss: Number(results[outputs[0]].data[0]), state: new Map(fetched.slice(1).map((output) => [stateOf(byOutput, output), results[output]])) };
  }

  /**
   * The step's frozen variant built on the frozen tensors `values`, or null for the plain graph. It is built
   * after BAKE_AFTER_STEPS plain steps on them, so a caller that changes them every step (or trains a set for a
   * step or two) never pays for a build, and a seeded run takes the same graphs every time
   * (portable_engine.py _baked_session). onnxruntime-web takes the frozen tensors as the variant's one external
   * data file: their bytes laid end to end in the variant's order (export/frozen.py).
   * @param {string} key
   * @param {FrozenVariant} frozen
   * @param {OrtTensor[]} values
   * @returns {Promise<Opened | null>}
   */
  async bakedSession(key, frozen, values) {
    const built = this.baked.get(key);
    if (built && sameTensors(built.values, values)) return built.opened;
    if (built) {
      this.baked.delete(key); // its frozen tensors changed: free its memory before building another
      await built.opened.session.release();
    }
    const held = this.plainOn.get(key);
    if (!held || !sameTensors(held.values, values) || held.steps < BAKE_AFTER_STEPS) return null;
    for (const t of values) await inMemory(t); // read back once: the variant holds them from now on
    const arrays = values.map((t) => /** @type {import('./safetensors.js').TypedArray} */ (t.data));
    const data = concat(...arrays.map((a) => new Uint8Array(a.buffer, a.byteOffset, a.byteLength)));
    let opened;
    try {
      const extra = { externalData: [{ path: frozen.data_location, data }] };
      opened = await this.openSession(frozen.model, /** @type {Uint8Array} */ (this.variants.get(frozen.model)), frozen, extra);
    } catch (err) {
      throw new EngineError(`the frozen variant ${frozen.model} does not load (${describe(err).split('\n')[0].slice(0, 200)})`, 're-export the bundle, or export it with --no-frozen-variants');
    }
    this.baked.set(key, { opened, values });
    return opened;
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
    const opened = await this.session('eval', graph);
    const n = this.stateNames.length;
    let lossSum = 0;
    let correct = 0;
    for (let start = 0; start < count; start += this.batchSize) {
      const chunk = Math.min(this.batchSize, count - start);
      const feeds = await this.feeds(opened, graph.inputs.slice(0, n).map((input, i) => [input, this.stateNames[i]]), graph.inputs.slice(n), x, y, start, chunk);
      const results = await opened.session.run(feeds, graph.outputs.slice(1));
      lossSum += Number(results[graph.outputs[1]].data[0]) * chunk;
      correct += Number(results[graph.outputs[2]].data[0]);
    }
    return { lossSum, correct, count };
  }

  /**
   * Class probabilities (count x classes, float32, row by row) of the model on `count` pre-processed inputs, in
   * inference mode: the eval graph's logits, softmax in float64 (engine.py predict). `held` (a `snapshot()`)
   * predicts with the tensors held then instead of the current ones, e.g. while a round trains.
   * @param {ModelInput} x
   * @param {number} count
   * @param {Map<string, OrtTensor>} [held]
   */
  async predict(x, count, held = this.state) {
    const y = new Int32Array(count);
    this.checkBatch(x, y, count);
    const key = this.predictGraph(count);
    const graph = /** @type {Graph} */ (this.entry[key]);
    const size = graph.batch_size ?? this.batchSize;
    const opened = await this.session(key, graph);
    const n = this.stateNames.length;
    const classes = this.manifest.num_classes;
    const probabilities = new Float32Array(count * classes);
    for (let start = 0; start < count; start += size) {
      const chunk = Math.min(size, count - start);
      const feeds = await this.feeds(opened, graph.inputs.slice(0, n).map((input, i) => [input, this.stateNames[i]]), graph.inputs.slice(n), x, y, start, chunk, held, size);
      const logits = /** @type {Float32Array} */ ((await opened.session.run(feeds, [graph.outputs[0]]))[graph.outputs[0]].data);
      for (let row = 0; row < chunk; row++) probabilities.set(softmax(logits.subarray(row * classes, (row + 1) * classes)), (start + row) * classes);
    }
    return probabilities;
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
  async snapshot() {
    const held = new Map(this.state);
    for (const t of held.values()) this.pinned.add(t); // a step that replaces one meanwhile leaves it to us
    try {
      for (const t of held.values()) await inMemory(t);
    } finally {
      for (const t of held.values()) this.pinned.delete(t);
    }
    return held;
  }

  /** Free the sessions' memory and the state's GPU buffers; the engine cannot be used afterwards. */
  async release() {
    for (const opened of this.sessions.values()) await (await opened).session.release();
    for (const { opened } of this.baked.values()) await opened.session.release();
    for (const t of this.state.values()) release(t);
    this.sessions.clear();
    this.baked.clear();
    this.state.clear();
  }

  checkSet(/** @type {string} */ trainable) {
    if (!this.trainableSets().includes(trainable)) {
      throw new EngineError(`this bundle (personal ${personalSpec(this.manifest)}) has no ${JSON.stringify(trainable)} trainable set`, `choose one of: ${this.trainableSets().join(', ')}`);
    }
  }

  checkBatch(/** @type {ModelInput} */ x, /** @type {Int32Array | BigInt64Array} */ y, /** @type {number} */ count) {
    if (!Number.isInteger(count) || count < 1) throw new EngineError(`batch count ${count} is not a positive integer`, 'pass at least one sample');
    if (!(x instanceof this.inputType.array) || x.length !== count * this.sampleSize) {
      const given = x instanceof this.inputType.array ? `${x.length} values` : `a ${x && x.constructor.name}`;
      throw new EngineError(`inputs hold ${given} for ${count} samples of [${this.sampleShape}] ${this.inputType.dtype}`, `pass a ${this.inputType.array.name} of ${count} x ${this.sampleSize} pre-processed values`);
    }
    if (!(y instanceof Int32Array || y instanceof BigInt64Array) || y.length !== count) {
      throw new EngineError(`labels are not an Int32Array or BigInt64Array of ${count}`, 'pass one label per input');
    }
    const classes = this.manifest.num_classes;
    for (let i = 0; i < count; i++) {
      const label = Number(y[i]);
      if (!(label >= 0 && label < classes)) throw new EngineError(`label ${label} is not a class of this model (0..${classes - 1})`, 'relabel the examples');
    }
  }

  /**
   * Feeds of one graph batch for the `opened` session: the state tensors by [input, name] pairs (a wasm session
   * gets those on the GPU read back first), and x, y, w (the first three of `batchInputs`) holding `count` real
   * samples from `start`, zero-padded to `size` (the step graphs' batch by default) and masked.
   * @param {Opened} opened
   * @param {[string, string][]} stateInputs
   * @param {string[]} batchInputs
   * @param {ModelInput} x
   * @param {Int32Array | BigInt64Array} y
   * @param {number} start
   * @param {number} count
   * @param {Map<string, OrtTensor>} [state] the tensors to feed (the current ones by default)
   * @param {number} [size]
   */
  async feeds(opened, stateInputs, batchInputs, x, y, start, count, state = this.state, size = this.batchSize) {
    /** @type {Record<string, OrtTensor>} */
    const feeds = {};
    for (const [input, name] of stateInputs) {
      const t = /** @type {OrtTensor} */ (state.get(name));
      feeds[input] = opened.backend === 'webgpu' ? t : await inMemory(t);
    }
    const bx = new this.inputType.array(size * this.sampleSize); // padding: zeros (<pad> for token ids)
    bx.set(/** @type {any} */ (x).subarray(start * this.sampleSize, (start + count) * this.sampleSize));
    const labels = this.labelType;
    const by = new labels.array(size);
    const bw = new Float32Array(size);
    for (let i = 0; i < count; i++) {
      by[i] = labels.of(Number(y[start + i]));
      bw[i] = 1;
    }
    feeds[batchInputs[0]] = new this.ort.Tensor(/** @type {'float32'} */ (this.inputType.dtype), /** @type {Float32Array} */ (bx), [size, ...this.sampleShape]);
    feeds[batchInputs[1]] = new this.ort.Tensor(labels.dtype, /** @type {Int32Array} */ (by), [size]);
    feeds[batchInputs[2]] = new this.ort.Tensor('float32', bw, [size]);
    return feeds;
  }

  /** The session of `graph` (a manifest graph entry), opened on first use (its bytes are dropped then). */
  session(/** @type {string} */ key, /** @type {Graph} */ graph) {
    const path = graph.model;
    let created = this.sessions.get(key);
    if (!created) {
      created = this.openSession(path, /** @type {Uint8Array} */ (this.graphs.get(path)), graph).then(
        (opened) => {
          this.graphs.delete(path);
          return opened;
        },
        (err) => {
          this.sessions.delete(key); // a later call may retry, e.g. after memory was freed
          throw new EngineError(`onnxruntime-web cannot load ${path} (${describe(err)})`, 'reload the page; if it persists, this browser lacks WebAssembly SIMD or memory');
        },
      );
      this.sessions.set(key, created);
    }
    return created;
  }

  /**
   * A session for the graph at `path` (its manifest entry `graph`): {session, backend}. With the WebGPU back end every
   * node goes to the GPU or the graph runs on WebAssembly: its WebGPU session is opened with CPU fallback disabled,
   * since a step split between GPU and CPU would copy tensors back and forth at every step and run slower than
   * WebAssembly (export/webgpu.py). The reason for WebAssembly is the problems the exporter found in the graph
   * (`webgpu_problems`) or onnxruntime-web's refusal; it is kept in `placements`. A step's outputs but the loss stay
   * on the GPU for the next step. `extra` adds session options (a frozen variant's external data).
   * @param {string} path
   * @param {Uint8Array} bytes
   * @param {Graph | FrozenVariant} graph
   * @param {import('onnxruntime-web').InferenceSession.SessionOptions} [extra]
   * @returns {Promise<Opened>}
   */
  async openSession(path, bytes, graph, extra = {}) {
    // with a log level set, each session's onnxruntime log lines carry its graph's path (its node placements at 0)
    const logging = this.logSeverityLevel === undefined ? {} : { logSeverityLevel: this.logSeverityLevel, logId: path };
    let reason = '';
    if (this.backend === 'webgpu') {
      const problems = graph.webgpu_problems || [];
      reason = problems.join('; ');
      if (!problems.length) {
        /** @type {Record<string, import('onnxruntime-web').Tensor.DataLocation>} */
        const outputs = Object.fromEntries(graph.outputs.map((output, i) => [output, i === 0 || !output.startsWith('new_') ? 'cpu' : 'gpu-buffer']));
        /** @type {import('onnxruntime-web').InferenceSession.SessionOptions} */
        const options = { executionProviders: [{ ...WEBGPU_PROVIDER }], graphOptimizationLevel: 'all', preferredOutputLocation: outputs, ...logging, ...extra };
        options.extra = { session: { disable_cpu_ep_fallback: '1' } };
        try {
          return this.placed(path, { session: await this.ort.InferenceSession.create(bytes, options), backend: 'webgpu' });
        } catch (err) {
          reason = `onnxruntime-web did not place every node on WebGPU (${describe(err).split('\n')[0].slice(0, 300)})`;
        }
      }
    }
    // onnxruntime-web writes into the options it gets: each session has its own object
    const session = await this.ort.InferenceSession.create(bytes, { ...WASM_OPTIONS, ...logging, ...extra });
    return this.placed(path, { session, backend: 'wasm' }, reason);
  }

  /**
   * `opened`, its placement noted (and told to onPlacement).
   * @param {string} path
   * @param {Opened} opened
   * @returns {Opened}
   */
  placed(path, opened, reason = '') {
    const placement = reason ? { backend: opened.backend, reason } : { backend: opened.backend };
    this.placements.set(path, placement);
    if (this.onPlacement) this.onPlacement(path, placement);
    return opened;
  }
}

/**
 * `t` with its data in memory: a tensor on the GPU is read back in place (the same object, so that sameTensors
 * still knows it) and its GPU buffer given back.
 * @param {OrtTensor} t
 */
async function inMemory(t) {
  if (t.location === 'gpu-buffer') await t.getData(true);
  return t;
}

/** Give a GPU tensor's buffer back to onnxruntime-web (a tensor in memory is left to the garbage collector). */
function release(/** @type {OrtTensor} */ tensor) {
  if (tensor.location === 'gpu-buffer') tensor.dispose();
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
  const order = Array.from({ length: probabilities.length }, (_, i) => i).sort((a, b) => probabilities[b] - probabilities[a] || a - b);
  return order.slice(0, Math.min(k, order.length)).map((index) => ({ index, name: names[index], probability: probabilities[index] }));
}

/** Whether two lists hold the very same tensor objects (state is replaced, never written in place; portable_engine.py _same). */
function sameTensors(/** @type {OrtTensor[]} */ held, /** @type {OrtTensor[]} */ current) {
  return held.length === current.length && held.every((t, i) => t === current[i]);
}

/**
 * The typed array and ONNX type of a bundle's model input: int64 token ids (BigInt64Array) for a text bundle,
 * else float32.
 * @param {InputSpec} input
 * @returns {{dtype: 'float32' | 'int64', array: Float32ArrayConstructor | BigInt64ArrayConstructor}}
 */
export function inputType(input) {
  if (input.dtype === 'int64') return { dtype: 'int64', array: BigInt64Array };
  if (input.dtype && input.dtype !== 'float32') {
    throw new EngineError(`the bundle's model input is ${input.dtype}`, 'export it again: a page runs float32 or int64 (token id) inputs');
  }
  return { dtype: 'float32', array: Float32Array };
}
