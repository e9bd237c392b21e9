// Choosing where the page trains (src/backend.js): the GPU where the browser gives a hardware WebGPU adapter, else
// WebAssembly, saying why.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { adapterName, backendLine, chooseBackend, requestedBackend, trainingThreads } from '../src/backend.js';

const adapter = (info) => ({ requestAdapter: async () => ({ info }) });

test('?backend= asks for a back end; auto by default; anything else is refused with the choices', () => {
  assert.equal(requestedBackend(''), 'auto');
  assert.equal(requestedBackend('?backend=wasm'), 'wasm');
  assert.equal(requestedBackend('?x=1&backend=webgpu'), 'webgpu');
  assert.throws(
    () => requestedBackend('?backend=gpu'),
    (err) => err.name === 'EngineError' && /auto, webgpu, wasm/.test(err.fix),
  );
});

test('WebGPU where the browser gives a hardware adapter, else WebAssembly with the reason', async () => {
  const gpu = adapter({ vendor: 'apple', architecture: 'metal-3', description: 'Apple M2' });
  assert.deepEqual(await chooseBackend(gpu), { name: 'webgpu', adapter: 'apple metal-3 Apple M2', forced: false });
  assert.deepEqual(await chooseBackend(gpu, 'webgpu'), {
    name: 'webgpu',
    adapter: 'apple metal-3 Apple M2',
    forced: true,
  });
  assert.equal((await chooseBackend(gpu, 'wasm')).name, 'wasm');
  assert.deepEqual(await chooseBackend(undefined), { name: 'wasm', reason: 'this browser has no WebGPU' });
  assert.deepEqual(await chooseBackend(undefined, 'webgpu'), { name: 'wasm', reason: 'this browser has no WebGPU' });
  const none = { requestAdapter: async () => null };
  assert.deepEqual(await chooseBackend(none), { name: 'wasm', reason: 'the browser gives no WebGPU adapter' });
  const refusing = {
    requestAdapter: async () => {
      throw new Error('blocked');
    },
  };
  assert.equal((await chooseBackend(refusing)).name, 'wasm');
});

test('auto never takes a software GPU on its own; ?backend=webgpu still does', async () => {
  const swiftshader = adapter({ vendor: 'google', architecture: 'swiftshader', description: '' });
  const chosen = await chooseBackend(swiftshader);
  assert.equal(chosen.name, 'wasm');
  assert.match(
    chosen.reason,
    /^this browser's GPU is a software renderer \(swiftshader\) on the processor, slower than WebAssembly; \?backend=webgpu uses it all the same$/,
  );
  assert.deepEqual(await chooseBackend(swiftshader, 'webgpu'), {
    name: 'webgpu',
    adapter: 'google swiftshader',
    forced: true,
  });
  for (const info of [
    { vendor: 'mesa', description: 'llvmpipe (LLVM 15.0.6, 256 bits)' },
    { vendor: 'mesa', device: 'lavapipe' },
  ]) {
    assert.equal((await chooseBackend(adapter(info))).name, 'wasm', JSON.stringify(info));
  }
  // a fallback adapter, told by the adapter itself (older browsers) or in its info (newer ones), whatever its name
  const fallback = { requestAdapter: async () => ({ isFallbackAdapter: true, info: { vendor: 'x' } }) };
  assert.match((await chooseBackend(fallback)).reason, /software renderer \(a fallback adapter\)/);
  const told = adapter({ vendor: 'x', isFallbackAdapter: true });
  assert.equal((await chooseBackend(told)).name, 'wasm');
  assert.equal((await chooseBackend(adapter({ vendor: 'nvidia', architecture: 'hopper' }))).name, 'webgpu');
});

test('a first step remembered as too slow keeps auto on WebAssembly, saying why; forcing WebGPU tries again', async () => {
  const gpu = adapter({ vendor: 'arm', architecture: 'valhall' });
  const why = 'the GPU had not finished its first training step after 60 s, …';
  assert.deepEqual(await chooseBackend(gpu, 'auto', why), { name: 'wasm', reason: why });
  assert.equal((await chooseBackend(gpu, 'webgpu', why)).name, 'webgpu');
});

test("the adapter's name: vendor, architecture, description, each once", () => {
  assert.equal(
    adapterName({ vendor: 'apple', architecture: 'common-3', description: 'Apple M2' }),
    'apple common-3 Apple M2',
  );
  assert.equal(adapterName({ vendor: 'arm', architecture: 'arm', description: '' }), 'arm');
  assert.equal(adapterName(undefined), 'unnamed adapter');
});

test('the line says where the page trains, and each graph the GPU refused with its reason', () => {
  assert.equal(
    backendLine({ name: 'wasm', reason: 'this browser has no WebGPU' }),
    'Training on the processor (WebAssembly: this browser has no WebGPU).',
  );
  const gpu = { name: 'webgpu', adapter: 'google swiftshader' };
  const placed = new Map([['portable/step_full.onnx', { backend: 'webgpu' }]]);
  assert.equal(backendLine(gpu, placed), 'Training on the GPU (WebGPU: google swiftshader).');
  placed.set('portable/eval.onnx', { backend: 'wasm', reason: 'node n (LogSoftmax): no WebGPU kernel' });
  assert.equal(
    backendLine(gpu, placed),
    'Training on the GPU (WebGPU: google swiftshader). On the processor instead: portable/eval.onnx (node n (LogSoftmax): no WebGPU kernel).',
  );
});

test('threads: one unless cross-origin isolated, else the cores up to four; a kind that needs the page free leaves it one', () => {
  assert.equal(trainingThreads(false, 8, false), 1);
  assert.equal(trainingThreads(false, 8, true), 1);
  assert.equal(trainingThreads(true, 2, false), 2);
  assert.equal(trainingThreads(true, 2, true), 1);
  assert.equal(trainingThreads(true, 8, false), 4);
  assert.equal(trainingThreads(true, 8, true), 4);
  assert.equal(trainingThreads(true, 5, true), 4);
  assert.equal(trainingThreads(true, 1, true), 1);
  assert.equal(trainingThreads(true, 0, false), 1); // a browser that does not say its cores
});
