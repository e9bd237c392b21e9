// @ts-check
// The onnxruntime-web sessions of a bundle's graphs, each opened on first use, and where each runs: on WebGPU
// whole, or on WebAssembly with the reason (export/webgpu.py). A graph's state outputs stay on the GPU between
// WebGPU steps; inMemory reads one back.

import { EngineError, describe } from './errors.js';

/** @typedef {typeof import('onnxruntime-web')} Ort */
/** @typedef {import('onnxruntime-web').Tensor} OrtTensor */
/** @typedef {import('onnxruntime-web').InferenceSession} Session */
/** @typedef {import('./manifest.js').Graph} Graph */
/** @typedef {import('./manifest.js').FrozenVariant} FrozenVariant */
/** Where the engine runs its graphs. @typedef {'wasm' | 'webgpu'} Backend */
/** Where one graph runs, and why not on the GPU when the back end is WebGPU. @typedef {{backend: Backend, reason?: string}} Placement */
/** An opened session and where it runs. @typedef {{session: Session, backend: Backend}} Opened */
/** The activation layout onnxruntime-web's WebGPU kernels run convolutions in. @typedef {'NCHW' | 'NHWC'} Layout */
/**
 * How the sessions open: the back end, its convolutions' layout on WebGPU, who hears each graph's placement,
 * onnxruntime's log level (0 logs its node placements).
 * @typedef {{backend?: Backend, layout?: Layout, onPlacement?: (path: string, placement: Placement) => void, logSeverityLevel?: 0 | 1 | 2 | 3 | 4}} SessionOptions
 */

/** @type {import('onnxruntime-web').InferenceSession.SessionOptions} */
const WASM_OPTIONS = { executionProviders: ['wasm'], graphOptimizationLevel: 'all' };
// NCHW by default: onnxruntime-web 1.30's channels-last (NHWC) Conv computes wrong values where the input channels
// are a multiple of 3 but not of 4 (6 or 18; 3 itself is right), e.g. the cnn's second convolution
// (docs/web-device.md). NHWC is there to be measured (bench/webgpu --layouts), which checks its values.
export const LAYOUTS = ['NCHW', 'NHWC'];

/** The sessions of one engine's graphs by key, and the placement of each graph by path. */
export class Sessions {
  /**
   * @param {Ort} ort
   * @param {Map<string, Uint8Array>} graphs bytes of graphs without a session yet; dropped once their session exists
   * @param {SessionOptions} [options]
   */
  constructor(ort, graphs, { backend = 'wasm', layout = 'NCHW', onPlacement, logSeverityLevel } = {}) {
    this.ort = ort;
    this.graphs = graphs;
    /** @type {Backend} */
    this.backend = backend;
    /** @type {Layout} */
    this.layout = layout;
    this.onPlacement = onPlacement;
    this.logSeverityLevel = logSeverityLevel;
    /** @type {Map<string, Promise<Opened>>} */
    this.opened = new Map();
    /** @type {Map<string, Placement>} graph path -> where each opened graph runs */
    this.placements = new Map();
  }

  /** The session of `graph` (a manifest graph entry), opened on first use (its bytes are dropped then). */
  session(/** @type {string} */ key, /** @type {Graph} */ graph) {
    const path = graph.model;
    let created = this.opened.get(key);
    if (!created) {
      created = this.open(path, /** @type {Uint8Array} */ (this.graphs.get(path)), graph).then(
        (opened) => {
          this.graphs.delete(path);
          return opened;
        },
        (err) => {
          this.opened.delete(key); // a later call may retry, e.g. after memory was freed
          throw new EngineError(
            `onnxruntime-web cannot load ${path} (${describe(err)})`,
            'reload the page; if it persists, this browser lacks WebAssembly SIMD or memory',
          );
        },
      );
      this.opened.set(key, created);
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
  async open(path, bytes, graph, extra = {}) {
    // with a log level set, each session's onnxruntime log lines carry its graph's path (its node placements at 0)
    const logging = this.logSeverityLevel === undefined ? {} : { logSeverityLevel: this.logSeverityLevel, logId: path };
    let reason = '';
    if (this.backend === 'webgpu') {
      const problems = graph.webgpu_problems || [];
      reason = problems.join('; ');
      if (!problems.length) {
        /** @type {Record<string, import('onnxruntime-web').Tensor.DataLocation>} */
        const outputs = Object.fromEntries(
          graph.outputs.map((output, i) => [output, i === 0 || !output.startsWith('new_') ? 'cpu' : 'gpu-buffer']),
        );
        /** @type {import('onnxruntime-web').InferenceSession.SessionOptions} */
        const options = {
          executionProviders: [{ name: 'webgpu', preferredLayout: this.layout }],
          graphOptimizationLevel: 'all',
          preferredOutputLocation: outputs,
          ...logging,
          ...extra,
        };
        options.extra = { session: { disable_cpu_ep_fallback: '1' } };
        try {
          return this.placed(path, {
            session: await this.ort.InferenceSession.create(bytes, options),
            backend: 'webgpu',
          });
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

  /** Free every opened session's memory. */
  async release() {
    for (const opened of this.opened.values()) await (await opened).session.release();
    this.opened.clear();
  }
}

/**
 * `t` with its data in memory: a tensor on the GPU is read back in place (the same object, so that sameTensors
 * still knows it) and its GPU buffer given back.
 * @param {OrtTensor} t
 */
export async function inMemory(t) {
  if (t.location === 'gpu-buffer') await t.getData(true);
  return t;
}

/** Give a GPU tensor's buffer back to onnxruntime-web (a tensor in memory is left to the garbage collector). */
export function releaseTensor(/** @type {OrtTensor} */ tensor) {
  if (tensor.location === 'gpu-buffer') tensor.dispose();
}
