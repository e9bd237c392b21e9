// @ts-check
// Whether the page may train on the GPU the browser gives it. Left to choose (`auto`), the page takes WebGPU only
// from a hardware adapter: a software one (SwiftShader, llvmpipe, lavapipe) runs on the same processor as
// WebAssembly, slower, and under load its first round never finished. And on WebGPU chosen by `auto` the first
// training step is timed: when it has not finished FIRST_STEP_LIMIT seconds after the GPU's first work began, the
// page remembers why (for this browser) and trains on WebAssembly. Where the engine runs in a worker of the page's own
// (a sensor bundle's, remote.js) the worker is ended, which stops its GPU work, and the engine is rebuilt on
// WebAssembly in place (rebuild.js): the round goes on, and a recording under way with it. Elsewhere the page
// reloads on WebAssembly and resumes (the round starts again).
// A GPU that finishes its steps but trains slower than the processor is caught too: after GPU_STEPS_TIMED training
// steps on WebGPU, the same step is timed on a WebAssembly copy of the engine (its result thrown away, so the model
// trains on exactly the GPU's steps), and when the processor is WASM_MARGIN times faster the page remembers why and
// reloads on WebAssembly (steps have been trained by then, which a rebuild in place would have to carry over).
// `?backend=webgpu` forces the GPU all the same, software or slow.

/** @typedef {import('./engine.js').Engine} Engine */
/** What a browser tells of its adapter. @typedef {{vendor?: string, architecture?: string, description?: string, device?: string, isFallbackAdapter?: boolean}} AdapterInfo */
/** An adapter as navigator.gpu gives it (isFallbackAdapter: older browsers tell it here, newer ones in info). @typedef {{info?: AdapterInfo, isFallbackAdapter?: boolean}} Adapter */
/** The part of Web Storage the page uses to remember a fallback. @typedef {{getItem: (key: string) => string | null, setItem: (key: string, value: string) => void}} Memory */
/** A watch over the first training step (watchFirstStep). @typedef {{began: () => void, stepped: () => void}} FirstStepWatch */

export const FIRST_STEP_LIMIT = 60; // seconds from the GPU's first work in a round to the end of its first step
export const FALLBACK_KEY = 'edgepfl-webgpu-fallback'; // localStorage: why this browser trains on the processor
export const GPU_STEPS_TIMED = 4; // GPU training steps timed before the comparison; the first (shader compilation) is left out
export const WASM_MARGIN = 1.2; // how much faster WebAssembly must be to move there: timings of a few steps are noisy
const SOFTWARE = /swiftshader|llvmpipe|lavapipe|softpipe|warp|basic render|software/i; // renderers on the processor

/** Why `adapter` is a software renderer (the name it goes by), or null for a hardware GPU. @param {Adapter} adapter @returns {string | null} */
export function softwareAdapter(adapter) {
  const info = adapter.info || {};
  const named = [info.vendor, info.architecture, info.description, info.device].find(
    (part) => part && SOFTWARE.test(part),
  );
  if (named) return /** @type {RegExpMatchArray} */ (named.match(SOFTWARE))[0];
  if (adapter.isFallbackAdapter || info.isFallbackAdapter) return 'a fallback adapter';
  return null;
}

/** The page's words for not taking a software GPU. @param {string} name as softwareAdapter tells it */
export function softwareReason(name) {
  return `this browser's GPU is a software renderer (${name}) on the processor, slower than WebAssembly; ?backend=webgpu uses it all the same`;
}

/** The page's words for giving up on a GPU whose first step did not come. @param {number} seconds */
export function slowStepReason(seconds) {
  return `the GPU had not finished its first training step after ${seconds} s, so this browser trains on the processor from now on; ?backend=webgpu tries the GPU again`;
}

/** The page's localStorage, or undefined where the browser denies it. @returns {Memory | undefined} */
export function pageMemory() {
  try {
    return globalThis.localStorage;
  } catch {
    return undefined; // a sandboxed frame or a policy: the page then times the GPU on every load
  }
}

/** Why this browser trains on the processor, as an earlier slow first step left it; null when nothing is remembered. */
export function rememberedFallback(/** @type {Memory | undefined} */ memory) {
  try {
    return (memory && memory.getItem(FALLBACK_KEY)) || null;
  } catch {
    return null; // storage a browser denies (private mode, policy) remembers nothing: the next load times the GPU again
  }
}

/** Remember for this browser why it trains on the processor. */
export function rememberFallback(/** @type {Memory | undefined} */ memory, /** @type {string} */ reason) {
  try {
    if (memory) memory.setItem(FALLBACK_KEY, reason);
  } catch {
    // as above: without storage the page falls back for this load only
  }
}

/**
 * A watch that calls `onTooSlow(reason)` when the first step has not come `limit` seconds after `began()`;
 * `stepped()` ends it. Only the first round is watched: later ones run the same sessions, already proven.
 * @param {{limit?: number, setTimer: (run: () => void, ms: number) => unknown, clearTimer: (timer: any) => void, onTooSlow: (reason: string) => void}} parts
 * @returns {FirstStepWatch}
 */
export function watchFirstStep({ limit = FIRST_STEP_LIMIT, setTimer, clearTimer, onTooSlow }) {
  /** @type {unknown} */
  let timer = null;
  let over = false;
  return {
    began() {
      if (over || timer !== null) return;
      timer = setTimer(() => {
        over = true;
        onTooSlow(slowStepReason(limit));
      }, limit * 1000);
    },
    stepped() {
      if (timer !== null) clearTimer(timer);
      timer = null;
      over = true;
    },
  };
}

/**
 * Put `watch` on `engine`: its first graph run (a training or statistics step, an evaluation) begins the watch, its
 * first finished training step ends it. The engine's own methods are replaced on the instance, so `this` stays it.
 * @param {Engine} engine
 * @param {FirstStepWatch} watch
 */
export function guardFirstStep(engine, watch) {
  const { trainStep, statisticsStep, evaluate } = engine;
  /** @type {Engine['trainStep']} */
  engine.trainStep = async function (...args) {
    watch.began();
    const result = await trainStep.apply(engine, args);
    watch.stepped();
    return result;
  };
  /** @type {Engine['statisticsStep']} */
  engine.statisticsStep = async function (...args) {
    watch.began();
    return statisticsStep.apply(engine, args);
  };
  /** @type {Engine['evaluate']} */
  engine.evaluate = async function (...args) {
    watch.began();
    return evaluate.apply(engine, args);
  };
}

/**
 * Why this device should train on WebAssembly, or null: `gpuSeconds` are the first training steps on WebGPU (the
 * first, which compiles the shaders, is left out; the rest's median is the GPU's step), `wasmSeconds` one step of the
 * same graph on WebAssembly; the GPU loses when it is slower than `margin` times the processor.
 * @param {number[]} gpuSeconds
 * @param {number} wasmSeconds
 * @param {number} [margin]
 * @returns {string | null}
 */
export function slowerThanWasm(gpuSeconds, wasmSeconds, margin = WASM_MARGIN) {
  const steady = gpuSeconds.slice(1);
  if (
    !steady.length ||
    !steady.every((s) => Number.isFinite(s) && s >= 0) ||
    !(Number.isFinite(wasmSeconds) && wasmSeconds > 0)
  )
    return null;
  const gpu = median(steady);
  if (gpu <= margin * wasmSeconds) return null;
  return `on this device the GPU took ${spoken(gpu)} a training step and the processor ${spoken(wasmSeconds)}, so this browser trains on the processor from now on; ?backend=webgpu tries the GPU again`;
}

/**
 * Seconds of one training step (`args`, as trainStep takes them) on `wasm`, an engine of the same bundle on
 * WebAssembly given `engine`'s tensors; the second of two steps is timed, since the first opens the session. The
 * wasm engine's sessions are released after; `engine` is not changed (its GPU tensors are read back, unchanged).
 * @param {Engine} engine
 * @param {Engine} wasm
 * @param {Parameters<Engine['trainStep']>} args
 * @param {() => number} now seconds on a monotonic clock
 */
export async function wasmStepSeconds(engine, wasm, args, now) {
  try {
    const tensors = await engine.getTensors();
    wasm.setTensors(tensors, { exact: true });
    await wasm.trainStep(...args);
    wasm.setTensors(tensors, { exact: true }); // the same step again, on the same tensors
    const start = now();
    await wasm.trainStep(...args);
    return now() - start;
  } finally {
    await wasm.sessions.release(); // the copy's tensors stay readable
    await wasm.frozen.release();
  }
}

/**
 * Time `engine`'s first `steps` training steps (on WebGPU); then, where some graph runs on the GPU, `wasmSeconds`
 * (given the last step's arguments) times the same step on WebAssembly and `onSlower(reason)` is called when
 * slowerThanWasm says so. A comparison that fails (no memory for the wasm copy) keeps the GPU. The engine's own
 * trainStep is replaced on the instance.
 * @param {Engine} engine
 * @param {{steps?: number, now: () => number, wasmSeconds: (args: Parameters<Engine['trainStep']>) => Promise<number>, onSlower: (reason: string) => void}} parts
 */
export function guardGpuSpeed(engine, { steps = GPU_STEPS_TIMED, now, wasmSeconds, onSlower }) {
  const { trainStep } = engine;
  /** @type {number[]} */
  const gpu = [];
  /** @type {Engine['trainStep']} */
  engine.trainStep = async function (...args) {
    const start = now();
    const result = await trainStep.apply(engine, args);
    if (gpu.length >= steps) return result;
    gpu.push(now() - start);
    if (gpu.length < steps || ![...engine.placements.values()].some((p) => p.backend === 'webgpu')) return result;
    let wasm = NaN;
    try {
      wasm = await wasmSeconds(args);
    } catch {
      return result; // the comparison is an optimisation: without it the GPU, which works, keeps training
    }
    const reason = slowerThanWasm(gpu, wasm);
    if (reason) onSlower(reason);
    return result;
  };
}

/** The middle of `values` (the mean of the two middle ones for an even count). @param {number[]} values */
function median(values) {
  const sorted = values.slice().sort((a, b) => a - b);
  const half = Math.floor(sorted.length / 2);
  return sorted.length % 2 ? sorted[half] : (sorted[half - 1] + sorted[half]) / 2;
}

/** Seconds for a person: one decimal from a tenth of a second on, else milliseconds. @param {number} seconds */
function spoken(seconds) {
  return seconds >= 0.1 ? `${seconds.toFixed(1)} s` : `${Math.max(1, Math.round(seconds * 1000))} ms`;
}
