// The page's round loop (runner.js) with a fake server and an in-memory store over the real engine and the fixture
// bundle: one round trained, committed and uploaded once; a poisoned base and a diverged round refused with nothing
// saved or sent; settings outside the contract refused before any training; a round-gone upload dropped; a pending
// upload re-sent from its saved bytes after a reload; a refused base reported to the server; no round asked for
// below the contract's minimum of examples.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as ort from 'onnxruntime-web';
import { travellingNames } from '../src/algorithms.js';
import { openEngine } from '../src/engine.js';
import { DeviceError } from '../src/errors.js';
import { Refusal } from '../src/protocol.js';
import { heldOutCount, splitTrainVal } from '../src/algorithms.js';
import { examplesShortfall, shortfallLine, shortfallReason } from '../src/data.js';
import { imageKind, photoSource } from '../src/kind_image.js';
import { DeviceRunner } from '../src/runner.js';
import { decodeSafetensors, encodeSafetensors } from '../src/safetensors.js';
import { NEEDS_FIXTURES, fixtureBundle, fixtureContract, fixtureTensors } from './fixtures.mjs';

const SETTINGS = { algorithm: 'fedsim', epochs: 1, batch_size: 8, lr: 0.05 };
const NOT_THE_NETWORK = 'the tab was closed'; // what a killed page "throws": the loop ends where it is

/** A Python device's run: the fixture bundle's engine, 26 seeded images, an in-memory store, a scripted server. */
async function device({
  tasks,
  store = memoryStore(),
  base = null,
  upload = null,
  refusal = null,
  examples = null,
} = {}) {
  const contract = fixtureContract();
  const { manifest, files } = fixtureBundle();
  const engine = await openEngine(ort, manifest, files);
  const saved = await store.get('tensors', 'progress', 'history');
  if (saved.tensors) engine.setTensors(saved.tensors.tensors);
  const initial = await engine.getTensors();
  const server = fakeServer(
    tasks,
    base || encodeSafetensors(pick(initial, travellingNames(manifest, {}))),
    upload,
    refusal,
  );
  const calls = [];
  const events = new Proxy(
    {},
    {
      get:
        (_, name) =>
        (...args) =>
          calls.push([name, ...args]),
    },
  );
  const slept = [];
  examples =
    examples ||
    photoSource(
      () => EXAMPLES,
      () => Promise.reject(new Error('the examples never run out here')),
      manifest.input,
    );
  const runner = new DeviceRunner({
    client: server,
    store,
    engine,
    contract,
    events,
    sleep: async (s) => slept.push(s),
    examples,
    saved,
  });
  return {
    runner,
    engine,
    manifest,
    initial,
    server,
    store,
    calls,
    said: (name) => calls.filter((c) => c[0] === name).map((c) => c.slice(1)),
  };
}

/** The server as the page sees it: `tasks` in turn (then done), a base, uploads and metrics recorded. */
function fakeServer(tasks, baseBytes, upload, refusal) {
  const server = {
    fetched: [],
    uploads: [],
    metrics: [],
    refusals: [],
    polls: 0,
    async task() {
      server.polls += 1;
      const task = tasks.shift() || { action: 'done', round: 9, base_url: null };
      return { base_layout_hash: LAYOUT, settings: SETTINGS, retry_after: 0.2, ...task };
    },
    basePath: (roundId) => `/v1/rounds/${roundId}/base`,
    async bytes(path) {
      server.fetched.push(path);
      return baseBytes;
    },
    async upload(roundId, payload) {
      server.uploads.push({ roundId, payload: payload.slice() });
      if (upload) await upload(roundId);
      return { duplicate: false };
    },
    async postMetrics(roundId, metrics) {
      server.metrics.push({ roundId, ...metrics });
    },
    async reportRefusal(roundId, reason) {
      server.refusals.push([roundId, reason]);
      if (refusal) await refusal(roundId);
      return { accepted: true, round: roundId, duplicate: false, rolled_back: false };
    },
  };
  return server;
}

/** The store's contract (commit = one transaction) in memory: values are copied in and out, as IndexedDB does. */
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

const pick = (tensors, names) => Object.fromEntries(names.map((name) => [name, tensors[name]]));
const { manifest: MANIFEST } = NEEDS_FIXTURES ? { manifest: {} } : fixtureBundle();
const LAYOUT = MANIFEST.base_layout_hash;
const EXAMPLES = NEEDS_FIXTURES ? null : seededExamples();

/** The fixture's 26 seeded uint8 images (N,H,W,C) as the page keeps examples: channels first. */
function seededExamples() {
  const { images, labels } = fixtureTensors('round_data.safetensors');
  const [n, height, width, channels] = images.shape;
  const pixels = new Uint8Array(images.data.length);
  for (let i = 0; i < n; i++) {
    for (let p = 0; p < height * width; p++) {
      for (let c = 0; c < channels; c++)
        pixels[(i * channels + c) * height * width + p] = images.data[(i * height * width + p) * channels + c];
    }
  }
  return { pixels, labels: Int32Array.from(labels.data, Number), count: n, shape: [channels, height, width] };
}

function assertSameTensors(got, want) {
  assert.deepEqual(Object.keys(got).sort(), Object.keys(want).sort());
  for (const name of Object.keys(want)) assert.deepEqual(got[name].data, want[name].data, `${name} changed`);
}

test('a round trains, commits its tensors with the upload, uploads once and reports metrics', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { runner, engine, manifest, initial, server, store, said } = await device({
    tasks: [
      { action: 'train', round: 1 },
      { action: 'train', round: 1 },
    ],
  });
  await runner.run();
  assert.deepEqual(server.fetched, ['/v1/rounds/1/base']);
  assert.equal(server.uploads.length, 1);
  const { tensors, metadata } = decodeSafetensors(server.uploads[0].payload);
  assert.deepEqual(Object.keys(tensors).sort(), travellingNames(manifest, {}).sort());
  assert.equal(metadata.base_layout_hash, LAYOUT);
  assert.equal(Number(metadata.num_samples), 21); // 26 examples, 5 held out (the contract's val_fraction and seed)
  assert.deepEqual(
    server.metrics.map((m) => [m.roundId, m.num_samples]),
    [[1, 5]],
  );
  const progress = store.kv.get('progress');
  assert.deepEqual([progress.lastCompletedRound, progress.lastUploadedRound, progress.pending], [1, 1, null]);
  assert.deepEqual(
    store.kv.get('history').map((r) => [r.round, r.upload]),
    [[1, 'delivered']],
  );
  assertSameTensors(store.kv.get('tensors').tensors, await engine.getTensors());
  const trained = await engine.getTensors();
  assert.ok(
    travellingNames(manifest, {}).some((name) => trained[name].data.some((v, i) => v !== initial[name].data[i])),
    'the base trained',
  );
  assert.ok(!store.kv.has('round'), 'no round is left in progress');
  const stages = said('stage').map(([name]) => name);
  assert.deepEqual(
    stages.filter((s, i) => s !== stages[i - 1]),
    ['training', 'uploading', 'waiting', 'done'],
  );
  assert.equal(said('roundFinished').length, 1);
  const steps = said('step');
  assert.deepEqual([steps.length, steps.at(-1)[2], steps.at(-1)[3]], [3, 3, 3]); // ceil(21 / 8) steps of one epoch
  assert.deepEqual(
    said('roundStarted').map(([round, , total]) => [round, total]),
    [[1, 3]],
  );
});

test("the run's last line says which model was measured on what: a phone that never trained is told so", {
  skip: NEEDS_FIXTURES,
}, async () => {
  const late = await device({ tasks: [] }); // joined after training ended: the server says done at once
  await late.runner.run();
  const [, lateLine] = late.said('stage').at(-1);
  assert.match(
    lateLine,
    /^Training is over \(after round 9\): \d+\.\d% of the 5 examples kept aside are recognised by the shared model, which never trained on your examples \(this phone took part in no round\)\.$/,
  );
  const trained = await device({ tasks: [{ action: 'train', round: 1 }] });
  await trained.runner.run();
  const [, trainedLine] = trained.said('stage').at(-1);
  assert.match(trainedLine, /recognised by your model \(the final shared model with the part this phone trained\)\.$/);
});

test('a base holding NaN is refused: nothing is committed or sent, the model stays, the device waits', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { manifest, files } = fixtureBundle();
  const names = travellingNames(manifest, {});
  const poisoned = pick(await (await openEngine(ort, manifest, files)).getTensors(), names);
  poisoned[names[1]].data[3] = NaN;
  const tasks = [
    { action: 'train', round: 1 },
    { action: 'train', round: 1 },
    { action: 'wait', round: null },
  ];
  const { runner, engine, initial, server, store, said } = await device({ tasks, base: encodeSafetensors(poisoned) });
  await runner.run();
  assert.deepEqual(server.fetched, ['/v1/rounds/1/base'], 'the refused round is not fetched again');
  assert.deepEqual([server.uploads.length, server.metrics.length], [0, 0]);
  assert.deepEqual([...store.kv.keys()], [], 'nothing saved');
  assertSameTensors(await engine.getTensors(), initial);
  const [problem] = said('problem').map(([err]) => err);
  assert.ok(problem instanceof DeviceError && problem.fix, String(problem));
  assert.equal(
    problem.problem,
    'round 1 came with a broken shared model, so this phone skipped it and kept the model it had',
  );
  const reason = new RegExp(
    `^the base of round 1 holds NaN or Inf in "${names[1].replaceAll('.', '\\.')}": kept the model this page held and skipped the round$`,
  );
  assert.match(problem.detail, reason); // the Python device's words, for the server
  assert.deepEqual(
    server.refusals.map(([round]) => round),
    [1],
    'the server is told, once',
  );
  assert.match(server.refusals[0][1], reason);
  assert.equal(said('step').length, 0);
});

test('a diverged round (an absurd lr) is rolled back to the tensors before it: nothing pending, nothing uploaded', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const tasks = [
    { action: 'train', round: 1, settings: { ...SETTINGS, lr: 1e9 } },
    { action: 'train', round: 2 },
  ];
  const first = await device({ tasks: tasks.slice(0, 1) });
  await first.runner.run();
  assertSameTensors(await first.engine.getTensors(), first.initial);
  assert.deepEqual([first.server.uploads.length, first.server.metrics.length], [0, 0]);
  assert.deepEqual([...first.store.kv.keys()], [], 'nothing saved: no tensors, no progress, no pending upload');
  const [problem] = first.said('problem').map(([err]) => err);
  assert.match(
    problem.detail,
    /^training diverged in round 1 \((loss NaN|loss \d.*|NaN or Inf in ".+")\): kept the model this page held and skipped the round$/,
  );
  assert.match(problem.problem, /^round 1 went wrong while training/);
  assert.ok(!/--lr|operator/.test(problem.problem + problem.fix), 'the person is not told to change a server flag');
  assert.deepEqual(first.server.refusals, [[1, problem.detail]]);
  assert.ok(
    first.said('stage').some(([name, text]) => name === 'waiting' && text === problem.problem),
    'the person is told in words',
  );
  assert.ok(first.said('step').length > 0, 'it did train');
  // the next round trains from the tensors held before the diverged one
  const next = await device({ tasks: tasks.slice(1), store: first.store });
  await next.runner.run();
  assert.deepEqual(
    next.server.uploads.map((u) => u.roundId),
    [2],
  );
});

test('settings outside the contract are refused with one line before any training', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const cases = [
    [{ epochs: 1e6 }, /^the server's round settings are invalid: epochs 1000000 is not an integer in 0\.\.1000$/],
    [{ batch_size: 0 }, /^the server's round settings are invalid: batch_size 0 is not an integer in 1\.\.1048576$/],
    [
      { algorithm: 'fedprox' },
      /^the server's round settings are invalid: algorithm "fedprox" is not one of fedsim, fedalt, local$/,
    ],
  ];
  for (const [settings, line] of cases) {
    const { runner, server, store, said } = await device({
      tasks: [{ action: 'train', round: 1, settings: { ...SETTINGS, ...settings } }],
    });
    await assert.rejects(
      runner.run(),
      (err) =>
        err instanceof DeviceError && line.test(err.problem) && !err.message.includes('\n') && /operator/.test(err.fix),
    );
    assert.deepEqual(
      [server.fetched, server.uploads, [...store.kv.keys()], said('step')],
      [[], [], [], []],
      JSON.stringify(settings),
    );
  }
});

test('an upload refused as round gone is dropped and the device moves on to the next round', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const gone = async (roundId) => {
    if (roundId === 1)
      throw new Refusal(
        'POST',
        '/v1/rounds/1/update',
        409,
        { error: 'round_closed', detail: 'round 1 is closed', fix: 'poll' },
        true,
      );
  };
  const tasks = [
    { action: 'train', round: 1 },
    { action: 'train', round: 2 },
  ];
  const { runner, server, store, said } = await device({ tasks, upload: gone });
  await runner.run();
  assert.deepEqual(
    server.uploads.map((u) => u.roundId),
    [1, 2],
  );
  assert.deepEqual(
    store.kv.get('history').map((r) => [r.round, r.upload]),
    [
      [1, 'dropped'],
      [2, 'delivered'],
    ],
  );
  assert.deepEqual(
    server.metrics.map((m) => m.roundId),
    [2],
    'no metrics for a dropped round',
  );
  const progress = store.kv.get('progress');
  assert.deepEqual([progress.lastCompletedRound, progress.lastUploadedRound, progress.pending], [2, 2, null]);
  assert.ok(
    said('message').some(([text]) =>
      /^Round 1 closed before this phone's part arrived; it joins the next round/.test(text),
    ),
  );
});

test('a pending upload is re-sent from its saved bytes after a reload, and the round is not trained again', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const killed = async () => {
    throw new Error(NOT_THE_NETWORK);
  };
  const first = await device({ tasks: [{ action: 'train', round: 1 }], upload: killed });
  await assert.rejects(first.runner.run(), new RegExp(NOT_THE_NETWORK));
  const pending = first.store.kv.get('progress').pending;
  assert.equal(pending.round, 1);
  assert.deepEqual(pending.payload, first.server.uploads[0].payload, 'the bytes sent are the bytes saved');
  // the page is opened again: a new engine from the saved tensors, the same store
  const again = await device({ tasks: [{ action: 'train', round: 1 }], store: first.store });
  assertSameTensors(await again.engine.getTensors(), await first.engine.getTensors());
  await again.runner.run();
  assert.deepEqual(again.server.fetched, [], 'round 1 is not trained twice');
  assert.equal(again.server.uploads.length, 1);
  assert.deepEqual(again.server.uploads[0].payload, first.server.uploads[0].payload);
  assert.deepEqual(
    again.store.kv.get('history').map((r) => [r.round, r.upload]),
    [[1, 'delivered']],
  );
  assert.equal(again.store.kv.get('progress').pending, null);
  assert.deepEqual(
    again.server.metrics.map((m) => m.roundId),
    [1],
  );
});

test('a refusal the server cannot take (or that finds no connection) is a note: the device goes on', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const tasks = [
    { action: 'train', round: 1, settings: { ...SETTINGS, lr: 1e9 } },
    { action: 'train', round: 2 },
  ];
  const refusal = async () => {
    throw new Refusal('POST', '/v1/rounds/1/refusal', 403, { error: 'not_sampled', detail: 'no', fix: '' }, false);
  };
  const { runner, server, said } = await device({ tasks, refusal });
  await runner.run();
  assert.deepEqual(
    server.refusals.map(([round]) => round),
    [1],
  );
  assert.deepEqual(
    server.uploads.map((u) => u.roundId),
    [2],
    'round 2 trains as usual',
  );
  assert.ok(said('message').some(([text]) => /^The server was not told that round 1 was skipped/.test(text)));
});

test("below the contract's minimum of examples the device asks for no round and says how many more it needs", {
  skip: NEEDS_FIXTURES,
}, async () => {
  const contract = fixtureContract();
  const { words } = imageKind;
  const { min_train_examples: train, min_held_out: heldOut } = contract.device;
  assert.deepEqual([train, heldOut], [8, 2]); // device_runtime/contract.py
  assert.equal(examplesShortfall(0, contract.device), 10);
  assert.equal(examplesShortfall(9, contract.device), 1);
  assert.equal(examplesShortfall(10, contract.device), 0);
  assert.equal(examplesShortfall(500, contract.device), 0);
  assert.equal(
    examplesShortfall(3, { ...contract.device, val_fraction: 0 }),
    5,
    'nothing is held out: only the training minimum counts',
  );
  for (let n = 0; n < 40; n++) {
    const more = examplesShortfall(n, contract.device);
    const { train: t, val: v } = splitTrainVal(n + more, contract.device.val_fraction, 0);
    assert.ok(t.length >= train && v.length >= heldOut, `${n} + ${more}`);
    if (more)
      assert.ok(
        splitTrainVal(n + more - 1, contract.device.val_fraction, 0).train.length < train ||
          heldOutCount(n + more - 1, 0.2) < heldOut,
      );
  }
  assert.equal(shortfallLine(7, contract.device, words), 'Add 3 more examples to take part in the rounds.');
  assert.equal(shortfallLine(0, contract.device, words), 'Add 10 examples to take part in the rounds.');
  assert.equal(
    shortfallReason(7, contract.device, words),
    'The model needs 10 examples: 8 to learn from and 2 kept aside to check how well it does.',
  );
  assert.deepEqual([shortfallLine(10, contract.device, words), shortfallReason(10, contract.device, words)], ['', '']);

  // nine examples: no task is asked for until a tenth arrives
  let current = {
    ...EXAMPLES,
    count: 9,
    pixels: EXAMPLES.pixels.subarray(0, (9 * EXAMPLES.pixels.length) / EXAMPLES.count),
    labels: EXAMPLES.labels.subarray(0, 9),
  };
  let addMore;
  const more = () => new Promise((resolve) => (addMore = resolve));
  const examples = photoSource(() => current, more, MANIFEST.input);
  const { runner, server, said } = await device({ tasks: [{ action: 'train', round: 1 }], examples });
  const running = runner.run();
  await new Promise((resolve) => setTimeout(resolve, 50));
  assert.equal(server.polls, 0, 'no round is asked for');
  assert.deepEqual(said('stage').at(-1), ['examples', 'Add 1 more example to take part in the rounds.']);
  current = EXAMPLES;
  addMore();
  await running;
  assert.deepEqual(
    server.uploads.map((u) => u.roundId),
    [1],
  );
});
