// The page's decoders of server bytes under fast-check (issue 55's rule, as records_fuzz.test.mjs for the store): a
// safetensors file, the contract's round settings and the SecAgg+ messages the device receives decode to a valid
// value or throw the page's one error class (DeviceError, naming its problem and fix); never another error.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import fc from 'fast-check';
import { checkedSettings } from '../src/contract.js';
import { DeviceError } from '../src/errors.js';
import { encodeSafetensors, decodeSafetensors, numel } from '../src/safetensors.js';
import { checkPlan, vectorLength } from '../src/secagg_config.js';
import { b64, messageFromJson } from '../src/secagg_messages.js';
import { fixtureContract, NEEDS_FIXTURES } from './fixtures.mjs';
import { decodesOrRefuses, holds } from './fuzzing.mjs';

/** Stands for 1e999 until the text is written (JSON.parse reads it as Infinity; JSON.stringify writes Infinity as null). */
const INF = '<1e999>';
/** JSON text of `value`, with 1e999 where INF stood. */
const text = (/** @type {unknown} */ value) => (JSON.stringify(value) ?? '').replace(/"(-?)<1e999>"/g, '$11e999');

/** JSON values, with the numbers JSON.parse reads from hostile text (1e999 is Infinity) among them. */
const json = fc.letrec((tie) => ({
  value: fc.oneof(
    { depthSize: 'small' },
    fc.constantFrom(null, true, false, 0, -1, 1, 2, 3, 8, 33, 2 ** 31, INF, `-${INF}`, 0.5, '', 'all', 'auto', 'AAAA'),
    fc.double(),
    fc.integer(),
    fc.string({ maxLength: 12 }),
    fc.array(tie('value'), { maxLength: 4 }),
    fc.dictionary(fc.string({ maxLength: 10 }), tie('value'), { maxKeys: 4 }),
  ),
})).value;

/** What replaces a field: mostly the values decoders forget (null, Infinity, a number as text, the wrong type). */
const replacement = fc.oneof(
  {
    weight: 3,
    arbitrary: fc.constantFrom(null, INF, `-${INF}`, '', '0.5', [], {}, true, 0, -1, 2 ** 53, 64, 0.5, 2 ** 31),
  },
  { weight: 1, arbitrary: json },
);

/** Every path to a field of `value`, containers included: ['config'], ['config', 'bits'], ['adverts', '0'], ... */
function paths(/** @type {any} */ value, /** @type {string[]} */ prefix = []) {
  if (value === null || typeof value !== 'object') return [];
  return Object.keys(value).flatMap((key) => [[...prefix, key], ...paths(value[key], [...prefix, key])]);
}

/** A copy of `value` with the field at `path` replaced by `replacement`, dropped, or a sibling field added. */
function mutated(/** @type {any} */ value, /** @type {string[]} */ path, /** @type {unknown} */ replacement, how) {
  const copy = structuredClone(value);
  const parent = path.slice(0, -1).reduce((node, key) => node[key], copy);
  const last = path[path.length - 1];
  if (how === 'drop') delete parent[last];
  else if (how === 'add') parent[`${last}_`] = replacement;
  else parent[last] = replacement;
  return copy;
}

/** `value` with a field anywhere in it mutated. */
const mutations = (/** @type {any} */ value) =>
  fc
    .tuple(fc.constantFrom(...paths(value)), replacement, fc.constantFrom('replace', 'replace', 'drop', 'add'))
    .map(([path, replacement, how]) => mutated(value, path, replacement, how));

const key = (/** @type {number} */ fill) => b64(new Uint8Array(32).fill(fill));
const VALID_BOOK = {
  type: 'KeyBook',
  context: 'run/round-1',
  config: {
    clip_norm: 1.0,
    threshold: 0.5,
    neighbours: 'all',
    dropout: null,
    collusion: null,
    bits: null,
    max_weight: 1000,
    coordinate_sigmas: 4.0,
    weight_scale: null,
  },
  randomness: key(0),
  adverts: ['a', 'b', 'c', 'd'].map((device, i) => ({ device, cipher_key: key(2 * i + 1), mask_key: key(2 * i + 2) })),
  plan: { devices: 4, neighbours: 3, threshold: 2, min_survivors: 2, bits: 10 },
  base_size: 5,
};
const VALID = {
  KeyBook: VALID_BOOK,
  ShareInbox: { type: 'ShareInbox', device: 'a', sealed: { b: key(9), c: key(10) } },
  UnmaskRequest: { type: 'UnmaskRequest', survivors: ['a', 'b', 'c'], dropped: ['d'] },
};

/** Text a hostile server could send for a message: a valid one mutated, any JSON, or not JSON at all. */
const messageText = fc.oneof(
  { weight: 4, arbitrary: mutations(VALID_BOOK).map(text) },
  ...Object.values(VALID).map((message) => mutations(message).map(text)),
  json.map(text),
  fc.string(),
);

/** What the device does with a received key book before it shares: decode, check the plan, size its vector. */
function receiveBook(/** @type {string} */ text) {
  const book = messageFromJson(text, 'KeyBook');
  checkPlan(book);
  return { book, length: vectorLength(book) };
}

test('a received SecAgg+ message decodes to a valid message or throws a DeviceError', async () => {
  assert.equal(receiveBook(JSON.stringify(VALID_BOOK)).length, 8 + 2); // d' = 8 slots and the weight's 2 digits
  await holds('secagg messages', 3000, messageText, (text) => {
    decodesOrRefuses(
      () => receiveBook(text),
      ({ length }) => assert.ok(Number.isSafeInteger(length) && length > 0 && length < 2 ** 32),
    );
    for (const type of /** @type {const} */ (['ShareInbox', 'UnmaskRequest'])) {
      decodesOrRefuses(
        () => messageFromJson(text, type),
        (message) => assert.ok(message && typeof message === 'object'),
      );
    }
  });
});

/** Safetensors bytes: random, a valid file cut or with bytes flipped, or a header of any JSON. */
const VALID_FILE = encodeSafetensors(
  {
    w: { dtype: 'float32', shape: [2, 3], data: new Float32Array([1, 2, 3, 4, 5, 6]) },
    b: { dtype: 'int64', shape: [2], data: new BigInt64Array([1n, -1n]) },
  },
  { num_samples: '5' },
);
const VALID_HEADER = JSON.parse(
  new TextDecoder().decode(VALID_FILE.subarray(8, 8 + Number(new DataView(VALID_FILE.buffer).getBigUint64(0, true)))),
);
const header = (/** @type {string} */ text, /** @type {number} */ tail) => {
  const bytes = new TextEncoder().encode(text);
  const out = new Uint8Array(8 + bytes.length + tail);
  new DataView(out.buffer).setBigUint64(0, BigInt(bytes.length), true);
  out.set(bytes, 8);
  return out;
};
const safetensorsBytes = fc.oneof(
  fc.uint8Array({ maxLength: 64 }),
  fc.nat(VALID_FILE.length).map((cut) => VALID_FILE.slice(0, cut)),
  fc.array(fc.tuple(fc.nat(VALID_FILE.length - 1), fc.nat(255)), { minLength: 1, maxLength: 8 }).map((flips) => {
    const bytes = VALID_FILE.slice();
    for (const [at, value] of flips) bytes[at] = value;
    return bytes;
  }),
  fc.tuple(mutations(VALID_HEADER), fc.nat(64)).map(([value, tail]) => header(text(value), tail)),
  fc.tuple(json, fc.nat(64)).map(([value, tail]) => header(text(value), tail)),
);

test('any bytes decode to valid tensors or throw a DeviceError', async () => {
  await holds('safetensors', 3000, safetensorsBytes, (bytes) => {
    decodesOrRefuses(
      () => decodeSafetensors(bytes),
      ({ tensors }) => {
        for (const tensor of Object.values(tensors)) assert.equal(tensor.data.length, numel(tensor.shape));
      },
    );
  });
});

test("any task settings are the contract's valid settings or throw a DeviceError", {
  skip: NEEDS_FIXTURES,
}, async () => {
  const contract = fixtureContract();
  const defaults = Object.fromEntries(Object.entries(contract.settings).map(([name, spec]) => [name, spec.default]));
  const settings = fc.oneof(json, mutations(defaults));
  await holds('contract settings', 2000, settings, (value) => {
    decodesOrRefuses(
      () => checkedSettings(contract, value),
      (checked) => assert.ok(Number.isInteger(checked.epochs) && typeof checked.algorithm === 'string'),
    );
  });
});

test('regression: key books the fuzz found crash or hang the page are refused with one line', () => {
  const book = (/** @type {(b: any) => void} */ change) => {
    const copy = structuredClone(VALID_BOOK);
    change(copy);
    return text(copy);
  };
  const hostile = [
    book((b) => {
      b.config = null;
    }), // TypeError in checkPlan
    book((b) => {
      b.config.max_weight = INF;
    }), // Infinity: weightDigits never ends
    book((b) => {
      b.config.bits = 64;
      b.plan.bits = 64;
    }), // a ring wider than 32 bits
    book((b) => {
      b.config.threshold = '0.5';
    }), // text taken as a number
    book((b) => {
      b.base_size = 2 ** 60;
    }), // a masked vector no page can allocate
    book((b) => {
      b.plan = { ...b.plan, devices: '4' };
    }),
  ];
  for (const text of hostile) assert.throws(() => receiveBook(text), DeviceError, text.slice(0, 80));
});
