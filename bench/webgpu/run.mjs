// One run of the page's engine (device_runtime/web/src) from Node, on Dawn's WebGPU (npm `webgpu`) or on
// WebAssembly: opens a bundle's portable graphs with openEngine as the page does and times the full and
// personal-only steps (../web/timing.js, the browser bench's own loop). Prints one JSON line. bench.py runs it.
// Usage: node run.mjs --bundle DIR [--backend webgpu|wasm] [--layout nchw|nhwc] [--threads 1] [--steps 10] [--warmup 5]
//   [--src DIR] [--vendor DIR] [--timing FILE]  (defaults: this repository's layout; pack.py's folder passes them)
// Dawn's adapter: DAWN_FLAGS (comma list of Dawn toggles for create(), e.g. backend=vulkan); VK_ICD_FILENAMES
// picks the Vulkan driver (bench.py sets SwiftShader's where no other adapter is found).

import { readFile } from 'node:fs/promises';
import { availableParallelism } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { fileURLToPath, pathToFileURL } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const { values: args } = parseArgs({
  options: {
    bundle: { type: 'string' },
    backend: { type: 'string', default: 'webgpu' },
    layout: { type: 'string', default: 'nchw' },
    threads: { type: 'string', default: '1' },
    steps: { type: 'string', default: '10' },
    warmup: { type: 'string', default: '5' },
    src: { type: 'string', default: join(here, '../../device_runtime/web/src') },
    vendor: { type: 'string', default: join(here, '../../device_runtime/web/node_modules/onnxruntime-web/dist') },
    timing: { type: 'string', default: join(here, '../web/timing.js') },
  },
});

function fail(problem, fix) {
  console.error(`error: ${problem}: ${fix}`);
  process.exit(2);
}

if (!args.bundle) fail('--bundle is missing', 'pass a folder with a manifest.json and portable graphs');
if (!['webgpu', 'wasm'].includes(args.backend)) fail(`--backend ${args.backend} is not a back end`, 'use webgpu or wasm');

const src = pathToFileURL(`${resolve(args.src)}/`);
const { LAYOUTS } = await import(new URL('sessions.js', src).href); // the engine's own list
if (!LAYOUTS.includes(args.layout.toUpperCase())) {
  fail(`--layout ${args.layout} is not a layout`, `use ${LAYOUTS.map((name) => name.toLowerCase()).join(' or ')}`);
}
const { chooseBackend, loadRuntime } = await import(new URL('backend.js', src).href);
const { openEngine, portableFiles } = await import(new URL('engine.js', src).href);
const { timeSteps } = await import(pathToFileURL(resolve(args.timing)).href);

let gpu;
if (args.backend === 'webgpu') {
  // onnxruntime-web's WebGPU build asks navigator.gpu for its device, as in a page; Node 20 has no navigator.
  // (The engine under Node imports onnxruntime-web's Node build, which has no WebGPU: that is why a Node engine
  // asked for WebGPU runs wasm. Here the WebGPU build is loaded explicitly, as the page loads it.)
  const { create, globals } = await import('webgpu');
  Object.assign(globalThis, globals); // GPUBufferUsage, GPUMapMode, ... as a browser defines them
  // onnxruntime-web writes from views of its wasm memory, a SharedArrayBuffer; Chrome's writeBuffer takes those,
  // dawn.node's answers 'Invalid argument': hand it a copy (what Chrome does inside, too)
  const { writeBuffer } = globals.GPUQueue.prototype;
  globals.GPUQueue.prototype.writeBuffer = function (buffer, offset, data, ...rest) {
    const shared = data instanceof SharedArrayBuffer || data.buffer instanceof SharedArrayBuffer;
    const copy = !shared ? data : ArrayBuffer.isView(data) ? data.slice() : new Uint8Array(data).slice().buffer;
    return writeBuffer.call(this, buffer, offset, copy, ...rest);
  };
  gpu = create((process.env.DAWN_FLAGS || '').split(',').filter(Boolean));
  if (globalThis.navigator) Object.defineProperty(globalThis.navigator, 'gpu', { value: gpu, configurable: true });
  else globalThis.navigator = { gpu, hardwareConcurrency: availableParallelism() };
}
const backend = await chooseBackend(gpu, args.backend);
if (backend.name !== args.backend) fail(`${args.backend} was asked for, but ${backend.reason}`, 'see VK_ICD_FILENAMES');
// with threads > 1 onnxruntime-web fetches its worker module and imports it through a blob: URL (its origin is not
// the page's); Node's fetch takes no file: URL and Node imports no blob: URL, so the module is imported from its file
const nodeFetch = globalThis.fetch;
let fetched = '';
globalThis.fetch = async (input, init) => {
  const url = String(input);
  if (!url.startsWith('file:')) return nodeFetch(input, init);
  fetched = url;
  return new Response(await readFile(fileURLToPath(url)));
};
URL.createObjectURL = () => fetched;
const ort = await loadRuntime(backend.name, pathToFileURL(`${resolve(args.vendor)}/`));

const bundle = resolve(args.bundle);
const manifest = JSON.parse(await readFile(join(bundle, 'manifest.json'), 'utf8'));
const { required, variants } = portableFiles(manifest);
const files = new Map();
for (const path of [...required, ...variants]) files.set(path, new Uint8Array(await readFile(join(bundle, path))));
const threads = Number(args.threads);
const opened = performance.now();
const layout = args.layout.toUpperCase(); // the WebGPU convolutions' (the page's is NCHW)
const engine = await openEngine(ort, manifest, files, { threads, backend: backend.name, layout });
const openSeconds = (performance.now() - opened) / 1000;
const timed = await timeSteps(engine, { steps: Number(args.steps), warmup: Number(args.warmup), numClasses: manifest.num_classes });
const result = { backend: backend.name, layout, adapter: backend.adapter, threads, steps: Number(args.steps), warmup: Number(args.warmup), openSeconds, ...timed };
console.log(JSON.stringify(result));
process.exit(0); // onnxruntime-web's wasm threads and Dawn's device would keep Node alive
