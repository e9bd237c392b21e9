// @ts-check
// The page's own worker that runs onnxruntime-web for the engine, on WebAssembly or WebGPU (remote.js is the page's
// side and says why). It holds the sessions and the tensors a WebGPU step leaves on the GPU; the page addresses them by
// number. Loaded as a module worker, it serves its own scope; tests serve a MessageChannel port in Node.

/** @typedef {import('./remote.js').Ort} Ort */
/** @typedef {import('./remote.js').Wire} Wire */
/** @typedef {import('onnxruntime-web').Tensor} OrtTensor */
/** @typedef {import('onnxruntime-web').InferenceSession} Session */
/** What a worker serves: a worker's scope or a MessagePort (remote.js's end of it, seen from the other side). @typedef {import('./remote.js').Port} Port */

/**
 * Answer the page's requests on `port`: {id, op, ...arguments} gets {id, result} or {id, error}. `load(url)` imports
 * the onnxruntime-web build at `url` (the first request names it and the wasm settings, applied before its first
 * session, as onnxruntime-web starts its runtime once).
 * @param {Port} port
 * @param {(url: string) => Promise<Ort>} load
 */
export function serve(port, load) {
  /** @type {Promise<Ort> | null} */
  let runtime = null;
  /** @type {Map<number, {ort: Ort, session: Session}>} */
  const sessions = new Map();
  /** @type {Map<number, OrtTensor>} tensors a step left on the GPU, by handle */
  const held = new Map();
  let next = 1;

  const found = (/** @type {Map<number, any>} */ map, /** @type {number} */ key, /** @type {string} */ what) => {
    const value = map.get(key);
    if (value === undefined) throw new Error(`the engine's worker holds no ${what} ${key}`);
    return value;
  };
  /** A result tensor for the page: its values, or a handle where it stays on the GPU. @returns {Wire} */
  const wire = (/** @type {OrtTensor} */ t) => {
    if (t.location !== 'gpu-buffer') return { type: t.type, dims: t.dims.slice(), data: t.data };
    const handle = next++;
    held.set(handle, t);
    return { type: t.type, dims: t.dims.slice(), handle };
  };

  /** @type {Record<string, (request: any) => any>} */
  const handlers = {
    async create({ url, wasm, bytes, options }) {
      runtime ??= load(url).then((ort) => {
        Object.assign(ort.env.wasm, wasm);
        return ort;
      });
      const ort = await runtime;
      const session = await ort.InferenceSession.create(bytes, options);
      const id = next++;
      sessions.set(id, { ort, session });
      return { session: id };
    },
    async run({ session, feeds, fetches }) {
      const { ort, session: opened } = found(sessions, session, 'session');
      /** @type {Record<string, OrtTensor>} */
      const inputs = {};
      for (const [name, given] of Object.entries(/** @type {Record<string, Wire>} */ (feeds)))
        inputs[name] = given.handle
          ? found(held, given.handle, 'tensor')
          : new ort.Tensor(given.type, given.data, given.dims);
      const results = await opened.run(inputs, fetches);
      return Object.fromEntries(Object.entries(results).map(([name, t]) => [name, wire(t)]));
    },
    async read({ handle, release }) {
      const data = await found(held, handle, 'tensor').getData(release);
      if (release) held.delete(handle);
      return { data };
    },
    dispose({ handle }) {
      const t = held.get(handle);
      held.delete(handle);
      if (t) t.dispose();
      return {};
    },
    async release({ session }) {
      await found(sessions, session, 'session').session.release();
      sessions.delete(session);
      return {};
    },
  };

  port.onmessage = async ({ data: { id, op, ...request } }) => {
    try {
      port.postMessage({ id, result: await handlers[op](request) });
    } catch (err) {
      port.postMessage({ id, error: err instanceof Error ? err.message : String(err) });
    }
  };
}

// a module worker of the page (not Node's test, which calls serve itself)
const scope = /** @type {any} */ (globalThis);
if (typeof scope.WorkerGlobalScope === 'function' && scope instanceof scope.WorkerGlobalScope)
  serve(scope, (url) => import(url));
