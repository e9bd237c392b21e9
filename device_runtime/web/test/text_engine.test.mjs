// The browser engine on a text bundle: int64 token ids in (BigInt64Array), against the Python portable engine.

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import * as ort from 'onnxruntime-web';
import { openEngine } from '../src/engine.js';
import { decodeSafetensors } from '../src/safetensors.js';
import { FIXTURES, NEEDS_FIXTURES, bundleAt, maxAbsDiff } from './fixtures.mjs';

const TOLERANCE = 1e-5;
const TEXT = join(FIXTURES, 'text');
const tensors = (name) => decodeSafetensors(new Uint8Array(readFileSync(join(TEXT, name))), name).tensors;

test('a text bundle trains on int64 token ids as Python does, and predicts the same next-word logits', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { manifest, files } = bundleAt(join(TEXT, 'bundle'));
  assert.equal(manifest.input.dtype, 'int64');
  const engine = await openEngine(ort, manifest, files, { threads: 1 });
  const feeds = tensors('feeds.safetensors');
  assert.ok(feeds.x.data instanceof BigInt64Array);
  const want = JSON.parse(readFileSync(join(TEXT, 'expected.json'), 'utf8'));
  const count = feeds.y.shape[0];
  const loss = await engine.trainStep(feeds.x.data, feeds.y.data, count, want.lr, 'full');
  assert.ok(Math.abs(loss - want.loss) <= TOLERANCE, `loss ${loss} vs ${want.loss}`);
  const got = await engine.getTensors();
  const after = tensors('after.safetensors');
  for (const name of Object.keys(after)) {
    assert.ok(maxAbsDiff(got[name].data, after[name].data) <= TOLERANCE, `${name} differs from Python`);
  }
  const probabilities = await engine.predict(feeds.x.data, count);
  const classes = manifest.num_classes;
  assert.equal(probabilities.length, count * classes);
  for (let row = 0; row < count; row++) {
    const logits = want.logits.slice(row * classes, (row + 1) * classes);
    const top = Math.max(...logits);
    const total = logits.reduce((sum, v) => sum + Math.exp(v - top), 0);
    const expectedRow = logits.map((v) => Math.exp(v - top) / total);
    assert.ok(
      maxAbsDiff(probabilities.subarray(row * classes, (row + 1) * classes), expectedRow) <= TOLERANCE,
      `row ${row}`,
    );
  }
  // one phrase, as the keyboard asks: the predict graph, which applies the output layer at its last word only
  assert.equal(engine.predictGraph(1), 'predict');
  assert.deepEqual(manifest.engines.portable.predict?.outputs, ['logits']);
  const size = engine.sampleSize;
  for (let row = 0; row < count; row++) {
    const alone = await engine.predict(feeds.x.data.subarray(row * size, (row + 1) * size), 1);
    const together = probabilities.subarray(row * classes, (row + 1) * classes);
    assert.ok(maxAbsDiff(alone, together) <= TOLERANCE, `row ${row} alone`);
  }
  await assert.rejects(
    engine.trainStep(new Float32Array(feeds.x.data.length), feeds.y.data, count, want.lr),
    /BigInt64Array/,
  );
});
