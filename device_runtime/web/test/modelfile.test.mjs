// The page's own model file (src/modelfile.js) and "Try it" (Engine.predict): the file `edgepfl device export-model`
// writes for the same tensors, byte for byte, and the probabilities of `device predict` for the same photos.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as ort from 'onnxruntime-web';
import pngjs from 'pngjs';
import { classNames } from '../src/data.js';
import { openEngine, softmax, topClasses } from '../src/engine.js';
import { checkModelFile, deviceModelFile, metadataProps, readFields, writeFields } from '../src/modelfile.js';
import { toModelInput } from '../src/preprocess.js';
import {
  NEEDS_FIXTURES,
  expected,
  fixtureBundle,
  fixtureBytes,
  fixtureContract,
  fixtureTensors,
  maxAbsDiff,
} from './fixtures.mjs';

ort.env.wasm.numThreads = 1;
const { PNG } = pngjs;

/** The fixture's device after its round (statistics recomputed), as make_fixtures.py exported it. */
async function roundEngine() {
  const { manifest, files } = fixtureBundle();
  const engine = await openEngine(ort, manifest, files);
  engine.setTensors(fixtureTensors('recomputed.safetensors'));
  return { engine, manifest, files };
}

test("predict gives the Python engine's probabilities (softmax of the eval graph's logits)", {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { engine } = await roundEngine();
  const x = fixtureTensors('feeds.safetensors').xe; // more inputs than one graph batch
  const got = await engine.predict(x.data, x.shape[0]);
  const want = fixtureTensors('exported_expected.safetensors').engine;
  assert.equal(got.length, want.data.length);
  assert.ok(maxAbsDiff(got, want.data) <= 1e-6, `vs Python: ${maxAbsDiff(got, want.data)}`);
  // a snapshot keeps predicting with the tensors held when it was taken, whatever the engine holds next
  const held = await engine.snapshot();
  engine.setTensors(fixtureTensors('round_after.safetensors'));
  assert.deepEqual(await engine.predict(x.data, x.shape[0], held), got);
  assert.notDeepEqual(await engine.predict(x.data, x.shape[0]), got);
});

test('Try it on a photo: the probabilities and top classes of `edgepfl device predict` on the same file', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { engine, manifest } = await roundEngine();
  assert.equal(engine.predictGraph(1), 'predict');
  assert.equal(engine.predictGraph(engine.batchSize), 'eval');
  const want = fixtureTensors('photos_predicted.safetensors').probabilities;
  const classes = manifest.num_classes;
  for (const [i, file] of expected().images.files.entries()) {
    const png = PNG.sync.read(Buffer.from(fixtureBytes(file)));
    const input = toModelInput(
      new Uint8Array(png.data.buffer, png.data.byteOffset, png.data.length),
      png.width,
      png.height,
      manifest.input,
    );
    const got = await engine.predict(input, 1); // one photo: the one-sample predict graph
    const row = want.data.subarray(i * classes, (i + 1) * classes);
    assert.ok(maxAbsDiff(got, row) <= 1e-6, `${file}: ${maxAbsDiff(got, row)}`);
    const top = topClasses(got, classNames(manifest), 3);
    const order = Array.from(row.keys()).sort((a, b) => row[b] - row[a] || a - b);
    assert.deepEqual(
      top.map((t) => t.index),
      order.slice(0, 3),
      file,
    );
    assert.deepEqual(
      top.map((t) => t.name),
      order.slice(0, 3).map(String),
    );
  }
});

test('softmax and top classes: float64 softmax, ties to the lower class', () => {
  assert.deepEqual(Array.from(softmax([0, 0])), [0.5, 0.5]);
  assert.deepEqual(Array.from(softmax([1000, 0])), [1, 0]); // shifted by the maximum: no overflow
  const top = topClasses([0.1, 0.4, 0.4, 0.1], ['a', 'b', 'c', 'd'], 3);
  assert.deepEqual(
    top.map((t) => t.name),
    ['b', 'c', 'a'],
  );
  assert.equal(topClasses([1], ['only'], 5).length, 1);
});

test('the model file is byte for byte the one `device export-model` writes for the same tensors', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { engine, manifest, files } = await roundEngine();
  const contract = fixtureContract();
  const { description, trained, last_completed_round: lastCompletedRound } = expected().exported;
  const device = { trained, lastCompletedRound, description };
  const file = deviceModelFile(
    files.get('model.onnx'),
    await engine.getTensors(),
    manifest,
    contract.model_file,
    device,
  );
  const python = fixtureBytes('exported_none.onnx');
  assert.equal(file.length, python.length);
  assert.ok(Buffer.from(file).equals(Buffer.from(python)), 'the same bytes as Python');
  // and it computes the model: the engine's probabilities in onnxruntime-web
  const x = fixtureTensors('feeds.safetensors').xe;
  const worst = await checkModelFile(ort, file, engine, x.data, x.shape[0], contract.model_file);
  assert.ok(worst <= 1e-5, String(worst));
});

test('the model file of other tensors bakes them in; its metadata says which model it is', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { engine, manifest, files } = await roundEngine();
  const contract = fixtureContract();
  engine.setTensors(fixtureTensors('personal_after.safetensors'));
  const device = { trained: false, lastCompletedRound: null, description: 'untrained' };
  const file = deviceModelFile(
    files.get('model.onnx'),
    await engine.getTensors(),
    manifest,
    contract.model_file,
    device,
  );
  const session = await ort.InferenceSession.create(file);
  assert.deepEqual([session.inputNames, session.outputNames], [['input'], ['logits', 'probabilities']]);
  const x = fixtureTensors('feeds.safetensors').xe;
  const got = (await session.run({ input: new ort.Tensor('float32', x.data, x.shape) })).probabilities.data;
  assert.ok(maxAbsDiff(got, await engine.predict(x.data, x.shape[0])) <= 1e-5);
  const props = metadataProps(manifest, contract.model_file, device);
  assert.equal(props.get('trained'), 'false');
  assert.equal(props.get('last_completed_round'), '');
  assert.equal(
    props.get('class_names'),
    `[${classNames(manifest)
      .map((n) => `"${n}"`)
      .join(', ')}]`,
  );
  assert.deepEqual(
    [...props.keys()],
    contract.model_file.metadata.map(([key]) => key),
  );
  // Python's json.dumps (ensure_ascii) of class names and floats
  const named = {
    ...manifest,
    num_classes: 2,
    class_names: ['café', 'a"b\u{1F600}'],
    input: { ...manifest.input, mean: [1, 1e-5], std: [0.25, 2] },
  };
  const more = metadataProps(named, contract.model_file, device);
  assert.equal(more.get('class_names'), '["caf\\u00e9", "a\\"b\\ud83d\\ude00"]');
  assert.equal(more.get('mean'), '[1.0, 1e-05]');
  assert.equal(more.get('std'), '[0.25, 2.0]');
});

test('protobuf fields read and written again give the same bytes; damaged bytes are one clear error', {
  skip: NEEDS_FIXTURES,
}, () => {
  const { files } = fixtureBundle();
  const model = files.get('model.onnx');
  assert.ok(Buffer.from(writeFields(readFields(model))).equals(Buffer.from(model)));
  const fields = readFields(model);
  assert.deepEqual(
    fields.map((f) => f.number),
    [...fields.map((f) => f.number)].sort((a, b) => a - b),
    'protobuf writes fields in number order',
  );
  assert.throws(() => readFields(model.subarray(0, model.length - 3)), /cut short or damaged/);
  assert.throws(() => readFields(Uint8Array.of(0x0b)), /not a protobuf message/); // a group (wire type 3)
  const { manifest } = fixtureBundle();
  const renamed = {
    ...manifest,
    tensors: [...manifest.tensors, { name: 'not.there', role: 'base', block: 0, shape: [1], dtype: 'float32' }],
  };
  assert.throws(
    () =>
      deviceModelFile(model, {}, renamed, fixtureContract().model_file, {
        trained: false,
        lastCompletedRound: null,
        description: '',
      }),
    /does not name the model's tensors/,
  );
});
