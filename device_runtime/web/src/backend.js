// @ts-check
// Where the page trains: on the GPU through onnxruntime-web's WebGPU back end where the browser gives a hardware
// WebGPU adapter (or WebGPU is asked for), else on the processor through WebAssembly (gpucheck.js says why); the onnxruntime-web build that carries it; the line that
// says so. Which graphs the GPU then takes whole is the engine's business (sessions.js Sessions.open).

import { EngineError } from './engine.js';
import { softwareAdapter, softwareReason } from './gpucheck.js';

/** @typedef {import('./engine.js').Backend} Backend */
/** @typedef {import('./engine.js').Placement} Placement */
/** The back end chosen for this page. @typedef {{name: 'webgpu', adapter: string, forced: boolean} | {name: 'wasm', reason: string}} Choice */
/** The part of navigator.gpu the page uses. @typedef {{requestAdapter: () => Promise<import('./gpucheck.js').Adapter | null>}} Gpu */
/** @typedef {import('./gpucheck.js').AdapterInfo} AdapterInfo */

export const BACKENDS = ['auto', 'webgpu', 'wasm'];
/** @type {Record<Backend, string>} */
const RUNTIMES = { webgpu: 'ort.webgpu.min.mjs', wasm: 'ort.wasm.min.mjs' }; // the WebGPU build also runs wasm sessions

/** The back end a page asks for with `?backend=auto|webgpu|wasm` (default auto). @param {string} search @returns {string} */
export function requestedBackend(search) {
  const value = new URLSearchParams(search).get('backend') || 'auto';
  if (!BACKENDS.includes(value))
    throw new EngineError(`?backend=${value} is not a back end`, `use one of ${BACKENDS.join(', ')}`);
  return value;
}

/**
 * {name: 'webgpu', adapter, forced} where WebGPU is asked for, or left to choose ('auto') and `gpu` (navigator.gpu)
 * gives a hardware adapter (gpucheck.js) and this browser's first step on it was not too slow (`remembered`: why
 * not); else {name: 'wasm', reason}. `forced`: asked for, so no first-step watch sends it back to WebAssembly.
 * @param {Gpu | undefined} gpu
 * @param {string} [requested]
 * @param {string | null} [remembered] why an earlier first step on the GPU sent this browser to WebAssembly
 * @returns {Promise<Choice>}
 */
export async function chooseBackend(gpu, requested = 'auto', remembered = null) {
  if (requested === 'wasm') return { name: 'wasm', reason: 'WebAssembly was asked for' };
  if (!gpu) return { name: 'wasm', reason: 'this browser has no WebGPU' };
  if (requested === 'auto' && remembered) return { name: 'wasm', reason: remembered };
  let adapter = null;
  try {
    adapter = await gpu.requestAdapter();
  } catch {
    adapter = null; // a browser that refuses (blocklisted GPU, policy) trains on the processor all the same
  }
  if (!adapter) return { name: 'wasm', reason: 'the browser gives no WebGPU adapter' };
  const software = softwareAdapter(adapter);
  if (requested === 'auto' && software) return { name: 'wasm', reason: softwareReason(software) };
  return { name: 'webgpu', adapter: adapterName(adapter.info), forced: requested === 'webgpu' };
}

/** The adapter as people know it: vendor, architecture and description where the browser tells them. */
export function adapterName(/** @type {AdapterInfo | undefined} */ info) {
  const parts = [info && info.vendor, info && info.architecture, info && info.description].filter(Boolean);
  return [...new Set(parts)].join(' ') || 'unnamed adapter';
}

/**
 * The WebAssembly threads a page trains with: one unless the page is cross-origin isolated (threads need
 * SharedArrayBuffer), else its cores up to four; with `freeThread` one core fewer, so the page's own thread keeps a
 * core for the motion readings while a step runs in the proxy worker (on the 2-core emulated phone of
 * docs/web-device.md the worker's two threads took both, and 17 % of the readings did not arrive while a round trained).
 * @param {boolean} isolated crossOriginIsolated
 * @param {number} cores navigator.hardwareConcurrency (0 where the browser does not say)
 * @param {boolean} freeThread the bundle's kind needs the page's thread free (kinds.js)
 * @returns {number}
 */
export function trainingThreads(isolated, cores, freeThread) {
  if (!isolated) return 1;
  return Math.max(1, Math.min(4, (cores || 1) - (freeThread ? 1 : 0)));
}

/**
 * Import the onnxruntime-web build that carries `backend` from `vendor` (a folder URL), its wasm files beside it.
 * With `freeThread`, WebAssembly graphs run in onnxruntime-web's proxy worker, off the page's thread: a step then
 * never holds up the page (a sensor bundle's motion readings come there at 60 Hz and would be lost while a step
 * ran). Without it they run on the page's thread, where a prediction between training steps comes sooner.
 * @param {Backend} backend
 * @param {URL} vendor
 * @param {boolean} [freeThread]
 * @returns {Promise<import('./engine.js').Ort>}
 */
export async function loadRuntime(backend, vendor, freeThread = false) {
  const ort = await import(new URL(RUNTIMES[backend], vendor).href);
  ort.env.wasm.wasmPaths = new URL(vendor).href;
  if (backend !== 'wasm' || !freeThread) return ort; // the proxy worker runs WebAssembly only
  ort.env.wasm.proxy = true;
  return keepingBuffers(ort);
}

/**
 * `ort` whose sessions are handed copies: the proxy worker takes (transfers) the buffers of a graph's bytes and of
 * a run's inputs, and the engine keeps using its own (its state, the person's samples, the bundle's graphs).
 * @param {import('./engine.js').Ort} ort
 * @returns {import('./engine.js').Ort}
 */
export function keepingBuffers(ort) {
  const { InferenceSession, Tensor } = ort;
  /** @type {typeof InferenceSession.create} */
  const create = async (/** @type {any} */ model, /** @type {any[]} */ ...rest) => {
    const session = await InferenceSession.create(model instanceof Uint8Array ? model.slice() : model, ...rest);
    const run = session.run.bind(session);
    /** @type {any} */ (session).run = (/** @type {Record<string, any>} */ feeds, /** @type {any[]} */ ...more) =>
      run(
        Object.fromEntries(
          Object.entries(feeds).map(([name, tensor]) => [
            name,
            new Tensor(tensor.type, tensor.data.slice(), tensor.dims),
          ]),
        ),
        ...more,
      );
    return session;
  };
  return /** @type {any} */ ({ ...ort, InferenceSession: { create } });
}

/** The page's line about the back end: where it trains, and each graph refused by the GPU with its reason. */
export function backendLine(
  /** @type {Choice} */ backend,
  /** @type {Map<string, Placement>} */ placements = new Map(),
) {
  if (backend.name !== 'webgpu')
    return `Training on the processor (WebAssembly${backend.reason ? `: ${backend.reason}` : ''}).`;
  const refused = [...placements].filter(([, placement]) => placement.backend !== 'webgpu');
  const line = `Training on the GPU (WebGPU: ${backend.adapter}).`;
  return refused.length
    ? `${line} On the processor instead: ${refused.map(([graph, p]) => `${graph} (${p.reason})`).join('; ')}.`
    : line;
}
