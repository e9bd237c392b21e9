// The page's check of its GPU (src/gpucheck.js): software adapters by name, the first-step watch, the remembered
// fallback, the engine's methods guarded in place, and the GPU compared with WebAssembly after its first steps.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as ort from 'onnxruntime-web';
import { openEngine } from '../src/engine.js';
import {
  FALLBACK_KEY,
  FIRST_STEP_LIMIT,
  GPU_STEPS_TIMED,
  WASM_MARGIN,
  guardFirstStep,
  guardGpuSpeed,
  rememberFallback,
  rememberedFallback,
  slowStepReason,
  slowerThanWasm,
  softwareAdapter,
  wasmStepSeconds,
  watchFirstStep,
} from '../src/gpucheck.js';
import { NEEDS_FIXTURES, expected, fixtureBundle, fixtureTensors } from './fixtures.mjs';

test('software renderers are told by name or by the fallback flag; hardware adapters are not', () => {
  assert.equal(softwareAdapter({ info: { vendor: 'google', architecture: 'swiftshader' } }), 'swiftshader');
  assert.equal(softwareAdapter({ info: { description: 'llvmpipe (LLVM 15.0.6, 256 bits)' } }), 'llvmpipe');
  assert.equal(softwareAdapter({ info: { device: 'Lavapipe' } }), 'Lavapipe');
  assert.equal(softwareAdapter({ info: { description: 'Microsoft Basic Render Driver' } }), 'Basic Render');
  assert.equal(softwareAdapter({ isFallbackAdapter: true }), 'a fallback adapter');
  assert.equal(
    softwareAdapter({ info: { vendor: 'qualcomm', architecture: 'adreno-7xx', isFallbackAdapter: false } }),
    null,
  );
  assert.equal(softwareAdapter({}), null);
});

/** Timers a test fires by hand. */
function timers() {
  const armed = new Map();
  let next = 0;
  return {
    armed,
    setTimer: (run, ms) => {
      armed.set(++next, { run, ms });
      return next;
    },
    clearTimer: (id) => armed.delete(id),
    fire: () => {
      for (const [id, { run }] of [...armed]) {
        armed.delete(id);
        run();
      }
    },
  };
}

test('the first step watch fires once when no step comes within the limit, never after a step', () => {
  const clock = timers();
  const reasons = [];
  const watch = watchFirstStep({
    limit: 5,
    setTimer: clock.setTimer,
    clearTimer: clock.clearTimer,
    onTooSlow: (r) => reasons.push(r),
  });
  watch.began();
  watch.began(); // the statistics step, then the evaluation: one timer
  assert.deepEqual(
    [...clock.armed.values()].map((t) => t.ms),
    [5000],
  );
  clock.fire();
  assert.deepEqual(reasons, [slowStepReason(5)]);
  assert.match(
    reasons[0],
    /^the GPU had not finished its first training step after 5 s, so this browser trains on the processor/,
  );
  watch.began();
  assert.equal(clock.armed.size, 0); // over: a later round is not watched again

  const stepped = watchFirstStep({
    setTimer: clock.setTimer,
    clearTimer: clock.clearTimer,
    onTooSlow: (r) => reasons.push(r),
  });
  stepped.began();
  assert.equal([...clock.armed.values()][0].ms, FIRST_STEP_LIMIT * 1000);
  stepped.stepped();
  assert.equal(clock.armed.size, 0);
  stepped.began();
  clock.fire();
  assert.equal(reasons.length, 1);
});

test('a fallback is remembered in storage, and storage that throws remembers nothing without failing', () => {
  const items = new Map();
  const memory = { getItem: (k) => items.get(k) ?? null, setItem: (k, v) => items.set(k, v) };
  assert.equal(rememberedFallback(memory), null);
  rememberFallback(memory, 'too slow');
  assert.equal(items.get(FALLBACK_KEY), 'too slow');
  assert.equal(rememberedFallback(memory), 'too slow');
  const denied = {
    getItem: () => {
      throw new Error('SecurityError');
    },
    setItem: () => {
      throw new Error('QuotaExceeded');
    },
  };
  assert.equal(rememberedFallback(denied), null);
  rememberFallback(denied, 'x');
  assert.equal(rememberedFallback(undefined), null);
});

test("the guard wraps the engine's graph runs in place: the first work begins the watch, the first step ends it", async () => {
  const calls = [];
  class FakeEngine {
    constructor() {
      this.steps = 0;
    }
    async trainStep(x) {
      this.steps += 1;
      calls.push(['train', x]);
      return { loss: 1 };
    }
    async statisticsStep(x) {
      calls.push(['statistics', x]);
    }
    async evaluate(x) {
      calls.push(['evaluate', x]);
      return { count: 0 };
    }
  }
  const engine = new FakeEngine();
  const seen = [];
  guardFirstStep(/** @type {any} */ (engine), { began: () => seen.push('began'), stepped: () => seen.push('stepped') });
  await engine.statisticsStep(1);
  await engine.evaluate(2);
  assert.deepEqual(await engine.trainStep(3), { loss: 1 });
  assert.equal(engine.steps, 1); // `this` is still the engine
  assert.deepEqual(calls, [
    ['statistics', 1],
    ['evaluate', 2],
    ['train', 3],
  ]);
  assert.deepEqual(seen, ['began', 'began', 'began', 'stepped']);
});

test('the GPU loses to WebAssembly only when slower than the margin, its first (compiling) step left out', () => {
  assert.equal(WASM_MARGIN, 1.2);
  // slower: median of the steps after the first is 2.1 s, the processor 0.8 s
  assert.equal(
    slowerThanWasm([9, 2.1, 2.0, 2.2], 0.8),
    'on this device the GPU took 2.1 s a training step and the processor 0.8 s, so this browser trains on the processor from now on; ?backend=webgpu tries the GPU again',
  );
  assert.match(
    /** @type {string} */ (slowerThanWasm([1, 0.05, 0.05], 0.02)),
    /GPU took 50 ms a training step and the processor 20 ms/,
  );
  assert.equal(slowerThanWasm([9, 0.2, 0.2, 0.2], 0.8), null); // faster
  assert.equal(slowerThanWasm([9, 1.1, 1.1, 1.1], 1.0), null); // slower, within the margin
  assert.notEqual(slowerThanWasm([9, 1.3, 1.3, 1.3], 1.0), null); // beyond it
  // the first step alone would lose; the steady steps do not
  assert.equal(slowerThanWasm([30, 0.5, 0.5], 1.0), null);
  assert.equal(slowerThanWasm([30], 1.0), null); // no steady step: nothing to compare
  assert.equal(slowerThanWasm([9, 5, 0.5, 0.5], 1.0), null); // one slow steady step (a variant's session opening) is outvoted
  assert.equal(slowerThanWasm([9, 2, 2], NaN), null);
  assert.equal(slowerThanWasm([9, 2, NaN], 1), null);
  assert.equal(slowerThanWasm([9, 2, 2], 1, 3), null); // a wider margin given
});

/** A fake engine whose steps take `gpu[i]` seconds on a hand-driven clock. */
function timedEngine(gpu, placements = [['step_full.onnx', { backend: 'webgpu' }]]) {
  const clock = { t: 0 };
  const engine = {
    steps: 0,
    placements: new Map(placements),
    async trainStep(x) {
      clock.t += gpu[this.steps];
      this.steps += 1;
      return x * 10;
    },
  };
  return { clock, engine };
}

test('the speed guard times the first GPU steps, then compares one wasm step once, in place on the engine', async () => {
  const { clock, engine } = timedEngine([9, 2, 2.2, 2.1, 2, 2]);
  const asked = [];
  const reasons = [];
  guardGpuSpeed(/** @type {any} */ (engine), {
    now: () => clock.t,
    wasmSeconds: async (args) => {
      asked.push(args);
      return 0.8;
    },
    onSlower: (reason) => reasons.push(reason),
  });
  const losses = [];
  for (let i = 1; i <= GPU_STEPS_TIMED + 2; i++) losses.push(await engine.trainStep(i, 'y'));
  assert.deepEqual(losses, [10, 20, 30, 40, 50, 60]); // the steps' results pass through, `this` still the engine
  assert.deepEqual(asked, [[GPU_STEPS_TIMED, 'y']]); // once, after the timed steps, with the last step's arguments
  assert.deepEqual(reasons, [slowerThanWasm([9, 2, 2.2, 2.1], 0.8)]);
  assert.match(reasons[0], /GPU took 2\.1 s a training step and the processor 0\.8 s/);
});

test('the speed guard keeps the GPU when it is faster, when no graph runs on it, or when the comparison fails', async () => {
  for (const [gpu, placements, wasmSeconds] of [
    [[9, 0.1, 0.1, 0.1], undefined, async () => 0.8],
    [[9, 2, 2, 2], [['step_full.onnx', { backend: 'wasm', reason: 'int64' }]], async () => 0.8],
    [
      [9, 2, 2, 2],
      undefined,
      async () => {
        throw new Error('out of memory');
      },
    ],
  ]) {
    const { clock, engine } = timedEngine(gpu, placements);
    let asked = 0;
    const reasons = [];
    guardGpuSpeed(/** @type {any} */ (engine), {
      steps: 4,
      now: () => clock.t,
      wasmSeconds: (args) => {
        asked += 1;
        return wasmSeconds(args);
      },
      onSlower: (reason) => reasons.push(reason),
    });
    for (let i = 0; i < 4; i++) await engine.trainStep(i);
    assert.deepEqual(reasons, []);
    assert.equal(asked, placements ? 0 : 1);
  }
});

test('a wasm step is timed on a copy given the engine tensors; the engine is not changed and the copy steps like it', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { manifest, files } = fixtureBundle();
  const engine = await openEngine(ort, manifest, files, { threads: 1 });
  const copy = await openEngine(ort, manifest, files, { threads: 1 });
  const feeds = fixtureTensors('feeds.safetensors');
  const { lr } = expected();
  await engine.trainStep(feeds.x1.data, feeds.y1.data, feeds.y1.shape[0], lr); // the engine has trained: not the bundle's initial model
  const before = await engine.getTensors();
  const args = /** @type {const} */ ([feeds.x2.data, feeds.y2.data, feeds.y2.shape[0], lr, 'full']);
  let t = 0;
  const seconds = await wasmStepSeconds(engine, copy, [...args], () => (t += 0.25));
  assert.equal(seconds, 0.25); // one step, the second, between two readings of the clock
  assert.deepEqual(await engine.getTensors(), before);
  const afterCopy = await copy.getTensors();
  await engine.trainStep(...args);
  assert.deepEqual(afterCopy, await engine.getTensors()); // the same step from the same tensors: the same numbers
});
