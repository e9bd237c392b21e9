// An engine rebuilt in place (rebuild.js): its worker's first training step never returns, the page stops the worker
// and moves onto a WebAssembly engine, and the step it was waiting for comes out as an engine that never hung would
// give it; after the first step no rebuild is offered.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as ort from 'onnxruntime-web';
import { openEngine } from '../src/engine.js';
import { rebuildable } from '../src/rebuild.js';
import { remoteRuntime } from '../src/remote.js';
import { serve } from '../src/runtime_worker.js';
import { NEEDS_FIXTURES, expected, fixtureBundle, fixtureTensors } from './fixtures.mjs';

/** onnxruntime-web whose graph runs never return after the first `answered` (a GPU that hangs mid-round). */
function hangingAfter(answered) {
  let runs = 0;
  const never = new Promise(() => {});
  const create = async (/** @type {any[]} */ ...args) => {
    const session = await ort.InferenceSession.create(...args);
    return {
      run: (/** @type {any[]} */ ...runArgs) => (++runs > answered ? never : session.run(...runArgs)),
      release: () => session.release(),
    };
  };
  return { ...ort, env: { wasm: {} }, InferenceSession: { create } }; // the page's wasm settings stay its own
}

/** An engine of the fixture bundle on `runtime`. */
async function opened(runtime) {
  const { manifest, files } = fixtureBundle();
  return openEngine(runtime, manifest, files, { threads: 1 });
}

test('a first step that never returns finishes on the rebuilt engine as on one that never hung', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const feeds = fixtureTensors('feeds.safetensors');
  const { lr } = expected();
  const batch = (/** @type {number} */ i) => [feeds[`x${i}`].data, feeds[`y${i}`].data, feeds[`y${i}`].shape[0]];
  const reference = await opened(ort);
  const given = await reference.getTensors();
  for (const tensor of Object.values(given)) tensor.data = tensor.data.map((/** @type {number} */ v) => v * 0.9);

  const { port1, port2 } = new MessageChannel();
  serve(port1, async () => hangingAfter(1));
  const stuck = remoteRuntime(port2, 'ort.webgpu.min.mjs', '/vendor/', () => port1.close());
  const { engine, rebuild } = rebuildable(await opened(stuck));
  try {
    engine.setTensors(given);
    await engine.statisticsStep(...batch(1)); // the one graph run the worker answers
    let settled = false;
    const step = engine.trainStep(...batch(2), lr, 'full').finally(() => {
      settled = true;
    });
    await new Promise((resolve) => setTimeout(resolve, 50));
    assert.equal(settled, false, 'the step hangs in the worker');
    let stopped = false;
    assert.equal(
      rebuild(async () => {
        stuck.stop();
        stopped = true;
        return opened(ort);
      }),
      true,
    );
    assert.equal(
      rebuild(async () => opened(ort)),
      false,
      'one rebuild at a time',
    );
    const loss = await step;
    assert.ok(stopped, 'the old worker was stopped');

    reference.setTensors(given);
    await reference.statisticsStep(...batch(1));
    assert.equal(loss, await reference.trainStep(...batch(2), lr, 'full'));
    assert.deepEqual(await engine.getTensors(), await reference.getTensors());
    assert.deepEqual(await engine.evaluate(...batch(1)), await reference.evaluate(...batch(1)));
    assert.equal(engine.ort, ort, 'the front reads the new engine');
    assert.equal(
      rebuild(async () => opened(ort)),
      false,
      'after the first step a rebuild would lose training',
    );
  } finally {
    port1.close();
    port2.close();
  }
});

test('without a rebuild a failed call is its own error, and a finished first step ends the offer', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const feeds = fixtureTensors('feeds.safetensors');
  const { lr } = expected();
  const { engine, rebuild } = rebuildable(await opened(ort));
  await assert.rejects(engine.trainStep(feeds.x1.data, feeds.y1.data, feeds.y1.shape[0], -1, 'full'), {
    problem: 'learning rate -1 is not a positive number',
  });
  assert.equal(typeof (await engine.trainStep(feeds.x1.data, feeds.y1.data, feeds.y1.shape[0], lr, 'full')), 'number');
  assert.equal(
    rebuild(async () => opened(ort)),
    false,
  );
});

/** An engine stand-in that writes down each call it is given, as `name:method`; `hang` makes trainStep wait for
 * ever (until `stop()` fails it, as a stopped worker fails what is under way). */
function recording(name, calls, { hang = false } = {}) {
  /** @type {((err: Error) => void) | null} */
  let fail = null;
  const call =
    (method, value) =>
    (...args) => {
      calls.push(`${name}:${method}`);
      return value(...args);
    };
  return {
    stop: () => fail?.(new Error('the engine was stopped')),
    engine: {
      ort: name,
      setTensors: call('setTensors', () => {}),
      statisticsStep: call('statisticsStep', async () => {}),
      trainStep: call('trainStep', () => (hang ? new Promise((_, reject) => (fail = reject)) : Promise.resolve(1.5))),
      evaluate: call('evaluate', async () => ({ by: name })),
      predict: call('predict', async () => name),
      getTensors: call('getTensors', async () => ({})),
      snapshot: call('snapshot', async () => new Map()),
      preparePredict: call('preparePredict', async () => {}),
    },
  };
}

test('a rebuild gives the new engine the kept calls first, then what waited for it and what failed', async () => {
  const calls = [];
  const old = recording('old', calls, { hang: true });
  const next = recording('new', calls);
  const { engine, rebuild } = rebuildable(/** @type {any} */ (old.engine));
  engine.setTensors({});
  await engine.statisticsStep();
  assert.equal(await engine.evaluate().then((r) => r.by), 'old', 'an evaluation changes nothing: not kept');
  const step = engine.trainStep();
  /** @type {(value?: unknown) => void} */
  let open = () => {};
  const opening = new Promise((resolve) => (open = resolve));
  assert.equal(
    rebuild(async () => {
      old.stop();
      await opening;
      return /** @type {any} */ (next.engine);
    }),
    true,
  );
  const asked = engine.predict(); // during the rebuild: waits for the new engine
  await new Promise((resolve) => setTimeout(resolve, 10));
  assert.deepEqual(calls.slice(4), [], 'nothing reaches the stopped engine or the one not built yet');
  open();
  assert.equal(await step, 1.5);
  assert.equal(await asked, 'new');
  assert.deepEqual(calls.slice(0, 6), [
    'old:setTensors',
    'old:statisticsStep',
    'old:evaluate',
    'old:trainStep',
    'new:setTensors',
    'new:statisticsStep',
  ]);
  assert.deepEqual(calls.slice(6).sort(), ['new:predict', 'new:trainStep']);
  assert.equal(engine.ort, 'new');
});

test("an object made on top of the front (the runner's yielding engine) overrides a method for itself alone", async () => {
  const calls = [];
  const { engine } = rebuildable(/** @type {any} */ (recording('old', calls).engine));
  const yielding = Object.create(engine);
  yielding.trainStep = async () => 2 * (await engine.trainStep());
  assert.equal(await yielding.trainStep(), 3);
  assert.equal(await engine.trainStep(), 1.5);
  engine.evaluate = async () => 'guarded'; // a guard put on the front itself
  assert.equal(await engine.evaluate(), 'guarded');
  assert.equal(await yielding.evaluate(), 'guarded');
});

test('a rebuild that fails is the error of every call that waited for it', async () => {
  const calls = [];
  const old = recording('old', calls, { hang: true });
  const { engine, rebuild } = rebuildable(/** @type {any} */ (old.engine));
  const step = engine.trainStep();
  rebuild(async () => {
    old.stop();
    throw new Error('no WebAssembly here');
  });
  await assert.rejects(step, /no WebAssembly here/);
  await assert.rejects(engine.evaluate(), /no WebAssembly here/);
});
