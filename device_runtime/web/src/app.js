// The device page: enroll from the join link, load the bundle's portable graphs, collect examples, then take
// part in rounds as device_runtime/runner.py does: poll the task, train a round once, save everything with the
// upload in one transaction, upload those saved bytes (again after a reload), report metrics.

import { receive, roundUploads, runClientRound, travellingNames } from './algorithms.js';
import { backendLine, chooseBackend, loadRuntime, requestedBackend } from './backend.js';
import { appendExamples, classCounts, classNames, DEVICE_SEED, emptyExamples, readFolder, readNpz, readPhotos, splitExamples, splitSizes } from './data.js';
import { openEngine, portableFiles } from './engine.js';
import { baseDelta, decodeDownload, encodeWithFeedback, parseEncoding, uniformRandom, uploadsDelta } from './encoding.js';
import { API_PREFIX, ApiClient, encodeUpdate, Refusal, Unreachable } from './protocol.js';
import { decodeSafetensors } from './safetensors.js';
import { sha256Hex } from './sha256.js';
import { KEYS, openStore } from './store.js';

const BUNDLE = '/device/bundle/';
const MAX_WAIT = 60; // seconds between polls at most, whatever the server says (runner.py MAX_WAIT)
const OFFLINE_WAIT = 30; // seconds before trying again after the server stayed unreachable
const $ = (id) => document.getElementById(id);

main().catch(fatal);

async function main() {
  const locks = navigator.locks;
  if (!locks) return run();
  // one tab per browser trains: two would each train the same round from the same saved state
  return locks.request('edgepfl-device', { ifAvailable: true }, (lock) =>
    lock ? run() : stage('problem', problem('this device is already open in another tab of this browser', 'close this tab, or close the other one and reload')),
  );
}

async function run() {
  stage('loading', 'Opening the device…');
  const store = await openStore();
  const creds = await credentials(store);
  if (!creds) return;
  const client = new ApiClient({ origin: location.origin, token: creds.token, onRetry: (text) => status(text) });
  stage('loading', 'Downloading the model…');
  const manifest = JSON.parse(new TextDecoder().decode(await client.bytes(`${BUNDLE}manifest.json`)));
  const saved = await store.get(KEYS.tensors, KEYS.progress, KEYS.history, KEYS.examples, KEYS.round);
  const layout = manifest.base_layout_hash;
  if ((saved.tensors && saved.tensors.layout !== layout) || (saved.progress && saved.progress.layout !== layout)) {
    return startOverProblem(store, 'this browser holds the state of another model than the one the server trains now', 'start over to join with the new model');
  }
  const files = await bundleFiles(store, client, manifest);
  const threads = crossOriginIsolated ? Math.max(1, Math.min(4, navigator.hardwareConcurrency || 1)) : 1;
  // the GPU where the browser gives a WebGPU adapter (?backend=wasm|webgpu overrides), else WebAssembly
  const backend = await chooseBackend(navigator.gpu, requestedBackend(location.search));
  const ort = await loadRuntime(backend.name, new URL('./vendor/', import.meta.url));
  const showBackend = () => {
    document.body.dataset.backend = backend.name;
    $('backend').textContent = backendLine(backend, engine.placements);
  };
  const engine = await openEngine(ort, manifest, files, { threads, backend: backend.name, onPlacement: showBackend });
  showBackend();
  if (saved.tensors) engine.setTensors(saved.tensors.tensors);
  const device = {
    store, client, manifest, engine, layout,
    progress: saved.progress || { layout, lastCompletedRound: null, lastUploadedRound: null, pending: null },
    history: saved.history || [],
    examples: saved.examples || emptyExamples(manifest.input.shape),
  };
  $('device').textContent = `Device ${creds.device} · ${threads} thread${threads > 1 ? 's' : ''}${crossOriginIsolated ? ' (cross-origin isolated)' : ''}`;
  setUpExamples(device);
  renderHistory(device);
  if (saved.round) status(`Round ${saved.round.round} was interrupted; it starts again from its base.`);
  await roundLoop(device);
}

/** The device token: kept, or from the join link's fragment (#enroll=SECRET or #token=TOKEN), which is then cleared. */
async function credentials(store) {
  const fragment = new URLSearchParams(location.hash.slice(1));
  if (location.hash) history.replaceState(null, '', location.pathname + location.search); // off the address bar and the history
  let { creds } = await store.get(KEYS.creds);
  const token = fragment.get('token');
  const secret = fragment.get('enroll');
  if (token && (!creds || creds.token !== token)) {
    creds = { device: 'token link', token };
    await store.commit({ [KEYS.creds]: creds });
  } else if (secret && !(creds && creds.token)) {
    creds = { device: (creds && creds.device) || `web-${randomHex(4)}`, key: (creds && creds.key) || randomHex(16), secret };
    await store.commit({ [KEYS.creds]: creds }); // the key survives a reload, so a retried enrollment gets a token
  }
  if (creds && !creds.token && creds.secret) {
    stage('loading', 'Joining the server…');
    const client = new ApiClient({ origin: location.origin, onRetry: (text) => status(text) });
    let token;
    try {
      token = await client.enroll(creds.device, creds.key, creds.secret);
    } catch (err) {
      // a refused secret is not tried again at the next start (each wrong one counts against this address)
      if (err instanceof Refusal) await store.commit({ [KEYS.creds]: { device: creds.device, key: creds.key } });
      throw err;
    }
    creds = { device: creds.device, key: creds.key, token };
    await store.commit({ [KEYS.creds]: creds }); // the secret is not kept once the token is
  }
  if (!creds || !creds.token) {
    stage('join', problem('this page has not joined a server yet', "open the join link (or scan the QR code) from the server's /join page"));
    return null;
  }
  return creds;
}

/** The manifest's portable files (graphs, frozen variants, initial tensors), from the browser's cache or the server, sha256-checked. */
async function bundleFiles(store, client, manifest) {
  const { required, variants } = portableFiles(manifest);
  const paths = [...required, ...variants];
  const keep = new Set(paths.map((path) => manifest.files[path]));
  const files = new Map();
  for (const [i, path] of paths.entries()) {
    const sha256 = manifest.files[path];
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

async function roundLoop(device) {
  let told = '';
  for (;;) {
    try {
      if (!device.examples.count) {
        stage('examples', 'Add examples to take part in the next round.');
        await new Promise((resolve) => (device.examplesAdded = resolve));
        continue;
      }
      if (device.progress.pending) await deliverPending(device);
      const task = await device.client.task();
      if (task.base_layout_hash !== device.layout) {
        return startOverProblem(device.store, 'the server trains another model than the one this page loaded', 'reload the page; start over if that does not help');
      }
      if (task.action === 'done') return finish(device, task);
      const last = device.progress.lastCompletedRound;
      if (task.action === 'train' && task.round != null && (last == null || task.round > last) && (await trainRound(device, task))) continue;
      const waiting = task.action === 'train' ? `Round ${task.round} is trained on this device; waiting for the next round.` : 'Waiting for the next round…';
      if (waiting !== told) stage('waiting', waiting);
      told = waiting;
      await sleep(Math.min(task.retry_after || 5, MAX_WAIT));
    } catch (err) {
      if (!(err instanceof Unreachable)) throw err; // a refusal or a bad reply is shown once: the page stops
      stage('offline', problem(err.message, err.fix));
      told = '';
      await sleep(OFFLINE_WAIT);
    }
  }
}

/** Train round `task.round` once; false when the round was gone before training began. */
async function trainRound(device, task) {
  const { engine, manifest, store } = device;
  const roundId = task.round;
  const settings = task.settings || {};
  clearProblem();
  stage('training', `Round ${roundId}: fetching the shared model…`);
  await store.commit({ [KEYS.round]: { round: roundId, startedAt: Date.now() } });
  let baseBytes;
  try {
    baseBytes = await device.client.bytes(task.base_url || `${API_PREFIX}/rounds/${roundId}/base`);
  } catch (err) {
    if (err instanceof Refusal && err.roundGone) {
      status(`Round ${roundId} closed before training began; waiting for the next one.`);
      await store.commit({ [KEYS.round]: undefined });
      return false;
    }
    throw err;
  }
  const base = decodeDownload(baseBytes, settings.download_encoding, `the base of round ${roundId}`);
  const expected = travellingNames(manifest, settings);
  if (Object.keys(base).length !== expected.length || expected.some((name) => !(name in base))) {
    throw Object.assign(new Error(`the base of round ${roundId} holds other tensors than this model shares`), { fix: 'the server must run with the bundle this page loaded' });
  }
  const { train, val } = splitExamples(device.examples, manifest.input);
  // a tensor kept on the device (HeurpFedLA) keeps the value this device trained; BatchNorm statistics are
  // re-estimated under the new base
  await receive(engine, base, train, settings);
  const before = await evaluate(engine, val);
  const yielding = Object.create(engine);
  yielding.trainStep = async (...args) => {
    await nextTask(); // lets the page paint its progress and stay responsive between steps
    return engine.trainStep(...args);
  };
  const result = await runClientRound(yielding, train, settings, {
    seed: DEVICE_SEED,
    roundId,
    onProgress: ({ phase, step, steps, loss }) => showProgress(roundId, phase, step, steps, loss),
  });
  const after = await evaluate(engine, val);
  const valAccuracy = after.count ? after.correct / after.count : NaN;
  const valLoss = after.count ? after.lossSum / after.count : NaN;
  let pending = null;
  let residual;
  if (roundUploads(settings)) {
    const startValAccuracy = before.count ? before.correct / before.count : NaN; // the held model, as the round began
    const meta = { baseLayoutHash: device.layout, numSamples: result.numSamples, trainLoss: result.trainLoss, valAccuracy, valLoss, startValAccuracy };
    const trained = await engine.getTensors(travellingNames(manifest, settings));
    let payload;
    if (uploadsDelta(settings)) { // the base delta, encoded as the round asks, with what earlier rounds owe
      const before = (await store.get(KEYS.residual)).residual;
      const encoding = parseEncoding(settings.upload_encoding || 'fp32');
      const rng = encoding.stochastic ? uniformRandom([DEVICE_SEED, roundId]) : null;
      const encoded = encodeWithFeedback(baseDelta(trained, base), before, encoding, { rng, clipNorm: settings.clip_norm ?? null });
      payload = encodeUpdate(encoded.tensors, meta, encoded.metadata);
      residual = encoded.residual;
      pending = { round: roundId, payload, sha256: await sha256Hex(payload), residualBefore: before || null };
    } else {
      payload = encodeUpdate(trained, meta);
      pending = { round: roundId, payload, sha256: await sha256Hex(payload) };
    }
  }
  const record = {
    round: roundId,
    beforeAccuracy: before.count ? before.correct / before.count : null,
    accuracy: after.count ? valAccuracy : null,
    loss: after.count ? valLoss : null,
    samples: after.count,
    trainLoss: result.trainLoss,
    upload: pending ? 'pending' : 'none',
  };
  device.history = [...device.history, record];
  device.progress = { ...device.progress, lastCompletedRound: roundId, pending };
  // one transaction: the trained tensors, the round marked done, the upload's bytes and its residual, or none of them
  await store.commit({
    [KEYS.tensors]: { layout: device.layout, tensors: await engine.getTensors() },
    [KEYS.progress]: device.progress,
    [KEYS.history]: device.history,
    [KEYS.round]: undefined,
    ...(residual ? { [KEYS.residual]: residual } : {}),
  });
  renderHistory(device);
  if (pending) await deliverPending(device);
  else await postMetrics(device, record);
  return true;
}

/** Upload the saved bytes of the pending round (the same bytes after any reload), then its metrics. */
async function deliverPending(device) {
  const { pending } = device.progress;
  if ((await sha256Hex(pending.payload)) !== pending.sha256) {
    throw Object.assign(new Error(`the saved upload of round ${pending.round} does not match its sha256`), { fix: 'start over' });
  }
  stage('uploading', `Round ${pending.round}: sending the shared part of the model…`);
  let delivered = true;
  try {
    await device.client.upload(pending.round, pending.payload);
  } catch (err) {
    if (!(err instanceof Refusal && err.roundGone)) throw err;
    delivered = false;
    status(`Round ${pending.round} closed before the upload arrived; it is dropped, the device joins the next round.`);
  }
  const upload = delivered ? 'delivered' : 'dropped';
  device.history = device.history.map((r) => (r.round === pending.round ? { ...r, upload } : r));
  device.progress = { ...device.progress, pending: null, lastUploadedRound: delivered ? pending.round : device.progress.lastUploadedRound };
  // a dropped encoded upload owes nothing: the residual goes back to the one before it
  const restored = !delivered && 'residualBefore' in pending ? { [KEYS.residual]: pending.residualBefore || undefined } : {};
  await device.store.commit({ [KEYS.progress]: device.progress, [KEYS.history]: device.history, ...restored });
  renderHistory(device);
  if (delivered) await postMetrics(device, device.history.find((r) => r.round === pending.round));
}

/** Report the personalised model's held-out evaluation; advisory, so a failure only shows a note. */
async function postMetrics(device, record) {
  if (!record || record.accuracy == null || !record.samples) return;
  try {
    await device.client.postMetrics(record.round, { accuracy: record.accuracy, num_samples: record.samples, loss: record.loss });
  } catch (err) {
    if (!(err instanceof Refusal || err instanceof Unreachable)) throw err;
    status(`The metrics of round ${record.round} were not reported: ${err.message}`);
  }
}

/** The run is over: take the final base (if any) and show the personalised model's held-out accuracy. */
async function finish(device, task) {
  const { engine, manifest } = device;
  const { train, val } = device.examples.count ? splitExamples(device.examples, manifest.input) : { train: { count: 0 }, val: { count: 0 } };
  if (task.base_url) {
    const final = decodeSafetensors(await device.client.bytes(task.base_url), 'the final base').tensors;
    await receive(engine, final, train, task.settings || {});
    await device.store.commit({ [KEYS.tensors]: { layout: device.layout, tensors: await engine.getTensors() } });
  }
  const result = val.count ? await evaluate(engine, val) : { count: 0 };
  const shown = result.count ? `${pct(result.correct / result.count)} on ${result.count} held-out examples` : 'not measured (no held-out examples)';
  stage('done', `The run is over after round ${task.round ?? '–'}. Personalised accuracy: ${shown}.`);
}

async function evaluate(engine, part) {
  return part.count ? engine.evaluate(part.x, part.y, part.count) : { lossSum: 0, correct: 0, count: 0 };
}

function setUpExamples(device) {
  const { manifest } = device;
  const names = classNames(manifest);
  const select = $('class-select');
  select.replaceChildren(...names.map((name, i) => new Option(name, String(i))));
  const add = async (input, read) => {
    const files = input.files;
    if (!files || !files.length) return;
    try {
      status('Reading the examples…');
      const more = await read(files);
      device.examples = appendExamples(device.examples, more);
      await device.store.commit({ [KEYS.examples]: device.examples });
      clearProblem();
      status(`Added ${more.count} example${more.count === 1 ? '' : 's'}.`);
      renderExamples(device, names);
      if (device.examplesAdded) device.examplesAdded();
    } catch (err) {
      if (!err.fix) throw err;
      problem(err.message, err.fix);
    } finally {
      input.value = '';
    }
  };
  const photos = (input) => add(input, (files) => readPhotos(files, Number(select.value), manifest.input));
  $('camera').addEventListener('change', (event) => photos(event.target).catch(fatal));
  $('photos').addEventListener('change', (event) => photos(event.target).catch(fatal));
  $('folder').addEventListener('change', (event) => add(event.target, (files) => readFolder(files, manifest.input, manifest.num_classes)).catch(fatal));
  $('npz').addEventListener('change', (event) =>
    add(event.target, async (files) => readNpz(new Uint8Array(await files[0].arrayBuffer()), manifest.input, manifest.num_classes)).catch(fatal),
  );
  $('examples').hidden = false;
  renderExamples(device, names);
}

function renderExamples(device, names) {
  const counts = classCounts(device.examples, names.length);
  $('needs').textContent = `This model learns ${names.length} classes. Add labelled photos of each class you have; the more, the better.`;
  $('classes').replaceChildren(
    ...names.map((name, i) => {
      const item = document.createElement('li');
      item.textContent = `${name}: ${counts[i]}`;
      item.classList.toggle('missing', counts[i] === 0);
      return item;
    }),
  );
  const { count } = device.examples;
  if (!count) {
    $('split').textContent = '';
    return;
  }
  const { train, val } = splitSizes(count);
  $('split').textContent = `${count} examples: ${train} train on this device, ${val} are held out to measure it.`;
}

function renderHistory(device) {
  $('results').hidden = !device.history.length;
  $('history').replaceChildren(
    ...device.history.map((r) => {
      const row = document.createElement('tr');
      row.dataset.round = r.round;
      row.dataset.accuracy = r.accuracy ?? '';
      row.dataset.upload = r.upload;
      for (const text of [r.round, pct(r.beforeAccuracy), pct(r.accuracy), num(r.trainLoss), r.upload]) {
        const cell = document.createElement('td');
        cell.textContent = text;
        row.append(cell);
      }
      return row;
    }),
  );
}

function showProgress(roundId, phase, step, steps, loss) {
  Object.assign(document.body.dataset, { round: roundId, step }); // for people's tools and the browser test
  $('round').hidden = false;
  $('round-text').textContent = `Round ${roundId}: training (${phase}), step ${step} of ${steps}`;
  $('progress').max = steps;
  $('progress').value = step;
  $('loss').textContent = `loss ${num(loss)}`;
}

async function startOverProblem(store, text, fix) {
  stage('problem', problem(text, fix));
  const button = $('start-over');
  button.hidden = false;
  button.addEventListener('click', async () => {
    await store.clear();
    location.reload();
  });
}

function stage(name, text) {
  document.body.dataset.stage = name;
  if (text) status(text);
}

function status(text) {
  $('status').textContent = text;
}

/** Show a problem and its fix (once: it stays until something succeeds); returns the status line. */
function problem(text, fix) {
  $('problem').hidden = false;
  $('problem-text').textContent = text;
  $('problem-fix').textContent = fix ? `Fix: ${fix}` : '';
  return text;
}

function clearProblem() {
  $('problem').hidden = true;
}

function fatal(err) {
  stage('problem', problem((err && (err.problem || err.message)) || String(err), (err && err.fix) || 'reload the page'));
}

function pct(value) {
  return value == null || Number.isNaN(value) ? '–' : `${(100 * value).toFixed(1)}%`;
}

function num(value) {
  return value == null || Number.isNaN(value) ? '–' : value.toFixed(4);
}

function randomHex(bytes) {
  return Array.from(crypto.getRandomValues(new Uint8Array(bytes)), (b) => b.toString(16).padStart(2, '0')).join('');
}

function sleep(seconds) {
  return new Promise((resolve) => setTimeout(resolve, seconds * 1000));
}

function nextTask() {
  return new Promise((resolve) => setTimeout(resolve, 0));
}
