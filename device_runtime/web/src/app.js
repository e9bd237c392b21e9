// @ts-check
// The device page's entry: read the device contract, enroll from the join link, load the bundle's portable
// graphs, then hand the round loop (runner.js, as device_runtime/runner.py runs it) to the page (ui.js).

import { backendLine, chooseBackend, loadRuntime, requestedBackend } from './backend.js';
import { fetchContract } from './contract.js';
import { emptyExamples } from './data.js';
import { openEngine, portableFiles } from './engine.js';
import { StartOver } from './errors.js';
import { ApiClient, Refusal } from './protocol.js';
import { DeviceRunner } from './runner.js';
import { sha256Hex } from './sha256.js';
import { openStore } from './store.js';
import { fatal, offerStartOver, pageEvents, renderHistory, setUpExamples, showBackend, showDevice, showProblem, stage, status } from './ui.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./store.js').Credentials} Credentials */
/** @typedef {Awaited<ReturnType<typeof openStore>>} Store */

const BUNDLE = '/device/bundle/';

main().catch(fatal);

async function main() {
  const locks = navigator.locks;
  if (!locks) return run();
  // one tab per browser trains: two would each train the same round from the same saved state
  return locks.request('edgepfl-device', { ifAvailable: true }, (lock) =>
    lock ? run() : stage('problem', showProblem({ problem: 'this device is already open in another tab of this browser', fix: 'close this tab, or close the other one and reload' })),
  );
}

async function run() {
  stage('loading', 'Opening the device…');
  const contract = await fetchContract(new URL('contract.json', import.meta.url)); // beside the page's modules
  const store = await openStore();
  try {
    await takePart(contract, store);
  } catch (err) {
    if (err instanceof StartOver) offerStartOver(store);
    throw err;
  }
}

/** Join, load the model and take part in rounds until the run is over. */
async function takePart(/** @type {Contract} */ contract, /** @type {Store} */ store) {
  const creds = await credentials(contract, store);
  if (!creds) return;
  const client = new ApiClient({ origin: location.origin, contract, token: creds.token, onRetry: status });
  stage('loading', 'Downloading the model…');
  /** @type {Manifest} */
  const manifest = JSON.parse(new TextDecoder().decode(await client.bytes(`${BUNDLE}manifest.json`)));
  const saved = await store.get('tensors', 'progress', 'history', 'examples', 'round');
  const layout = manifest.base_layout_hash;
  if ((saved.tensors && saved.tensors.layout !== layout) || (saved.progress && saved.progress.layout !== layout)) {
    throw new StartOver('this browser holds the state of another model than the one the server trains now', 'start over to join with the new model');
  }
  const files = await bundleFiles(store, client, manifest);
  const threads = crossOriginIsolated ? Math.max(1, Math.min(4, navigator.hardwareConcurrency || 1)) : 1;
  // the GPU where the browser gives a WebGPU adapter (?backend=wasm|webgpu overrides), else WebAssembly
  const gpu = /** @type {{gpu?: import('./backend.js').Gpu}} */ (/** @type {unknown} */ (navigator)).gpu; // WebGPU's types are not in TypeScript's dom lib
  const backend = await chooseBackend(gpu, requestedBackend(location.search));
  const ort = await loadRuntime(backend.name, new URL('./vendor/', import.meta.url));
  const placed = () => {
    showBackend(backend.name, backendLine(backend, engine.placements));
  };
  const engine = await openEngine(ort, manifest, files, { threads, backend: backend.name, onPlacement: placed });
  placed();
  if (saved.tensors) engine.setTensors(saved.tensors.tensors);
  showDevice(`Device ${creds.device} · ${threads} thread${threads > 1 ? 's' : ''}${crossOriginIsolated ? ' (cross-origin isolated)' : ''}`);
  const examples = setUpExamples({ store, manifest, contract, examples: saved.examples || emptyExamples(manifest.input.shape) });
  renderHistory(saved.history || []);
  if (saved.round) status(`Round ${saved.round.round} was interrupted; it starts again from its base.`);
  const sleep = (/** @type {number} */ seconds) => new Promise((resolve) => setTimeout(resolve, seconds * 1000));
  const runner = new DeviceRunner({ client, store, engine, contract, events: pageEvents, sleep, examples, saved });
  await runner.run();
}

/**
 * The device token: kept, or from the join link's fragment (#enroll=SECRET or #token=TOKEN), which is then cleared.
 * @param {Contract} contract
 * @param {Store} store
 * @returns {Promise<Credentials & {token: string} | null>}
 */
async function credentials(contract, store) {
  const fragment = new URLSearchParams(location.hash.slice(1));
  if (location.hash) history.replaceState(null, '', location.pathname + location.search); // off the address bar and the history
  let { creds } = await store.get('creds');
  const token = fragment.get('token');
  const secret = fragment.get('enroll');
  if (token && (!creds || creds.token !== token)) {
    creds = { device: 'token link', token };
    await store.commit({ creds });
  } else if (secret && !(creds && creds.token)) {
    creds = { device: (creds && creds.device) || `web-${randomHex(4)}`, key: (creds && creds.key) || randomHex(16), secret };
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
    stage('join', showProblem({ problem: 'this page has not joined a server yet', fix: "open the join link (or scan the QR code) from the server's /join page" }));
    return null;
  }
  return { ...creds, token: creds.token };
}

/**
 * The manifest's portable files (graphs, frozen variants, initial tensors), from the browser's cache or the server, sha256-checked.
 * @param {Store} store
 * @param {ApiClient} client
 * @param {Manifest} manifest
 */
async function bundleFiles(store, client, manifest) {
  const { required, variants } = portableFiles(manifest);
  const paths = [...required, ...variants];
  const listed = manifest.files || {};
  const keep = new Set(paths.map((path) => listed[path]));
  /** @type {Map<string, Uint8Array>} */
  const files = new Map();
  for (const [i, path] of paths.entries()) {
    const sha256 = listed[path];
    let bytes = sha256 && (await store.file(sha256));
    if (!bytes || (await sha256Hex(bytes)) !== sha256) {
      status(`Downloading the model (${i + 1} of ${paths.length})…`);
      bytes = await client.bytes(BUNDLE + path, sha256);
      if (sha256) await store.putFile(sha256, bytes, keep);
    }
    files.set(path, bytes);
  }
  return files;
}

function randomHex(/** @type {number} */ bytes) {
  return Array.from(crypto.getRandomValues(new Uint8Array(bytes)), (b) => b.toString(16).padStart(2, '0')).join('');
}
