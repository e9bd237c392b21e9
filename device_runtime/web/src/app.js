// @ts-check
// The device page's entry: read the device contract, enroll from the join link (again from a fresh one when the
// server refuses the token), ask the browser to keep the page's data, load the bundle's portable graphs, then
// hand the round loop (runner.js, as device_runtime/runner.py runs it) to the page (ui.js, tryit.js).

import { backendLine, chooseBackend, loadRuntime, requestedBackend, trainingThreads } from './backend.js';
import {
  guardFirstStep,
  guardGpuSpeed,
  pageMemory,
  rememberFallback,
  rememberedFallback,
  wasmStepSeconds,
  watchFirstStep,
} from './gpucheck.js';
import { fetchContract } from './contract.js';
import { openEngine, personalSpec, portableFiles } from './engine.js';
import { rebuildable } from './rebuild.js';
import { DeviceError, StartOver } from './errors.js';
import { sampleKind } from './kinds.js';
import { ApiClient, Refusal } from './protocol.js';
import { DeviceRunner } from './runner.js';
import { sha256Hex } from './sha256.js';
import { openStore } from './store.js';
import { setUpTryIt } from './tryit.js';
import {
  fatal,
  offerStartOver,
  pageEvents,
  renderHistory,
  setUpReset,
  showBackend,
  showDevice,
  showProblem,
  showStorage,
  stage,
  status,
} from './ui.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./store.js').Credentials} Credentials */
/** @typedef {Awaited<ReturnType<typeof openStore>>} Store */

const BUNDLE = '/device/bundle/';
const INFERENCE_GRAPH = 'model.onnx'; // the bundle's inference graph: "save the model" bakes the device's tensors into it

main().catch(fatal);
// a join link opened in this tab while the page is open changes only the fragment: read it as a fresh start
addEventListener('hashchange', () => location.reload());

async function main() {
  const locks = navigator.locks;
  if (!locks) return run();
  // one tab per browser trains: two would each train the same round from the same saved state
  return locks.request('edgepfl-device', { ifAvailable: true }, (lock) =>
    lock
      ? run()
      : stage(
          'problem',
          showProblem({
            problem: 'this device is already open in another tab of this browser',
            fix: 'close this tab, or close the other one and reload',
          }),
        ),
  );
}

async function run() {
  stage('loading', 'Opening the device…');
  const contract = await fetchContract(new URL('contract.json', import.meta.url)); // beside the page's modules
  const store = await openStore();
  const joined = await credentials(contract, store);
  if (!joined) return;
  try {
    await takePart(contract, store, joined.creds);
  } catch (err) {
    if (err instanceof StartOver) offerStartOver(store);
    if (err instanceof Refusal && err.tokenRefused && joined.fresh) {
      // the server no longer knows this phone's token, and a fresh join link was opened: join again with it,
      // under a new name (the old one is the server's to keep); the examples and the model stay
      await store.commit({ creds: { device: `web-${randomHex(4)}`, key: randomHex(16), secret: joined.fresh } });
      location.reload();
      return;
    }
    throw err;
  }
}

/** Join, load the model and take part in rounds until the run is over. */
async function takePart(
  /** @type {Contract} */ contract,
  /** @type {Store} */ store,
  /** @type {Credentials & {token: string}} */ creds,
) {
  const client = new ApiClient({ origin: location.origin, contract, token: creds.token, onRetry: status });
  stage('loading', 'Downloading the model…');
  /** @type {Manifest} */
  const manifest = JSON.parse(new TextDecoder().decode(await client.bytes(`${BUNDLE}manifest.json`)));
  showStorage(await keepStorage());
  const saved = await store.get('tensors', 'progress', 'history', 'round');
  const layout = manifest.base_layout_hash;
  if ((saved.tensors && saved.tensors.layout !== layout) || (saved.progress && saved.progress.layout !== layout)) {
    throw new StartOver(
      'this browser holds the state of another model than the one the server trains now',
      'start over to join with the new model',
    );
  }
  const keep = new Set(Object.values(manifest.files || {})); // bundle files of this manifest stay cached
  const files = await bundleFiles(store, client, manifest, keep);
  status('Starting the model…');
  // the GPU where the browser gives a hardware WebGPU adapter (?backend=wasm|webgpu overrides), else WebAssembly
  const gpu = /** @type {{gpu?: import('./backend.js').Gpu}} */ (/** @type {unknown} */ (navigator)).gpu; // WebGPU's types are not in TypeScript's dom lib
  const memory = pageMemory();
  const backend = await chooseBackend(gpu, requestedBackend(location.search), rememberedFallback(memory));
  const sample = sampleKind(manifest); // the bundle's kind of sample: whether training must leave the thread free
  const threads = trainingThreads(crossOriginIsolated, navigator.hardwareConcurrency, sample.freeThread);
  const vendor = new URL('./vendor/', import.meta.url);
  const ort = await loadRuntime(backend.name, vendor, sample.freeThread);
  /** @type {import('./backend.js').Choice} */
  let shown = backend;
  const placed = () => {
    showBackend(shown.name, backendLine(shown, engine.placements));
  };
  const opened = await openEngine(ort, manifest, files, { threads, backend: backend.name, onPlacement: placed });
  // in its own worker, an engine whose first GPU step does not come is rebuilt on WebAssembly in place (rebuild.js)
  const { engine, rebuild } = 'stop' in ort ? rebuildable(opened) : { engine: opened, rebuild: () => false };
  placed();
  if (backend.name === 'webgpu' && !backend.forced) {
    // a GPU whose first step does not come: WebAssembly, saying why
    const onTooSlow = (/** @type {string} */ reason) => {
      rememberFallback(memory, reason);
      const inPlace = rebuild(async () => {
        if ('stop' in ort) ort.stop(); // the GPU's work ends with the worker; what it failed is made again on the new
        const wasm = await loadRuntime('wasm', vendor, true);
        return openEngine(wasm, manifest, files, { threads, backend: 'wasm', onPlacement: placed });
      });
      if (!inPlace) {
        location.reload();
        return;
      }
      shown = { name: 'wasm', reason };
      placed();
    };
    guardFirstStep(engine, watchFirstStep({ setTimer: setTimeout, clearTimer: clearTimeout, onTooSlow }));
    // a GPU that steps, but slower than the processor: one step of the same graph on a wasm copy, compared
    const now = () => performance.now() / 1000;
    const wasmSeconds = async (/** @type {Parameters<typeof engine.trainStep>} */ args) =>
      wasmStepSeconds(engine, await openEngine(engine.ort, manifest, files, { threads, backend: 'wasm' }), args, now);
    guardGpuSpeed(engine, { now, wasmSeconds, onSlower: onTooSlow });
  }
  if (saved.tensors) engine.setTensors(saved.tensors.tensors);
  showDevice(
    `Device ${creds.device} · ${threads} thread${threads > 1 ? 's' : ''}${crossOriginIsolated ? ' (cross-origin isolated)' : ''} · personal ${personalSpec(manifest)}`,
  );
  // the person's samples: how they are given, kept, split and tried is the bundle's kind's (kinds.js)
  const kind = await sample.open({
    manifest,
    store,
    contract,
    bundleFile: (path) => bundleFile(store, client, manifest, path, keep),
  });
  const examples = kind.examples;
  renderHistory(saved.history || []);
  let trained = Boolean(saved.tensors);
  /** @type {DeviceRunner | null} */
  let runner = null;
  const lastRound = () =>
    runner ? runner.progress.lastCompletedRound : saved.progress ? saved.progress.lastCompletedRound : null;
  const info = () => {
    const last = lastRound();
    const description = !trained
      ? "untrained: the bundle's initial model (this browser holds no trained model yet)"
      : `trained: this browser's model${last == null ? '' : ` after round ${last}`}`;
    return { trained, lastCompletedRound: last, description };
  };
  const inferenceGraph = () => bundleFile(store, client, manifest, INFERENCE_GRAPH, keep);
  const tryIt = setUpTryIt({ engine, contract, inferenceGraph, info, kind });
  setUpReset(store, () => ({
    examples: examples.count(),
    one: examples.words.sample ?? examples.words.one,
    rounds: (runner ? runner.history : saved.history || []).length,
  }));
  if (saved.round) status(`Round ${saved.round.round} was interrupted; it starts again from the shared model.`);
  const sleep = (/** @type {number} */ seconds) => new Promise((resolve) => setTimeout(resolve, seconds * 1000));
  const events = pageEvents(async () => {
    tryIt.modelChanged();
    trained = Boolean((await store.get('tensors')).tensors); // a saved round, or the run's final model
    tryIt.describeModel();
  });
  runner = new DeviceRunner({ client, store, engine, contract, events, sleep, examples, saved });
  await runner.run();
}

/**
 * The device token: kept, or from the join link's fragment (#enroll=SECRET or #token=TOKEN), which is then cleared;
 * `fresh` is a join link's secret opened while a token is held (it enrolls the phone again if the token is refused).
 * @param {Contract} contract
 * @param {Store} store
 * @returns {Promise<{creds: Credentials & {token: string}, fresh: string | null} | null>}
 */
async function credentials(contract, store) {
  const fragment = new URLSearchParams(location.hash.slice(1));
  if (location.hash) history.replaceState(null, '', location.pathname + location.search); // off the address bar and the history
  let { creds } = await store.get('creds');
  const token = fragment.get('token');
  const secret = fragment.get('enroll');
  const fresh = secret && creds && creds.token ? secret : null;
  if (token && (!creds || creds.token !== token)) {
    creds = { device: 'token link', token };
    await store.commit({ creds });
  } else if (secret && !(creds && creds.token)) {
    creds = {
      device: (creds && creds.device) || `web-${randomHex(4)}`,
      key: (creds && creds.key) || randomHex(16),
      secret,
    };
    await store.commit({ creds }); // the key survives a reload, so a retried enrollment gets a token
  }
  if (creds && !creds.token && creds.secret && creds.key) {
    stage('loading', 'Joining the server…');
    const client = new ApiClient({ origin: location.origin, contract, onRetry: status });
    let token;
    try {
      token = await client.enroll(creds.device, creds.key, creds.secret);
    } catch (err) {
      // a refused secret is not tried again at the next start (each wrong one counts against this address)
      if (err instanceof Refusal) await store.commit({ creds: { device: creds.device, key: creds.key } });
      throw err;
    }
    creds = { device: creds.device, key: creds.key, token };
    await store.commit({ creds }); // the secret is not kept once the token is
  }
  if (!creds || !creds.token) {
    stage(
      'join',
      showProblem({
        problem: 'this page has not joined a server yet',
        fix: 'open the join link (or scan the QR code) you were given',
      }),
    );
    return null;
  }
  return { creds: { ...creds, token: creds.token }, fresh };
}

/** Ask the browser to keep the page's data (the token, the model, the examples) when space runs low. */
async function keepStorage() {
  const storage = navigator.storage;
  if (!storage || !storage.persist) return false;
  try {
    return (await storage.persisted()) || (await storage.persist());
  } catch {
    return false;
  }
}

/**
 * The manifest's portable files (graphs, frozen variants, initial tensors), from the browser's cache or the server, sha256-checked.
 * @param {Store} store
 * @param {ApiClient} client
 * @param {Manifest} manifest
 * @param {Set<string>} keep the sha256 of the files that stay cached
 */
async function bundleFiles(store, client, manifest, keep) {
  const { required, variants } = portableFiles(manifest);
  const paths = [...required, ...variants];
  /** @type {Map<string, Uint8Array>} */
  const files = new Map();
  for (const [i, path] of paths.entries()) {
    files.set(
      path,
      await bundleFile(store, client, manifest, path, keep, `Downloading the model (${i + 1} of ${paths.length})…`),
    );
  }
  return files;
}

/**
 * One bundle file, from the browser's cache when its sha256 matches, else downloaded (and cached).
 * @param {Store} store
 * @param {ApiClient} client
 * @param {Manifest} manifest
 * @param {string} path
 * @param {Set<string>} keep
 * @param {string} [downloading] the headline while it downloads
 */
async function bundleFile(store, client, manifest, path, keep, downloading = '') {
  const sha256 = (manifest.files || {})[path];
  if (path === INFERENCE_GRAPH && !sha256) {
    throw new DeviceError(
      "this server's model cannot be saved as a file",
      'ask whoever runs the server to export the model again with this edgepfl version',
      'manifest.json lists no model.onnx',
    );
  }
  let bytes = sha256 && (await store.file(sha256));
  if (!bytes || (await sha256Hex(bytes)) !== sha256) {
    if (downloading) status(downloading);
    bytes = await client.bytes(BUNDLE + path, sha256);
    if (sha256) await store.putFile(sha256, bytes, keep);
  }
  return bytes;
}

function randomHex(/** @type {number} */ bytes) {
  return Array.from(crypto.getRandomValues(new Uint8Array(bytes)), (b) => b.toString(16).padStart(2, '0')).join('');
}
