// The page's check of its GPU (src/gpucheck.js): software adapters by name, the first-step watch, the remembered
// fallback, and the engine's methods guarded in place.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  FALLBACK_KEY, FIRST_STEP_LIMIT, guardFirstStep, rememberFallback, rememberedFallback, slowStepReason, softwareAdapter, watchFirstStep,
} from '../src/gpucheck.js';

test('software renderers are told by name or by the fallback flag; hardware adapters are not', () => {
  assert.equal(softwareAdapter({ info: { vendor: 'google', architecture: 'swiftshader' } }), 'swiftshader');
  assert.equal(softwareAdapter({ info: { description: 'llvmpipe (LLVM 15.0.6, 256 bits)' } }), 'llvmpipe');
  assert.equal(softwareAdapter({ info: { device: 'Lavapipe' } }), 'Lavapipe');
  assert.equal(softwareAdapter({ info: { description: 'Microsoft Basic Render Driver' } }), 'Basic Render');
  assert.equal(softwareAdapter({ isFallbackAdapter: true }), 'a fallback adapter');
  assert.equal(softwareAdapter({ info: { vendor: 'qualcomm', architecture: 'adreno-7xx', isFallbackAdapter: false } }), null);
  assert.equal(softwareAdapter({}), null);
});

/** Timers a test fires by hand. */
function timers() {
  const armed = new Map();
  let next = 0;
  return {
    armed,
    setTimer: (run, ms) => { armed.set(++next, { run, ms }); return next; },
    clearTimer: (id) => armed.delete(id),
    fire: () => { for (const [id, { run }] of [...armed]) { armed.delete(id); run(); } },
  };
}

test('the first step watch fires once when no step comes within the limit, never after a step', () => {
  const clock = timers();
  const reasons = [];
  const watch = watchFirstStep({ limit: 5, setTimer: clock.setTimer, clearTimer: clock.clearTimer, onTooSlow: (r) => reasons.push(r) });
  watch.began();
  watch.began(); // the statistics step, then the evaluation: one timer
  assert.deepEqual([...clock.armed.values()].map((t) => t.ms), [5000]);
  clock.fire();
  assert.deepEqual(reasons, [slowStepReason(5)]);
  assert.match(reasons[0], /^the GPU had not finished its first training step after 5 s, so this browser trains on the processor/);
  watch.began();
  assert.equal(clock.armed.size, 0); // over: a later round is not watched again

  const stepped = watchFirstStep({ setTimer: clock.setTimer, clearTimer: clock.clearTimer, onTooSlow: (r) => reasons.push(r) });
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
  const denied = { getItem: () => { throw new Error('SecurityError'); }, setItem: () => { throw new Error('QuotaExceeded'); } };
  assert.equal(rememberedFallback(denied), null);
  rememberFallback(denied, 'x');
  assert.equal(rememberedFallback(undefined), null);
});

test("the guard wraps the engine's graph runs in place: the first work begins the watch, the first step ends it", async () => {
  const calls = [];
  class FakeEngine {
    constructor() { this.steps = 0; }
    async trainStep(x) { this.steps += 1; calls.push(['train', x]); return { loss: 1 }; }
    async statisticsStep(x) { calls.push(['statistics', x]); }
    async evaluate(x) { calls.push(['evaluate', x]); return { count: 0 }; }
  }
  const engine = new FakeEngine();
  const seen = [];
  guardFirstStep(/** @type {any} */ (engine), { began: () => seen.push('began'), stepped: () => seen.push('stepped') });
  await engine.statisticsStep(1);
  await engine.evaluate(2);
  assert.deepEqual(await engine.trainStep(3), { loss: 1 });
  assert.equal(engine.steps, 1); // `this` is still the engine
  assert.deepEqual(calls, [['statistics', 1], ['evaluate', 2], ['train', 3]]);
  assert.deepEqual(seen, ['began', 'began', 'began', 'stepped']);
});
