// The browser engine: onnxruntime-web sessions over a bundle's portable step graphs (mirrors
// device_runtime/portable_engine.py). `ort` is passed in, so the same code runs in the page (wasm-only
// build) and under Node (tests). Tensors are addressed by manifest name; state stays as ort.Tensor.

import { decodeSafetensors, numel, typedArrayOf } from './safetensors.js';
import { checkSha256 } from './sha256.js';

const ROLES = ['base', 'personal', 'buffer'];

/** An Error whose message names the problem and whose `fix` says what to do about it. */
export class EngineError extends Error {
  constructor(message, fix) {
    super(`${message} — ${fix}`);
    this.name = 'EngineError';
    this.fix = fix;
  }
}

/**
 * Open the portable graphs of a bundle. `files` maps bundle-relative paths to bytes and holds at least the
 * portable entry's graphs and `initial` tensors; each file the manifest lists a sha256 for is checked.
 * `threads` > 1 needs a cross-origin isolated page (SharedArrayBuffer); it applies to the first engine
 * opened in a page, because onnxruntime-web starts its wasm runtime once.
 */
export async function openEngine(ort, manifest, files, { threads = 1 } = {}) {
  const entry = manifest.engines && manifest.engines.portable;
  if (!entry) throw new EngineError('the bundle has no portable graphs', 're-export it with --engines portable');
  const required = [entry.initial, entry.eval.model, ...Object.values(entry.steps).map((s) => s.model)];
  for (const path of required) {
    if (!files.has(path)) throw new EngineError(`bundle file ${path} was not loaded`, 'download every file of manifest.engines.portable');
    const expected = manifest.files && manifest.files[path];
    if (expected) await checkSha256(files.get(path), expected, `bundle file ${path}`);
  }
  ort.env.wasm.numThreads = Math.max(1, Math.floor(threads));
  const graphs = new Map(required.slice(1).map((path) => [path, files.get(path)]));
  const engine = new Engine(ort, manifest, entry, graphs);
  engine.setTensors(decodeSafetensors(files.get(entry.initial), entry.initial).tensors, { exact: true });
  return engine;
}

class Engine {
  constructor(ort, manifest, entry, graphs) {
    this.ort = ort;
    this.manifest = manifest;
    this.entry = entry;
    this.graphs = graphs; // bytes of graphs without a session yet; dropped once their session exists
    this.batchSize = Number(entry.batch_size);
    const [channels, height, width] = manifest.input.shape;
    this.sampleSize = channels * height * width;
    this.sampleShape = [channels, height, width];
    // graph inputs and outputs list the state tensors in this order: params, then buffers
    this.stateNames = [...entry.params, ...entry.buffers];
    this.specs = new Map(manifest.tensors.map((t) => [t.name, t]));
    this.state = new Map();
    this.sessions = new Map();
  }

  /** Tensor names of one manifest role ('base' | 'personal' | 'buffer'), in manifest order. */
  namesByRole(role) {
    if (!ROLES.includes(role)) throw new EngineError(`unknown tensor role ${JSON.stringify(role)}`, `use one of ${ROLES.join(', ')}`);
    return this.manifest.tensors.filter((t) => t.role === role).map((t) => t.name);
  }

  /** Trainable sets this bundle has, like Engine.available_sets: kp=0 has no 'personal', kp=max no 'base'. */
  trainableSets() {
    const hasBase = this.namesByRole('base').length > 0;
    const hasPersonal = this.namesByRole('personal').length > 0;
    return [...(hasBase || hasPersonal ? ['full'] : []), ...(hasPersonal ? ['personal'] : []), ...(hasBase ? ['base'] : [])];
  }

  /** Copies of the named tensors (all params and buffers by default) as {name: {dtype, shape, data}}. */
  getTensors(names = this.stateNames) {
    const unknown = names.filter((n) => !this.state.has(n));
    if (unknown.length) throw new EngineError(`unknown tensor(s) ${unknown.slice(0, 3).join(', ')}`, "use names listed in the bundle's manifest.json");
    const out = {};
    for (const name of names) {
      const t = this.state.get(name);
      out[name] = { dtype: t.type, shape: Array.from(t.dims), data: t.data.slice() };
    }
    return out;
  }

  /** Overwrite the named tensors; names, shapes, dtypes and finite values are checked against the manifest. */
  setTensors(tensors, { exact = false } = {}) {
    const names = Object.keys(tensors);
    const unknown = names.filter((n) => !this.stateNames.includes(n));
    if (unknown.length) throw new EngineError(`unknown tensor(s) ${unknown.slice(0, 3).join(', ')}`, "use names listed in the bundle's manifest.json");
    if (exact) {
      const missing = this.stateNames.filter((n) => !(n in tensors));
      if (missing.length) throw new EngineError(`tensor(s) ${missing.slice(0, 3).join(', ')} are missing`, 're-export the bundle');
    }
    const checked = names.map((name) => [name, this.checkTensor(name, tensors[name])]);
    for (const [name, t] of checked) {
      // a private copy: the caller keeps its array
      this.state.set(name, new this.ort.Tensor(t.dtype, t.data.slice(), t.shape.slice()));
    }
  }

  checkTensor(name, t) {
    const spec = this.specs.get(name);
    if (!spec) throw new EngineError(`tensor ${name} is not in the manifest`, 're-export the bundle');
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
  async trainStep(x, y, count, lr, trainable = 'full') {
    if (!(Number.isFinite(lr) && lr > 0)) throw new EngineError(`learning rate ${lr} is not a positive number`, 'the round settings must give lr > 0');
    const results = await this.runStep(x, y, count, lr, trainable);
    this.stateNames.forEach((name, i) => this.state.set(name, results.state[i]));
    return results.loss;
  }

  /** A training-mode pass that moves the BatchNorm running statistics and no weight (engine.py statistics_step). */
  async statisticsStep(x, y, count) {
    const sets = this.trainableSets(); // the cheapest set whose step runs the whole forward (engine.py statistics_set)
    const results = await this.runStep(x, y, count, 0, sets.includes('personal') ? 'personal' : sets[0]);
    const params = this.entry.params.length;
    this.entry.buffers.forEach((name, i) => this.state.set(name, results.state[params + i]));
  }

  /** Each BatchNorm running statistic's momentum by tensor name (engine.py statistics_momenta). */
  statisticsMomenta() {
    const names = this.manifest.tensors.filter((t) => t.role === 'buffer' && /\.running_(mean|var)$/.test(t.name)).map((t) => t.name);
    const momentum = this.entry.bn_momentum ?? 0.1;
    if (Array.isArray(momentum)) throw new EngineError('the bundle lists its BatchNorm momenta without their layers (an older export)', 're-export the bundle with this edgepfl version');
    return Object.fromEntries(names.map((name) => [name, Number(typeof momentum === 'object' ? momentum[name] : momentum)]));
  }

  async runStep(x, y, count, lr, trainable) {
    this.checkSet(trainable);
    this.checkBatch(x, y, count);
    if (count > this.batchSize) {
      throw new EngineError(`a batch of ${count} samples exceeds the portable graphs' batch size ${this.batchSize}`, `train with batches of at most ${this.batchSize}`);
    }
    const graph = this.entry.steps[trainable];
    const feeds = this.feeds(graph.inputs, x, y, 0, count);
    feeds[graph.inputs[this.stateNames.length + 3]] = new this.ort.Tensor('float32', Float32Array.of(lr), []);
    const session = await this.session(`step_${trainable}`, graph.model);
    const results = await session.run(feeds);
    return { loss: results[graph.outputs[0]].data[0], state: this.stateNames.map((_, i) => results[graph.outputs[i + 1]]) };
  }

  /** Summed loss and correct count of the current model over any number of samples (run in graph-sized chunks). */
  async evaluate(x, y, count) {
    this.checkBatch(x, y, count);
    const graph = this.entry.eval;
    const session = await this.session('eval', graph.model);
    let lossSum = 0;
    let correct = 0;
    for (let start = 0; start < count; start += this.batchSize) {
      const chunk = Math.min(this.batchSize, count - start);
      const results = await session.run(this.feeds(graph.inputs, x, y, start, chunk), graph.outputs.slice(1));
      lossSum += results[graph.outputs[1]].data[0] * chunk;
      correct += Number(results[graph.outputs[2]].data[0]);
    }
    return { lossSum, correct, count };
  }

  /** Free the sessions' wasm memory; the engine cannot be used afterwards. */
  async release() {
    for (const session of this.sessions.values()) await (await session).release();
    this.sessions.clear();
  }

  checkSet(trainable) {
    if (!this.trainableSets().includes(trainable)) {
      throw new EngineError(`this bundle (kp=${this.manifest.kp}) has no ${JSON.stringify(trainable)} trainable set`, `choose one of: ${this.trainableSets().join(', ')}`);
    }
  }

  checkBatch(x, y, count) {
    if (!Number.isInteger(count) || count < 1) throw new EngineError(`batch count ${count} is not a positive integer`, 'pass at least one sample');
    if (!(x instanceof Float32Array) || x.length !== count * this.sampleSize) {
      throw new EngineError(`inputs hold ${x && x.length} values for ${count} samples of [${this.sampleShape}]`, 'pass a Float32Array of count*C*H*W pre-processed values');
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

  /** State tensors plus x, y, w of one graph batch: `count` real samples from `start`, zero-padded and masked. */
  feeds(inputNames, x, y, start, count) {
    const feeds = {};
    this.stateNames.forEach((name, i) => {
      feeds[inputNames[i]] = this.state.get(name);
    });
    const size = this.batchSize;
    const bx = new Float32Array(size * this.sampleSize);
    bx.set(x.subarray(start * this.sampleSize, (start + count) * this.sampleSize));
    const by = new BigInt64Array(size);
    const bw = new Float32Array(size);
    for (let i = 0; i < count; i++) {
      by[i] = BigInt(y[start + i]);
      bw[i] = 1;
    }
    const n = this.stateNames.length;
    feeds[inputNames[n]] = new this.ort.Tensor('float32', bx, [size, ...this.sampleShape]);
    feeds[inputNames[n + 1]] = new this.ort.Tensor('int64', by, [size]);
    feeds[inputNames[n + 2]] = new this.ort.Tensor('float32', bw, [size]);
    return feeds;
  }

  session(key, path) {
    if (!this.sessions.has(key)) {
      const options = { executionProviders: ['wasm'], graphOptimizationLevel: 'all' };
      const created = this.ort.InferenceSession.create(this.graphs.get(path), options).then(
        (session) => {
          this.graphs.delete(path);
          return session;
        },
        (err) => {
          this.sessions.delete(key); // a later call may retry, e.g. after memory was freed
          throw new EngineError(`onnxruntime-web cannot load ${path} (${err.message})`, 'reload the page; if it persists, this browser lacks WebAssembly SIMD or memory');
        },
      );
      this.sessions.set(key, created);
    }
    return this.sessions.get(key);
  }
}
