// @ts-check
// onnxruntime-web in a worker of the page's own (runtime_worker.js), behind the part of onnxruntime-web's API the
// engine uses (Tensor, InferenceSession.create, run, release, env.wasm), so the engine runs unchanged on either side.
// Why: a step then never holds the page's thread, on WebAssembly or WebGPU (onnxruntime-web's own proxy worker runs
// WebAssembly only), so motion readings keep coming while a round trains; and a GPU step that never returns is
// stopped by ending the worker, which a page whose own thread spins in the GPU's work cannot do. Tensors a WebGPU
// step leaves on the GPU stay in the worker; the page holds a handle, reads one back or gives it back.

import { EngineError } from './errors.js';

/** @typedef {typeof import('onnxruntime-web')} Ort */
/** A tensor on its way between page and worker: its values, or the worker's handle of one on the GPU. @typedef {{type: any, dims: readonly number[], data?: any, handle?: number}} Wire */
/** The page's end of the worker: a Worker, or a MessagePort in tests. @typedef {{postMessage: (message: any) => void, onmessage: ((event: MessageEvent) => any) | null, onerror?: ((event: any) => any) | null, onmessageerror?: ((event: any) => any) | null}} Port */
/** The runtime, and how to stop its worker. @typedef {Ort & {stop: () => void}} RemoteOrt */

/**
 * An `ort` whose sessions run in the worker at the other end of `port`, which imports the onnxruntime-web build at
 * `url` and finds its wasm files at `wasmPaths`. `stop()` ends the worker (a Worker's terminate) and fails every
 * request under way, in one line; so does the worker's own end (a script that does not load, memory).
 * @param {Port} port
 * @param {string} url
 * @param {string} wasmPaths
 * @param {() => void} [terminate]
 * @returns {RemoteOrt}
 */
export function remoteRuntime(port, url, wasmPaths, terminate = () => {}) {
  /** @type {Map<number, {resolve: (result: any) => void, reject: (err: Error) => void}>} */
  const pending = new Map();
  let next = 1;
  let ended = '';

  /** One request to the worker; its answer, or its error. */
  const call = (/** @type {string} */ op, /** @type {Record<string, any>} */ request) =>
    /** @type {Promise<any>} */ (
      new Promise((resolve, reject) => {
        if (ended) throw new EngineError(ended, 'reload the page');
        const id = next++;
        pending.set(id, { resolve, reject });
        port.postMessage({ id, op, ...request });
      })
    );
  port.onmessage = ({ data: { id, result, error } }) => {
    const waiting = pending.get(id);
    pending.delete(id);
    if (waiting) error === undefined ? waiting.resolve(result) : waiting.reject(new Error(error));
  };
  const end = (/** @type {string} */ why) => {
    ended ||= why;
    for (const waiting of pending.values()) waiting.reject(new EngineError(ended, 'reload the page'));
    pending.clear();
  };
  port.onerror = (event) => end(`the engine's worker failed (${(event && event.message) || 'no reason given'})`);
  port.onmessageerror = () => end("the engine's worker sent a message the page cannot read");

  /** A tensor of the page, or a handle of one the worker keeps on the GPU (as onnxruntime-web's gpu-buffer ones). */
  class Tensor {
    /**
     * @param {any} type
     * @param {any} data
     * @param {readonly number[]} dims
     */
    constructor(type, data, dims) {
      this.type = type;
      this.data = data;
      this.dims = dims;
      this.handle = 0;
    }

    /** @returns {'cpu' | 'gpu-buffer'} */
    get location() {
      return this.handle ? 'gpu-buffer' : 'cpu';
    }

    /** Its values; read back from the GPU where it lives there (and, with `release`, kept here from then on). */
    async getData(release = false) {
      if (!this.handle) return this.data;
      const { data } = await call('read', { handle: this.handle, release });
      if (release) {
        this.data = data;
        this.handle = 0;
      }
      return data;
    }

    /** Give its GPU buffer back (a tensor in memory is left to the garbage collector). */
    dispose() {
      if (!this.handle || ended) return;
      call('dispose', { handle: this.handle }).catch(() => {}); // a worker that ended gave every buffer back
      this.handle = 0;
    }
  }

  const toWire = (/** @type {Tensor} */ t) =>
    /** @type {Wire} */ (t.handle ? { handle: t.handle } : { type: t.type, dims: t.dims, data: t.data });
  const fromWire = (/** @type {Wire} */ w) => {
    const t = new Tensor(w.type, w.data, w.dims);
    t.handle = w.handle || 0;
    return t;
  };
  const env = { wasm: { numThreads: 1, wasmPaths } };
  const InferenceSession = {
    /**
     * @param {Uint8Array} bytes
     * @param {Record<string, any>} [options]
     */
    async create(bytes, options = {}) {
      const { session } = await call('create', { url, wasm: { ...env.wasm }, bytes, options });
      return {
        /**
         * @param {Record<string, Tensor>} feeds
         * @param {string[]} fetches
         */
        async run(feeds, fetches) {
          const given = Object.fromEntries(Object.entries(feeds).map(([name, t]) => [name, toWire(t)]));
          const results = await call('run', { session, feeds: given, fetches });
          return Object.fromEntries(Object.entries(results).map(([name, w]) => [name, fromWire(w)]));
        },
        release: () => call('release', { session }),
      };
    },
  };
  const stop = () => {
    terminate();
    end('the engine was stopped');
  };
  return /** @type {RemoteOrt} */ (/** @type {unknown} */ ({ env, Tensor, InferenceSession, stop }));
}
