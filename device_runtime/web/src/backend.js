// @ts-check
// Where the page trains: on the GPU through onnxruntime-web's WebGPU back end where the browser gives a hardware
// WebGPU adapter (or WebGPU is asked for), else on the processor through WebAssembly (gpucheck.js says why); the onnxruntime-web build that carries it; the line that
// says so. Which graphs the GPU then takes whole is the engine's business (sessions.js Sessions.open).

import { EngineError } from './engine.js';
import { softwareAdapter, softwareReason } from './gpucheck.js';
import { remoteRuntime } from './remote.js';

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
 * core for the motion readings while a step runs in the engine's worker (on the 2-core emulated phone of
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
 * The onnxruntime-web build that carries `backend`, from `vendor` (a folder URL), its wasm files beside it. With
 * `ownWorker` (a kind that needs the page's thread free: a sensor bundle's motion readings come there at 60 Hz) it
 * runs in a worker of the page's own (remote.js: a step never holds the page's thread, and a GPU step that never
 * returns is stopped by ending the worker); else on the page's thread, where a prediction between training steps
 * comes sooner (the keyboard's chips: docs/web-device.md). Photo and text bundles on WebGPU stay on the page's thread
 * too: in one clean-clone CI run of three, a WebGPU round of a photo bundle in the worker never finished on SwiftShader
 * (docs/web-device.md#the-engines-own-worker).
 * @param {Backend} backend
 * @param {URL} vendor
 * @param {boolean} [ownWorker]
 * @returns {Promise<import('./engine.js').Ort | import('./remote.js').RemoteOrt>}
 */
export async function loadRuntime(backend, vendor, ownWorker = false) {
  const url = new URL(RUNTIMES[backend], vendor).href;
  const wasmPaths = new URL(vendor).href;
  if (ownWorker) {
    const worker = new Worker(new URL('./runtime_worker.js', import.meta.url), { type: 'module' });
    return remoteRuntime(worker, url, wasmPaths, () => worker.terminate());
  }
  const ort = await import(url);
  ort.env.wasm.wasmPaths = wasmPaths;
  return ort;
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
