// The page's round loop (runner.js) in a secure round: it trains, keeps its clipped delta, and masks it through the
// round's steps against `edgepfl serve`'s round engine and three Python devices (secure_peer.py, each call a fresh
// engine over the same state folder); its update never travels, and the unmasked mean is the four devices' within
// the rounding. A page reloaded after each of its messages takes the steps again and is counted once.

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import * as ort from 'onnxruntime-web';
import { travellingNames } from '../src/algorithms.js';
import { openEngine } from '../src/engine.js';
import { photoSource } from '../src/kind_image.js';
import { DeviceRunner } from '../src/runner.js';
import { b64 } from '../src/secagg.js';
import { FIXTURES, NEEDS_FIXTURES, fixtureBundle, fixtureContract, fixtureTensors } from './fixtures.mjs';

const PYTHON = process.env.EDGEPFL_WEB_PYTHON || '';
const HERE = dirname(fileURLToPath(import.meta.url));
const SKIP = NEEDS_FIXTURES || (!PYTHON && 'EDGEPFL_WEB_PYTHON is unset: run scripts/web-env.sh');
const RELOADED = 'the tab was closed'; // what a page closed after a message "throws": the loop ends there

/** The server the page talks to: the peer's engine for the secure steps, its task and base for the round. */
function peerServer(folder, reloadAfter = null) {
  const peer = (step, argument) =>
    JSON.parse(
      execFileSync(PYTHON, [join(HERE, 'secure_peer.py'), folder, step], {
        input: JSON.stringify(argument),
        encoding: 'utf8',
      }),
    );
  const opened = peer('open', { bundle: join(FIXTURES, 'bundle') });
  const server = {
    peer,
    sent: [],
    uploads: 0,
    tasks: [opened.task],
    reloadAfter,
    async task() {
      return (
        server.tasks.shift() || {
          action: 'done',
          round: 1,
          base_url: null,
          base_layout_hash: opened.task.base_layout_hash,
        }
      );
    },
    basePath: (roundId) => `/v1/rounds/${roundId}/base`,
    async bytes() {
      return Uint8Array.from(Buffer.from(opened.base, 'base64'));
    },
    async upload() {
      server.uploads += 1;
    },
    async postMetrics() {},
    async secureSend(url, kind, body) {
      assert.equal(url, '/v1/rounds/1/secagg');
      const receipt = peer('send', typeof body === 'string' ? { kind, text: body } : { kind, bytes: b64(body) });
      server.sent.push([kind, receipt.duplicate]);
      if (server.reloadAfter === kind) {
        server.reloadAfter = null;
        throw new Error(RELOADED);
      }
      return receipt;
    },
    async secureFetch(_url, what) {
      return { text: peer('fetch', { what }).text, wait: 0.01 };
    },
  };
  return server;
}

function memoryStore() {
  const kv = new Map();
  return {
    kv,
    async get(...keys) {
      return Object.fromEntries(keys.map((key) => [key, structuredClone(kv.get(key))]));
    },
    async commit(changes) {
      for (const [key, value] of Object.entries(changes)) {
        if (value === undefined) kv.delete(key);
        else kv.set(key, structuredClone(value));
      }
    },
  };
}

/** The fixture's 26 seeded images as the page keeps them (channels first). */
function examples(/** @type {any} */ inputSpec) {
  const { images, labels } = fixtureTensors('round_data.safetensors');
  const [n, height, width, channels] = images.shape;
  const pixels = new Uint8Array(images.data.length);
  for (let i = 0; i < n; i++) {
    for (let p = 0; p < height * width; p++) {
      for (let c = 0; c < channels; c++)
        pixels[(i * channels + c) * height * width + p] = images.data[(i * height * width + p) * channels + c];
    }
  }
  const current = { pixels, labels: Int32Array.from(labels.data, Number), count: n, shape: [channels, height, width] };
  const never = () => Promise.reject(new Error('the examples never run out here'));
  return photoSource(() => current, never, inputSpec);
}

/** A page over `store` (what a reload finds in IndexedDB), its engine at the saved tensors. */
async function page(server, store) {
  const { manifest, files } = fixtureBundle();
  const engine = await openEngine(ort, manifest, files);
  const saved = await store.get('tensors', 'progress', 'history');
  if (saved.tensors) engine.setTensors(saved.tensors.tensors);
  const events = new Proxy({}, { get: () => () => {} });
  const runner = new DeviceRunner({
    client: server,
    store,
    engine,
    contract: fixtureContract(),
    events,
    sleep: async () => {},
    examples: examples(manifest.input),
    saved,
  });
  return { runner, engine, manifest };
}

async function secureRound(reloadAfter) {
  const folder = mkdtempSync(join(tmpdir(), 'edgepfl-secure-page-'));
  const server = peerServer(folder, reloadAfter);
  const store = memoryStore();
  const { manifest, files } = fixtureBundle();
  const base = await (await openEngine(ort, manifest, files)).getTensors(travellingNames(manifest, {}));
  let { runner, engine } = await page(server, store);
  if (reloadAfter) {
    await assert.rejects(runner.run(), new RegExp(RELOADED));
    assert.ok(store.kv.get('progress').pending.secure.session, 'the session is saved with the pending update');
    ({ runner, engine } = await page(server, store)); // reloaded: the pending round's steps again
  }
  await runner.run();
  assert.equal(server.uploads, 0, 'the update never travels');
  const names = travellingNames(manifest, {});
  const trained = await engine.getTensors(names);
  const delta = Object.fromEntries(
    names.map((name) => [name, Array.from(trained[name].data, (v, i) => v - base[name].data[i])]),
  );
  const result = server.peer('check', { delta, weight: 21 });
  assert.deepEqual([result.state, result.masked, result.dropped, result.uploads], ['closed', 4, 0, 0]);
  assert.ok(
    result.error <= result.bound,
    `the mean is off by ${result.error}, more than the rounding allows (${result.bound})`,
  );
  const progress = store.kv.get('progress');
  assert.deepEqual([progress.lastCompletedRound, progress.lastUploadedRound, progress.pending], [1, 1, null]);
  assert.deepEqual(
    store.kv.get('history').map((r) => [r.round, r.upload]),
    [[1, 'delivered']],
  );
  return server.sent;
}

test("the page masks its update with three Python devices, and the engine unmasks the four devices' mean", {
  skip: SKIP,
}, async () => {
  const sent = await secureRound(null);
  assert.deepEqual(sent, [
    ['advert', false],
    ['shares', false],
    ['masked', false],
    ['reveal', false],
  ]);
});

for (const kind of ['advert', 'shares', 'masked']) {
  test(`a page reloaded after its ${kind} message takes the steps again and is counted once`, {
    skip: SKIP,
  }, async () => {
    const sent = await secureRound(kind);
    const index = sent.findIndex(([k]) => k === kind);
    assert.deepEqual(sent[index], [kind, false]);
    // the reloaded page sends each message up to that one again, and the engine knows them all
    assert.deepEqual(
      sent.filter(([, duplicate]) => duplicate).map(([k]) => k),
      sent.slice(0, index + 1).map(([k]) => k),
    );
  });
}
