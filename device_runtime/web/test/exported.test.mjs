// The model `edgepfl device export-model` writes (make_fixtures.py write_exported_models) in onnxruntime-web:
// plain inference without edgepfl, the same probabilities as onnxruntime in Python.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as ort from 'onnxruntime-web';
import { NEEDS_FIXTURES, fixtureBytes, fixtureTensors, maxAbsDiff } from './fixtures.mjs';

ort.env.wasm.numThreads = 1;

async function probabilities(file, x) {
  const session = await ort.InferenceSession.create(fixtureBytes(file));
  assert.deepEqual(session.inputNames, ['input']);
  assert.deepEqual(session.outputNames, ['logits', 'probabilities']);
  const feeds = { input: new ort.Tensor('float32', x.data, x.shape) };
  return (await session.run(feeds)).probabilities.data;
}

test("the exported fp32 model gives the device engine's probabilities", { skip: NEEDS_FIXTURES }, async () => {
  const x = fixtureTensors('feeds.safetensors').xe;
  const want = fixtureTensors('exported_expected.safetensors');
  const got = await probabilities('exported_none.onnx', x);
  assert.ok(maxAbsDiff(got, want.none.data) <= 1e-5, `vs onnxruntime: ${maxAbsDiff(got, want.none.data)}`);
  assert.ok(maxAbsDiff(got, want.engine.data) <= 1e-5, `vs the engine: ${maxAbsDiff(got, want.engine.data)}`);
});

test('the exported int8 model (QDQ) loads and agrees with onnxruntime in Python', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const x = fixtureTensors('feeds.safetensors').xe;
  const want = fixtureTensors('exported_expected.safetensors').int8.data;
  const got = await probabilities('exported_int8.onnx', x);
  // integer kernels of two builds may round a requantisation differently by one step: close, not identical
  assert.ok(maxAbsDiff(got, want) <= 0.02, `int8 vs onnxruntime: ${maxAbsDiff(got, want)}`);
});
