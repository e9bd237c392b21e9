// @ts-check
// Whether the page may train on the GPU the browser gives it. Left to choose (`auto`), the page takes WebGPU only
// from a hardware adapter: a software one (SwiftShader, llvmpipe, lavapipe) runs on the same processor as
// WebAssembly, slower, and under load its first round never finished. And on WebGPU chosen by `auto` the first
// training step is timed: when it has not finished FIRST_STEP_LIMIT seconds after the GPU's first work began, the
// page remembers why (for this browser) and reloads on WebAssembly. A reload is the one way to stop GPU work that
// never finishes without running the engine in a Worker; the page resumes after a reload (the round starts again).
// `?backend=webgpu` forces the GPU all the same, software or slow.

/** @typedef {import('./engine.js').Engine} Engine */
/** What a browser tells of its adapter. @typedef {{vendor?: string, architecture?: string, description?: string, device?: string, isFallbackAdapter?: boolean}} AdapterInfo */
/** An adapter as navigator.gpu gives it (isFallbackAdapter: older browsers tell it here, newer ones in info). @typedef {{info?: AdapterInfo, isFallbackAdapter?: boolean}} Adapter */
/** The part of Web Storage the page uses to remember a fallback. @typedef {{getItem: (key: string) => string | null, setItem: (key: string, value: string) => void}} Memory */
/** A watch over the first training step (watchFirstStep). @typedef {{began: () => void, stepped: () => void}} FirstStepWatch */

export const FIRST_STEP_LIMIT = 60; // seconds from the GPU's first work in a round to the end of its first step
export const FALLBACK_KEY = 'edgepfl-webgpu-fallback'; // localStorage: why this browser trains on the processor
const SOFTWARE = /swiftshader|llvmpipe|lavapipe|softpipe|warp|basic render|software/i; // renderers on the processor

/** Why `adapter` is a software renderer (the name it goes by), or null for a hardware GPU. @param {Adapter} adapter @returns {string | null} */
export function softwareAdapter(adapter) {
  const info = adapter.info || {};
  const named = [info.vendor, info.architecture, info.description, info.device].find((part) => part && SOFTWARE.test(part));
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
