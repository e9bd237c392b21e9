// The records the page keeps for a text or sensor bundle (src/records.js) under fast-check (issue 55's rule): any
// value a browser's store could hand back (anything structured cloning keeps: objects without a prototype, own
// "__proto__" keys, typed arrays of every kind, NaN, sparse arrays, Maps, Dates) decodes to a valid value or throws
// the page's one error class (DeviceError); a record the page wrote decodes to what it wrote.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import fc from 'fast-check';
import { decodeSentence, decodeTyping, decodeWindow, sentenceRecord, windowRecord } from '../src/records.js';
import { LINE_BREAK } from '../src/text.js';
import { decodesOrRefuses, holds } from './fuzzing.mjs';

const SIZE = 12; // readings a window holds here (channels x steps)
const CLASSES = 3;

/** Values structured cloning keeps, nested, with the shapes of the page's records among them. */
const stored = fc.letrec((tie) => ({
  value: fc.oneof(
    { depthSize: 'small' },
    fc.anything({
      withNullPrototype: true,
      withTypedArray: true,
      withSparseArray: true,
      withMap: true,
      withDate: true,
    }),
    tie('record'),
  ),
  record: fc.oneof(
    fc.record({
      sentence: fc.oneof(fc.string({ unit: 'binary' }), fc.constantFrom('a\nb', 'a\u2028b', 'a\r', '\x1c')),
    }),
    fc.record({
      window: fc.oneof(
        fc.float32Array({ minLength: SIZE, maxLength: SIZE }),
        fc.float32Array({ maxLength: SIZE + 2 }),
        fc.float64Array({ minLength: SIZE, maxLength: SIZE }),
        fc.array(fc.double(), { minLength: SIZE, maxLength: SIZE }),
      ),
      label: fc.oneof(fc.integer({ min: -2, max: CLASSES + 1 }), fc.double(), fc.string(), fc.constant(null)),
    }),
    fc.record({
      words: fc.oneof(fc.nat(), fc.double(), fc.bigInt(), fc.string()),
      suggested: fc.oneof(fc.nat(), fc.integer({ min: -5, max: -1 }), fc.double()),
    }),
    fc.dictionary(fc.constantFrom('__proto__', 'sentence', 'window', 'label', 'words', 'constructor'), tie('value'), {
      maxKeys: 4,
    }),
  ),
}));

test('any stored value decodes to a valid sentence, window or measure, or throws a DeviceError', async () => {
  await holds('stored records', 3000, stored.value, (value) => {
    decodesOrRefuses(
      () => decodeSentence(value),
      (sentence) => assert.ok(typeof sentence === 'string' && !LINE_BREAK.test(sentence)),
    );
    decodesOrRefuses(
      () => decodeWindow(value, SIZE, CLASSES),
      ({ x, label }) => {
        assert.ok(x instanceof Float32Array && x.length === SIZE && x.every(Number.isFinite));
        assert.ok(Number.isInteger(label) && label >= 0 && label < CLASSES);
      },
    );
    decodesOrRefuses(
      () => decodeTyping(value),
      ({ words, suggested }) => {
        assert.ok(Number.isSafeInteger(words) && Number.isSafeInteger(suggested));
        assert.ok(suggested >= 0 && suggested <= words);
      },
    );
  });
});

test('a record the page wrote decodes to what it wrote', async () => {
  const line = fc.string({ unit: 'grapheme' }).filter((s) => !LINE_BREAK.test(s));
  const window = fc.float32Array({ minLength: SIZE, maxLength: SIZE, noNaN: true, noDefaultInfinity: true });
  await holds('written records', 500, fc.tuple(line, window, fc.nat(CLASSES - 1)), ([sentence, x, label]) => {
    assert.equal(decodeSentence(structuredClone(sentenceRecord(sentence))), sentence);
    const decoded = decodeWindow(structuredClone(windowRecord(x, label)), SIZE, CLASSES);
    assert.deepEqual([Array.from(decoded.x), decoded.label], [Array.from(x), label]);
  });
  assert.deepEqual(decodeTyping(undefined), { words: 0, suggested: 0 });
});
