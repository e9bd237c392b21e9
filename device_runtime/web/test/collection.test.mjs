// A text bundle's keyboard and what it keeps (src/keyboard.js, src/collection.js), on a fake page and store: a
// finished sentence is kept with the keyboard's measure; when the browser's storage is full the page says so in one
// line and the sentence goes back in the box, kept at the next Enter; a file of more lines than the phone keeps
// drops the oldest and says so; Forget erases the sentences and the measure.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { DeviceError } from '../src/errors.js';
import { MAX_SENTENCES, nextWordKind } from '../src/kind_next_word.js';
import { sha256Hex } from '../src/sha256.js';
import { fakeDocument } from './fakedom.mjs';

const WORDS = ['<pad>', '<oov>', '<bos>', '<eos>', 'hello', 'there', 'no', 'room', 'here'];
const CONTRACT = /** @type {any} */ ({
  device: { val_fraction: 0.2, split_seed: 0, min_train_examples: 8, min_held_out: 2 },
});

/** The page's store in memory; `full` makes every write fail as a browser out of quota does. */
function memoryStore() {
  const store = {
    full: false,
    kv: new Map(),
    records: /** @type {unknown[]} */ ([]),
    async get(/** @type {string[]} */ ...keys) {
      return Object.fromEntries(keys.map((key) => [key, structuredClone(store.kv.get(key))]));
    },
    async commit(/** @type {Record<string, unknown>} */ changes) {
      store.write(changes);
    },
    write(/** @type {Record<string, unknown>} */ changes) {
      if (store.full) {
        const fix =
          'free some storage on the phone, or remove examples (or forget what the page collected), then reload';
        throw new DeviceError("the browser could not save the device's state (QuotaExceededError)", fix);
      }
      for (const [key, value] of Object.entries(changes)) {
        if (value === undefined) store.kv.delete(key);
        else store.kv.set(key, structuredClone(value));
      }
    },
    async samples() {
      return structuredClone(store.records);
    },
    async addSamples(/** @type {unknown[]} */ records, /** @type {number} */ cap, changes = {}) {
      store.write(changes);
      store.records.push(...structuredClone(records));
      const dropped = Math.max(0, store.records.length - cap);
      store.records.splice(0, dropped);
      return dropped;
    },
    async clearSamples(changes = {}) {
      store.write(changes);
      store.records = [];
    },
  };
  return store;
}

const settle = async () => {
  for (let i = 0; i < 20; i++) await new Promise((resolve) => setTimeout(resolve, 0));
};

test('a full storage loses no sentence; the cap drops the oldest and says so; Forget erases all', async () => {
  const $ = fakeDocument();
  const vocab = new TextEncoder().encode(JSON.stringify({ format: 'edgepfl-vocab/1', words: WORDS }));
  const entry = {
    kind: 'next-word',
    vocab: 'vocab.json',
    vocab_sha256: await sha256Hex(vocab),
    vocab_size: 9,
    seq_len: 3,
  };
  const manifest = /** @type {any} */ ({
    num_classes: 9,
    input: { shape: [3] },
    sample: { ...entry, metric_ignores: [0, 1] },
  });
  const store = memoryStore();
  const page = await nextWordKind.open({
    manifest,
    store: /** @type {any} */ (store),
    contract: CONTRACT,
    bundleFile: async () => vocab,
  });
  const probabilities = Float32Array.from(WORDS, (_, i) => i / 100);
  const engine = /** @type {any} */ ({ sampleSize: 3, manifest, predict: async () => probabilities });
  let queue = Promise.resolve();
  page.tryIt({ engine, held: async () => new Map(), queue: (work) => (queue = queue.then(work)) });
  await settle();
  assert.deepEqual(JSON.parse($('chips').dataset.words), ['here', 'room', 'no']); // by the model's probability

  const box = $('writing');
  const type = (/** @type {string} */ text) => {
    box.value += text;
    box.dispatchEvent({ type: 'input' });
  };
  const enter = () => box.dispatchEvent({ type: 'keydown', key: 'Enter', preventDefault() {} });
  type('hello there. ');
  await settle();
  assert.deepEqual(store.records, [{ sentence: 'hello there.' }]);
  assert.deepEqual(store.kv.get('typing'), { words: 2, suggested: 0 });
  assert.equal($('typed-measure').textContent, 'Suggestions typed 0 of the 2 words you wrote here.');

  store.full = true; // the browser's storage is full: one line, and the sentence back in the box
  type('no room here');
  enter();
  await settle();
  assert.equal($('problem').hidden, false);
  assert.equal($('problem-text').textContent, "The browser could not save the device's state (QuotaExceededError)");
  assert.match($('problem-fix').textContent, /free some storage/);
  assert.equal(box.value, 'no room here');
  assert.equal(store.records.length, 1);
  store.full = false;
  enter();
  await settle();
  assert.deepEqual(store.records.at(-1), { sentence: 'no room here' });
  assert.equal(box.value, '');
  assert.equal($('problem').hidden, true, 'the problem goes once the sentence is kept');

  const many = Array.from({ length: MAX_SENTENCES }, (_, i) => `hello ${i}`).join('\n');
  Object.assign($('recording-file'), {
    files: [{ name: 'many.txt', arrayBuffer: async () => new TextEncoder().encode(many).buffer }],
  });
  $('recording-file').dispatchEvent({ type: 'change' });
  await settle();
  assert.equal(store.records.length, MAX_SENTENCES);
  assert.equal(
    $('status').textContent,
    `Kept ${MAX_SENTENCES} sentences of many.txt. The oldest 2 sentences went: this phone keeps the newest ${MAX_SENTENCES}.`,
  );
  assert.equal($('recording-held').dataset.records, String(MAX_SENTENCES));

  $('recording-forget').click();
  await settle();
  assert.deepEqual(
    [store.records.length, store.kv.has('typing'), $('recording-held').dataset.records],
    [0, false, '0'],
  );
});
