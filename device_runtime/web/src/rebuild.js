// @ts-check
// An engine that can be rebuilt on WebAssembly, in place, while its first training step has not finished: the page
// whose GPU step never returns stops the engine's worker and carries on, where it used to reload. Until then every
// call that changed the engine's state (its tensors set, a statistics step) is kept, so that a new engine given the
// same calls holds the same state; the calls the stopped worker failed are made again on it. After the first step
// nothing is kept and a rebuild is refused (the page reloads, as it does for a GPU slower than the processor).

/** @typedef {import('./engine.js').Engine} Engine */
/** A call that changed the engine's state, as it was made. @typedef {{method: 'setTensors' | 'statisticsStep', args: any[]}} Kept */

const GRAPH_CALLS = /** @type {const} */ ([
  'trainStep',
  'statisticsStep',
  'evaluate',
  'predict',
  'preparePredict',
  'getTensors',
  'snapshot',
]);

/**
 * `engine` behind a front the page uses in its place, and `rebuild(open)`, which moves the front onto the engine that
 * `open()` makes (after it stops the old one); false, and nothing done, once the first training step has finished.
 * A call under way that fails while a rebuild is under way is made again on the new engine.
 * @param {Engine} engine
 * @returns {{engine: Engine, rebuild: (open: () => Promise<Engine>) => boolean}}
 */
export function rebuildable(engine) {
  let current = engine;
  /** @type {Kept[] | null} */
  let kept = [];
  /** @type {Promise<void> | null} */
  let rebuilding = null;

  /** `method` on the current engine (the new one, once a rebuild is under way); made again on the new engine when
   * the old one failed it because it was stopped for the rebuild. */
  const retried = (/** @type {(typeof GRAPH_CALLS)[number]} */ method) =>
    async function (/** @type {any[]} */ ...args) {
      if (rebuilding !== null) await rebuilding;
      const called = current;
      let result;
      try {
        result = await /** @type {any} */ (called)[method](...args);
      } catch (err) {
        if (rebuilding === null) throw err;
        await rebuilding;
        if (current === called) throw err; // failed on the engine it has now: not the rebuild's doing
        result = await /** @type {any} */ (current)[method](...args);
      }
      // once the first step is done a rebuild would lose training: nothing more is kept
      if (method === 'trainStep') kept = null;
      else if (kept && method === 'statisticsStep') kept.push({ method, args });
      return result;
    };
  /** @type {Record<string, any>} */
  const own = Object.fromEntries(GRAPH_CALLS.map((method) => [method, retried(method)]));
  own.setTensors = (/** @type {any[]} */ ...args) => {
    /** @type {any} */ (current).setTensors(...args);
    if (kept) kept.push({ method: 'setTensors', args });
  };
  const front = /** @type {Engine} */ (
    new Proxy(/** @type {object} */ (own), {
      get(_, key) {
        if (Object.hasOwn(own, key)) return own[/** @type {string} */ (key)];
        const value = Reflect.get(current, key, current);
        return typeof value === 'function' ? value.bind(current) : value;
      },
      set(_, key, value, receiver) {
        // an object made on top of the front (Object.create) gets its own property, as it would from any prototype
        if (receiver !== front)
          return Reflect.defineProperty(receiver, key, { value, writable: true, enumerable: true, configurable: true });
        own[/** @type {string} */ (key)] = value; // a guard put on the front wraps the front's own method
        return true;
      },
    })
  );

  /** @param {() => Promise<Engine>} open */
  const rebuild = (open) => {
    if (kept === null || rebuilding !== null) return false;
    const calls = kept;
    rebuilding = (async () => {
      const next = await open();
      for (const { method, args } of calls) await /** @type {any} */ (next)[method](...args);
      current = next;
    })();
    return true;
  };
  return { engine: front, rebuild };
}
