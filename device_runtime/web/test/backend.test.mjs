// Choosing where the page trains (src/backend.js): the GPU where the browser gives a WebGPU adapter, else WebAssembly.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { adapterName, backendLine, chooseBackend, requestedBackend } from '../src/backend.js';

const adapter = (info) => ({ requestAdapter: async () => ({ info }) });

test('?backend= asks for a back end; auto by default; anything else is refused with the choices', () => {
  assert.equal(requestedBackend(''), 'auto');
  assert.equal(requestedBackend('?backend=wasm'), 'wasm');
  assert.equal(requestedBackend('?x=1&backend=webgpu'), 'webgpu');
  assert.throws(() => requestedBackend('?backend=gpu'), (err) => err.name === 'EngineError' && /auto, webgpu, wasm/.test(err.fix));
});

test('WebGPU where the browser gives an adapter, else WebAssembly with the reason', async () => {
  const gpu = adapter({ vendor: 'google', architecture: 'swiftshader', description: '' });
  assert.deepEqual(await chooseBackend(gpu), { name: 'webgpu', adapter: 'google swiftshader' });
  assert.deepEqual(await chooseBackend(gpu, 'webgpu'), { name: 'webgpu', adapter: 'google swiftshader' });
  assert.equal((await chooseBackend(gpu, 'wasm')).name, 'wasm');
  assert.deepEqual(await chooseBackend(undefined), { name: 'wasm', reason: 'this browser has no WebGPU' });
  assert.deepEqual(await chooseBackend(undefined, 'webgpu'), { name: 'wasm', reason: 'this browser has no WebGPU' });
  const none = { requestAdapter: async () => null };
  assert.deepEqual(await chooseBackend(none), { name: 'wasm', reason: 'the browser gives no WebGPU adapter' });
  const refusing = { requestAdapter: async () => { throw new Error('blocked'); } };
  assert.equal((await chooseBackend(refusing)).name, 'wasm');
});

test("the adapter's name: vendor, architecture, description, each once", () => {
  assert.equal(adapterName({ vendor: 'apple', architecture: 'common-3', description: 'Apple M2' }), 'apple common-3 Apple M2');
  assert.equal(adapterName({ vendor: 'arm', architecture: 'arm', description: '' }), 'arm');
  assert.equal(adapterName(undefined), 'unnamed adapter');
});

test('the line says where the page trains, and each graph the GPU refused with its reason', () => {
  assert.equal(backendLine({ name: 'wasm', reason: 'this browser has no WebGPU' }), 'Training on the processor (WebAssembly: this browser has no WebGPU).');
  const gpu = { name: 'webgpu', adapter: 'google swiftshader' };
  const placed = new Map([['portable/step_full.onnx', { backend: 'webgpu' }]]);
  assert.equal(backendLine(gpu, placed), 'Training on the GPU (WebGPU: google swiftshader).');
  placed.set('portable/eval.onnx', { backend: 'wasm', reason: 'node n (LogSoftmax): no WebGPU kernel' });
  assert.equal(
    backendLine(gpu, placed),
    'Training on the GPU (WebGPU: google swiftshader). On the processor instead: portable/eval.onnx (node n (LogSoftmax): no WebGPU kernel).',
  );
});
