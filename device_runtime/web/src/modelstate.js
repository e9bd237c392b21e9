// @ts-check
// The model's state as the engine holds it: every parameter and buffer as an ort.Tensor by manifest name, checked
// against the manifest when set, replaced (never written in place) by each step, on the GPU between WebGPU steps.

import { EngineError } from './errors.js';
import { numel, typedArrayOf } from './safetensors.js';
import { inMemory, releaseTensor } from './sessions.js';

/** @typedef {typeof import('onnxruntime-web')} Ort */
/** @typedef {import('onnxruntime-web').Tensor} OrtTensor */
/** @typedef {import('./manifest.js').Manifest} Manifest */
/** @typedef {import('./safetensors.js').Tensor} Tensor */
/** @typedef {import('./safetensors.js').Tensors} Tensors */

/** The named state tensors of one model. */
export class ModelState {
  /**
   * @param {Ort} ort
   * @param {Manifest} manifest
   * @param {string[]} names the state tensors, in the graphs' order: params, then buffers
   */
  constructor(ort, manifest, names) {
    this.ort = ort;
    this.names = names;
    this.specs = new Map(manifest.tensors.map((t) => [t.name, t]));
    /** @type {Map<string, OrtTensor>} */
    this.tensors = new Map();
    /** @type {Set<OrtTensor>} tensors a snapshot is reading back from the GPU: not given back when replaced */
    this.pinned = new Set();
  }

  /** The manifest's entry of a tensor; a name it does not list throws. */
  spec(/** @type {string} */ name) {
    const spec = this.specs.get(name);
    if (!spec) throw new EngineError(`tensor ${name} is not in the manifest`, 're-export the bundle');
    return spec;
  }

  /**
   * Copies of the named tensors as {name: {dtype, shape, data}}; of a `snapshot()` when given. A tensor on the
   * GPU is read back and stays in memory from then on (the next WebGPU step uploads it once).
   * @param {readonly string[]} names
   * @param {Map<string, OrtTensor>} [state]
   * @returns {Promise<Tensors>}
   */
  async get(names, state = this.tensors) {
    const unknown = names.filter((n) => !state.has(n));
    if (unknown.length)
      throw new EngineError(
        `unknown tensor(s) ${unknown.slice(0, 3).join(', ')}`,
        "use names listed in the bundle's manifest.json",
      );
    /** @type {Tensors} */
    const out = {};
    for (const name of names) {
      const t = await inMemory(/** @type {OrtTensor} */ (state.get(name)));
      out[name] = {
        dtype: t.type,
        shape: Array.from(t.dims),
        data: /** @type {import('./safetensors.js').TypedArray} */ (t.data).slice(),
      };
    }
    return out;
  }

  /** Overwrite the named tensors; names, shapes, dtypes and finite values are checked against the manifest. */
  set(/** @type {Tensors} */ tensors, { exact = false } = {}) {
    const names = Object.keys(tensors);
    const unknown = names.filter((n) => !this.names.includes(n));
    if (unknown.length)
      throw new EngineError(
        `unknown tensor(s) ${unknown.slice(0, 3).join(', ')}`,
        "use names listed in the bundle's manifest.json",
      );
    if (exact) {
      const missing = this.names.filter((n) => !(n in tensors));
      if (missing.length)
        throw new EngineError(`tensor(s) ${missing.slice(0, 3).join(', ')} are missing`, 're-export the bundle');
    }
    const checked = names.map((name) => /** @type {const} */ ([name, this.check(name, tensors[name])]));
    for (const [name, t] of checked) {
      // a private copy: the caller keeps its array
      const data = /** @type {Float32Array} */ (t.data.slice()); // any of the typed arrays ort.Tensor takes for its dtype
      this.replace(name, new this.ort.Tensor(/** @type {'float32'} */ (t.dtype), data, t.shape.slice()));
    }
  }

  /** Hold `tensor` as the state tensor `name`; the one it replaces, if on the GPU, gives its buffer back. */
  replace(/** @type {string} */ name, /** @type {OrtTensor} */ tensor) {
    const held = this.tensors.get(name);
    this.tensors.set(name, tensor);
    if (held && held !== tensor && !this.pinned.has(held)) releaseTensor(held);
  }

  /** `t` if its shape, dtype and values suit the manifest's tensor `name`; else one EngineError. */
  check(/** @type {string} */ name, /** @type {Tensor} */ t) {
    const spec = this.spec(name);
    if (
      !t ||
      !Array.isArray(t.shape) ||
      t.shape.length !== spec.shape.length ||
      t.shape.some((d, i) => d !== spec.shape[i])
    ) {
      throw new EngineError(
        `tensor ${name} has shape [${t && t.shape}], the manifest says [${spec.shape}]`,
        'export and train from the same bundle',
      );
    }
    if (
      t.dtype !== spec.dtype ||
      !(t.data instanceof typedArrayOf(spec.dtype)) ||
      t.data.length !== numel(spec.shape)
    ) {
      throw new EngineError(
        `tensor ${name} has dtype ${t.dtype}, the manifest says ${spec.dtype}`,
        "send tensors in the manifest's dtype",
      );
    }
    if (t.data instanceof Float32Array || t.data instanceof Float64Array) {
      for (let i = 0; i < t.data.length; i++) {
        if (!Number.isFinite(t.data[i]))
          throw new EngineError(`tensor ${name} contains NaN or Inf`, 'lower the learning rate and retrain');
      }
    }
    return t;
  }

  /**
   * The tensors as they are now, kept aside (no copy: a step replaces tensors, never writes into them). Those on
   * the GPU are read back first: a later step gives the GPU buffers of the tensors it replaces back.
   * @returns {Promise<Map<string, OrtTensor>>}
   */
  async snapshot() {
    const held = new Map(this.tensors);
    for (const t of held.values()) this.pinned.add(t); // a step that replaces one meanwhile leaves it to us
    try {
      for (const t of held.values()) await inMemory(t);
    } finally {
      for (const t of held.values()) this.pinned.delete(t);
    }
    return held;
  }

  /** Give the GPU buffers back and forget every tensor. */
  release() {
    for (const t of this.tensors.values()) releaseTensor(t);
    this.tensors.clear();
  }
}
