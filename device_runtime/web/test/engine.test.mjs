// The browser engine (onnxruntime-web under Node) against the Python portable engine on the same bundle and feeds.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as ort from 'onnxruntime-web';
import { openEngine, portableFiles } from '../src/engine.js';
import { stepUpdates } from '../src/manifest.js';
import { NEEDS_FIXTURES, expected, fixtureBundle, fixtureTensors, maxAbsDiff } from './fixtures.mjs';

const TOLERANCE = 1e-5;

async function freshEngine() {
  const { manifest, files } = fixtureBundle();
  return { manifest, engine: await openEngine(ort, manifest, files, { threads: 1 }) };
}

function assertTensorsClose(got, want, what) {
  assert.deepEqual(Object.keys(got).sort(), Object.keys(want).sort(), `${what}: tensor names`);
  for (const name of Object.keys(want)) {
    assert.deepEqual(got[name].shape, want[name].shape, `${what}: ${name} shape`);
    const diff = maxAbsDiff(got[name].data, want[name].data);
    assert.ok(diff <= TOLERANCE, `${what}: ${name} differs from Python by ${diff}`);
  }
}

test('full steps (a padded short batch, then a full one) equal Python for every parameter and buffer', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { engine } = await freshEngine();
  const feeds = fixtureTensors('feeds.safetensors');
  const want = expected();
  assert.equal(engine.batchSize, feeds.y2.shape[0]);
  const losses = [
    await engine.trainStep(feeds.x1.data, feeds.y1.data, feeds.y1.shape[0], want.lr, 'full'),
    await engine.trainStep(feeds.x2.data, feeds.y2.data, feeds.y2.shape[0], want.lr),
  ];
  assert.ok(maxAbsDiff(losses, want.full_losses) <= TOLERANCE, `losses ${losses} vs ${want.full_losses}`);
  const after = fixtureTensors('full_after.safetensors');
  assertTensorsClose(await engine.getTensors(), after, 'full');
  const initial = fixtureTensors('bundle/portable/initial.safetensors');
  // conv biases feeding BatchNorm get no gradient; every weight does
  for (const name of engine.namesByRole('base').filter((n) => n.endsWith('.weight'))) {
    assert.ok(maxAbsDiff(after[name].data, initial[name].data) > 0, `${name} trained`);
  }
  const result = await engine.evaluate(feeds.xe.data, feeds.ye.data, feeds.ye.shape[0]);
  assert.equal(result.count, want.eval_after_full.count);
  assert.equal(result.correct, want.eval_after_full.correct);
  assert.ok(Math.abs(result.lossSum - want.eval_after_full.loss_sum) <= TOLERANCE * result.count);
});

test('a personal step equals Python and leaves the base bit-identical', { skip: NEEDS_FIXTURES }, async () => {
  const { engine } = await freshEngine();
  const feeds = fixtureTensors('feeds.safetensors');
  const want = expected();
  const loss = await engine.trainStep(feeds.x1.data, feeds.y1.data, feeds.y1.shape[0], want.lr, 'personal');
  assert.ok(Math.abs(loss - want.personal_loss) <= TOLERANCE);
  const got = await engine.getTensors();
  assertTensorsClose(got, fixtureTensors('personal_after.safetensors'), 'personal');
  const initial = fixtureTensors('bundle/portable/initial.safetensors');
  for (const name of engine.namesByRole('base')) assert.deepEqual(got[name].data, initial[name].data, `${name} frozen`);
  for (const name of engine.namesByRole('personal'))
    assert.ok(maxAbsDiff(got[name].data, initial[name].data) > 0, `${name} trained`);
});

async function personalSteps(engine, feeds, lr, order) {
  const losses = [];
  for (const i of order)
    losses.push(
      await engine.trainStep(feeds[`x${i}`].data, feeds[`y${i}`].data, feeds[`y${i}`].shape[0], lr, 'personal'),
    );
  return losses;
}

test('from the third step on the same base the personal step runs its frozen variant, equal to Python and the base bit-identical', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { engine } = await freshEngine();
  const feeds = fixtureTensors('feeds.safetensors');
  const want = expected();
  const losses = await personalSteps(engine, feeds, want.lr, [1, 2, 1, 2]);
  assert.equal(engine.variantSteps, 2, 'steps 3 and 4 ran the variant');
  assert.ok(maxAbsDiff(losses, [want.personal_loss, ...want.personal_more_losses]) <= TOLERANCE, `losses ${losses}`);
  const got = await engine.getTensors();
  assertTensorsClose(got, fixtureTensors('personal_baked_after.safetensors'), 'personal, baked');
  const initial = fixtureTensors('bundle/portable/initial.safetensors');
  for (const name of engine.namesByRole('base')) assert.deepEqual(got[name].data, initial[name].data, `${name} frozen`);

  // a new base (as a round delivers) is not the one the variant was built on: two plain steps, then a new variant
  const base = await engine.getTensors(engine.namesByRole('base'));
  for (const t of Object.values(base))
    t.data.forEach((v, i) => {
      t.data[i] = v * 0.5;
    });
  engine.setTensors(base);
  await personalSteps(engine, feeds, want.lr, [1, 2]);
  assert.equal(engine.variantSteps, 2, 'no variant on a changed base before two plain steps');
  await personalSteps(engine, feeds, want.lr, [1]);
  assert.equal(engine.variantSteps, 3, 'rebuilt on the new base');
  const after = await engine.getTensors(engine.namesByRole('base'));
  for (const name of Object.keys(base))
    assert.deepEqual(after[name].data, base[name].data, `${name} is the received base`);
  await engine.release();
});

test('without its frozen variants (not downloaded, or bakeFrozen false) the engine gives the same numbers on the plain graphs', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { manifest, files } = fixtureBundle();
  const feeds = fixtureTensors('feeds.safetensors');
  const want = expected();
  const { variants } = portableFiles(manifest);
  assert.deepEqual(variants.sort(), ['portable/step_base_frozen.onnx', 'portable/step_personal_frozen.onnx']);
  const off = await openEngine(ort, manifest, files, { bakeFrozen: false });
  for (const path of variants) files.delete(path);
  const absent = await openEngine(ort, manifest, files);
  for (const engine of [off, absent]) {
    const losses = await personalSteps(engine, feeds, want.lr, [1, 2, 1, 2]);
    assert.equal(engine.variantSteps, 0);
    assert.ok(maxAbsDiff(losses, [want.personal_loss, ...want.personal_more_losses]) <= TOLERANCE, `losses ${losses}`);
    assertTensorsClose(
      await engine.getTensors(),
      fixtureTensors('personal_baked_after.safetensors'),
      'personal, plain',
    );
  }
});

test('a frozen variant that does not load is one EngineError naming it and the fix', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { manifest, files } = fixtureBundle();
  const feeds = fixtureTensors('feeds.safetensors');
  const path = manifest.engines.portable.steps.personal.frozen.model;
  const broken = files.get(path).slice(0, 100);
  files.set(path, broken);
  await assert.rejects(openEngine(ort, manifest, files), new RegExp(`bundle file ${path} has sha256`));
  delete manifest.files[path]; // a bundle without checksums: the bytes reach onnxruntime-web
  const engine = await openEngine(ort, manifest, files);
  await personalSteps(engine, feeds, 0.01, [1, 2]);
  await assert.rejects(personalSteps(engine, feeds, 0.01, [1]), (err) => {
    assert.equal(err.name, 'EngineError');
    assert.match(
      err.message,
      new RegExp(
        `the frozen variant ${path} does not load .* — re-export the bundle, or export it with --no-frozen-variants`,
      ),
    );
    assert.ok(!err.message.includes('\n'), 'one line');
    return true;
  });
});

test('evaluate of the initial model equals Python eval over two chunks', { skip: NEEDS_FIXTURES }, async () => {
  const { engine } = await freshEngine();
  const feeds = fixtureTensors('feeds.safetensors');
  const want = expected().eval_initial;
  const result = await engine.evaluate(feeds.xe.data, feeds.ye.data, feeds.ye.shape[0]);
  assert.equal(result.count, want.count);
  assert.equal(result.correct, want.correct);
  assert.ok(
    Math.abs(result.lossSum - want.loss_sum) <= TOLERANCE * result.count,
    `${result.lossSum} vs ${want.loss_sum}`,
  );
});

test('roles, trainable sets and tensor checks follow the manifest', { skip: NEEDS_FIXTURES }, async () => {
  const { manifest, engine } = await freshEngine();
  assert.deepEqual(engine.trainableSets(), ['full', 'personal', 'base']);
  assert.deepEqual(
    engine.namesByRole('personal'),
    manifest.tensors.filter((t) => t.role === 'personal').map((t) => t.name),
  );
  assert.ok(engine.namesByRole('buffer').every((n) => n.includes('running_')));
  const [name] = engine.namesByRole('personal');
  const copy = await engine.getTensors([name]);
  copy[name].data.fill(0.25);
  assert.notEqual((await engine.getTensors([name]))[name].data[0], 0.25, 'getTensors returns copies');
  engine.setTensors(copy);
  assert.equal((await engine.getTensors([name]))[name].data[0], 0.25);
  const shape = copy[name].shape;
  assert.throws(() => engine.setTensors({ nope: copy[name] }), /unknown tensor\(s\) nope/);
  assert.throws(() => engine.setTensors({ [name]: { ...copy[name], shape: [...shape, 1] } }), /has shape/);
  assert.throws(
    () => engine.setTensors({ [name]: { ...copy[name], dtype: 'float64', data: new Float64Array(copy[name].data) } }),
    /has dtype float64/,
  );
  const bad = copy[name].data.slice();
  bad[0] = NaN;
  assert.throws(() => engine.setTensors({ [name]: { ...copy[name], data: bad } }), /NaN or Inf/);
  const feeds = fixtureTensors('feeds.safetensors');
  const tooMany = new Float32Array(feeds.xe.data.subarray(0, (engine.batchSize + 1) * engine.sampleSize));
  await assert.rejects(
    engine.trainStep(tooMany, new Int32Array(engine.batchSize + 1), engine.batchSize + 1, 0.1),
    /exceeds the portable graphs' batch size/,
  );
  await assert.rejects(engine.trainStep(feeds.x1.data, feeds.y1.data, 2, 0.1), /inputs hold/);
  const badLabel = Int32Array.from(feeds.y1.data, Number);
  badLabel[3] = manifest.num_classes;
  await assert.rejects(
    engine.trainStep(feeds.x1.data, badLabel, badLabel.length, 0.1),
    new RegExp(`label ${manifest.num_classes} is not a class`),
  );
  await assert.rejects(engine.trainStep(feeds.x1.data, feeds.y1.data, feeds.y1.shape[0], NaN), /learning rate NaN/);
  await assert.rejects(
    engine.trainStep(feeds.x1.data, feeds.y1.data, feeds.y1.shape[0], 0.1, 'everything'),
    /no "everything" trainable set/,
  );
});

test('a bundle file that does not match the manifest sha256 is refused', { skip: NEEDS_FIXTURES }, async () => {
  const { manifest, files } = fixtureBundle();
  const graph = manifest.engines.portable.steps.full.model;
  const tampered = files.get(graph).slice();
  tampered[tampered.length - 1] ^= 1;
  files.set(graph, tampered);
  await assert.rejects(openEngine(ort, manifest, files), new RegExp(`bundle file ${graph} has sha256`));
  files.delete(graph);
  await assert.rejects(openEngine(ort, manifest, files), new RegExp(`bundle file ${graph} was not loaded`));
});

test('asked for WebGPU where there is none (Node), each graph runs on WebAssembly with the reason and the same numbers', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { manifest, files } = fixtureBundle();
  const heard = [];
  const engine = await openEngine(ort, manifest, files, {
    threads: 1,
    backend: 'webgpu',
    onPlacement: (path, placement) => heard.push([path, placement]),
  });
  const feeds = fixtureTensors('feeds.safetensors');
  const want = expected();
  const loss = await engine.trainStep(feeds.x1.data, feeds.y1.data, feeds.y1.shape[0], want.lr, 'personal');
  assert.ok(Math.abs(loss - want.personal_loss) <= TOLERANCE);
  assertTensorsClose(await engine.getTensors(), fixtureTensors('personal_after.safetensors'), 'personal');
  const step = manifest.engines.portable.steps.personal.model;
  assert.deepEqual(
    heard.map(([path]) => path),
    [step],
  );
  assert.equal(engine.placements.get(step).backend, 'wasm');
  assert.match(engine.placements.get(step).reason, /did not place every node on WebGPU/);
});

test('a graph the exporter found problems in is not tried on WebGPU: the problems are the reason', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { manifest, files } = fixtureBundle();
  manifest.engines.portable.eval.webgpu_problems = ['node n (LogSoftmax): no WebGPU kernel'];
  const engine = await openEngine(ort, manifest, files, { threads: 1, backend: 'webgpu' });
  const feeds = fixtureTensors('feeds.safetensors');
  const result = await engine.evaluate(feeds.xe.data, feeds.ye.data, feeds.ye.shape[0]);
  assert.equal(result.correct, expected().eval_initial.correct);
  assert.deepEqual(engine.placements.get(manifest.engines.portable.eval.model), {
    backend: 'wasm',
    reason: 'node n (LogSoftmax): no WebGPU kernel',
  });
  await assert.rejects(openEngine(ort, manifest, files, { backend: 'cuda' }), /unknown back end "cuda"/);
  // the WebGPU convolutions' layout: NCHW (the page's) or NHWC (bench/webgpu measures it), nothing else
  await assert.rejects(openEngine(ort, manifest, files, { layout: 'NWHC' }), /unknown layout "NWHC".*NCHW, NHWC/s);
});

test("a step graph's outputs map to the tensors its manifest entry names; a wrong entry is refused", () => {
  const graph = { model: 'portable/step_personal.onnx', inputs: [], outputs: ['loss', 'new_param:b', 'new_param:c'] };
  const names = ['a', 'b', 'c'];
  const updated = stepUpdates({ ...graph, updates: ['b', 'c'] }, names);
  assert.deepEqual([...updated.keys()], ['new_param:b', 'new_param:c']);
  assert.deepEqual([...updated.values()], ['b', 'c']);
  // a bundle from before `updates`: every state tensor has an output, in order
  assert.deepEqual([...stepUpdates(graph, names).values()], ['a', 'b']);
  for (const updates of [['b'], ['b', 'z'], 'bc']) {
    assert.throws(
      () => stepUpdates(/** @type {any} */ ({ ...graph, updates }), names),
      /step_personal.onnx's manifest entry does not name one of the bundle's tensors for each output/,
    );
  }
});
