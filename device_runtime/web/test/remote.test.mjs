// The engine's own worker (remote.js, runtime_worker.js) over a MessageChannel in Node: the engine through it trains
// to the same numbers as on the page's thread, tensors a step leaves on the GPU stay in the worker until read back
// or given back, and a stopped or failing worker is one line.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as ort from 'onnxruntime-web';
import { openEngine } from '../src/engine.js';
import { EngineError } from '../src/errors.js';
import { remoteRuntime } from '../src/remote.js';
import { serve } from '../src/runtime_worker.js';
import { NEEDS_FIXTURES, expected, fixtureBundle, fixtureTensors } from './fixtures.mjs';

/** A runtime whose worker end serves `runtime` on the other port of a channel; `close()` ends the channel. */
function connected(runtime) {
  const { port1, port2 } = new MessageChannel();
  serve(port1, async () => runtime);
  const remote = remoteRuntime(port2, 'ort.wasm.min.mjs', '/vendor/', () => port1.close());
  const close = () => {
    port1.close();
    port2.close();
  };
  return { remote, close };
}

test('the engine in the worker trains, evaluates and personalizes to the very numbers of the page-thread engine', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { remote, close } = connected(ort);
  try {
    const feeds = fixtureTensors('feeds.safetensors');
    const want = expected();
    const engines = [];
    for (const runtime of [ort, remote]) {
      const { manifest, files } = fixtureBundle();
      engines.push(await openEngine(runtime, manifest, files, { threads: 1 }));
    }
    const results = [];
    for (const engine of engines) {
      const losses = [];
      for (const [i, set] of [
        [1, 'full'],
        [2, 'full'],
        [1, 'personal'],
        [2, 'personal'],
        [1, 'personal'], // the third personal step on one base: the frozen variant
      ])
        losses.push(
          await engine.trainStep(feeds[`x${i}`].data, feeds[`y${i}`].data, feeds[`y${i}`].shape[0], want.lr, set),
        );
      const evaluated = await engine.evaluate(feeds.xe.data, feeds.ye.data, feeds.ye.shape[0]);
      const probabilities = await engine.predict(feeds.xe.data, feeds.ye.shape[0]);
      results.push({
        losses,
        evaluated,
        probabilities,
        tensors: await engine.getTensors(),
        variant: engine.variantSteps,
      });
    }
    const [here, there] = results;
    assert.deepEqual(there.losses, here.losses);
    assert.deepEqual(there.evaluated, here.evaluated);
    assert.deepEqual(there.probabilities, here.probabilities);
    assert.deepEqual(there.tensors, here.tensors);
    assert.equal(there.variant, 1, 'the frozen variant ran in the worker too');
    assert.equal(remote.env.wasm.numThreads, 1);
    for (const engine of engines) await engine.release();
  } finally {
    close();
  }
});

/** An onnxruntime-web stand-in whose one graph returns its input + 1 on the "GPU" and a loss in memory. */
function gpuLike() {
  const disposed = [];
  class Tensor {
    constructor(type, data, dims, location = 'cpu') {
      Object.assign(this, { type, data, dims, location });
    }
    async getData(release) {
      if (release) this.location = 'cpu';
      return this.data;
    }
    dispose() {
      disposed.push(this.data);
    }
  }
  const create = async (bytes) => {
    if (bytes[0] === 0) throw new Error('protobuf parsing failed');
    const run = async (feeds) => ({
      loss: new Tensor('float32', Float32Array.of(0.5), []),
      y: new Tensor(
        'float32',
        feeds.x.data.map((v) => v + 1),
        feeds.x.dims,
        'gpu-buffer',
      ),
    });
    return { run, release: async () => {} };
  };
  return { ort: { env: { wasm: {} }, Tensor, InferenceSession: { create } }, disposed };
}

test('a tensor a step leaves on the GPU stays in the worker: fed back by handle, read back, given back', async () => {
  const { ort: fake, disposed } = gpuLike();
  const { remote, close } = connected(fake);
  try {
    remote.env.wasm.numThreads = 3;
    const session = await remote.InferenceSession.create(Uint8Array.of(1), {});
    assert.equal(fake.env.wasm.numThreads, 3, 'the wasm settings reach the worker before its first session');
    const first = await session.run({ x: new remote.Tensor('float32', Float32Array.of(1, 2), [2]) }, ['loss', 'y']);
    assert.deepEqual(first.loss.data, Float32Array.of(0.5));
    assert.equal(first.y.location, 'gpu-buffer');
    assert.equal(first.y.data, undefined, 'its values stay in the worker');
    const second = await session.run({ x: first.y }, ['loss', 'y']);
    assert.deepEqual(await second.y.getData(), Float32Array.of(3, 4));
    assert.equal(second.y.location, 'gpu-buffer', 'read without release: still on the GPU');
    assert.deepEqual(await second.y.getData(true), Float32Array.of(3, 4));
    assert.equal(second.y.location, 'cpu');
    assert.deepEqual(second.y.data, Float32Array.of(3, 4));
    first.y.dispose();
    await session.release(); // answered after the dispose: the worker has given the buffer back
    assert.deepEqual(disposed, [Float32Array.of(2, 3)]);
    await assert.rejects(
      second.y.getData(true).then(() => session.run({ x: first.y }, ['y'])),
      (err) => {
        assert.match(String(err), /the engine's worker holds no session/);
        return true;
      },
    );
  } finally {
    close();
  }
});

test('a graph the worker cannot load is its error; a stopped worker fails what was under way and what comes after in one line', async () => {
  const { ort: fake } = gpuLike();
  const { remote, close } = connected(fake);
  try {
    await assert.rejects(remote.InferenceSession.create(Uint8Array.of(0), {}), /protobuf parsing failed/);
    const never = new Promise(() => {});
    const hung = { ...fake, InferenceSession: { create: () => never } }; // a GPU step that never returns
    const { remote: stuck, close: closeStuck } = connected(hung);
    const underWay = stuck.InferenceSession.create(Uint8Array.of(1), {});
    stuck.stop();
    for (const request of [underWay, stuck.InferenceSession.create(Uint8Array.of(1), {})])
      await assert.rejects(request, (err) => {
        assert.ok(err instanceof EngineError);
        assert.equal(err.problem, 'the engine was stopped');
        assert.equal(err.fix, 'reload the page');
        return true;
      });
    closeStuck();
  } finally {
    close();
  }
});
