// Times the browser engine's full and personal-only steps; bench/web.py serves this page and reads window.benchResult.
// ?backend=webgpu runs them on the GPU (the WebGPU build of onnxruntime-web), else on WebAssembly.

import { chooseBackend, loadRuntime } from '/src/backend.js';
import { openEngine, portableFiles } from '/src/engine.js';
import { timeSteps } from '/bench/timing.js';

const params = new URLSearchParams(location.search);
const threads = Number(params.get('threads') || 1);
const steps = Number(params.get('steps') || 10);
const warmup = Number(params.get('warmup') || 5);
const bakeFrozen = params.get('bake') !== '0';
const requested = params.get('backend') || 'wasm';

async function fetchBytes(path) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`GET ${path}: ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
}

async function run() {
  const backend = await chooseBackend(navigator.gpu, requested);
  if (backend.name !== requested) throw new Error(`${requested} was asked for, but ${backend.reason}`);
  const ort = await loadRuntime(backend.name, new URL('/vendor/', location.href));
  const manifest = JSON.parse(new TextDecoder().decode(await fetchBytes('/bundle/manifest.json')));
  const { required, variants } = portableFiles(manifest);
  const paths = [...required, ...(bakeFrozen ? variants : [])];
  const files = new Map();
  for (const path of paths) files.set(path, await fetchBytes(`/bundle/${path}`));
  const opened = performance.now();
  const engine = await openEngine(ort, manifest, files, { threads, bakeFrozen, backend: backend.name });
  const openSeconds = (performance.now() - opened) / 1000;
  const timed = await timeSteps(engine, { steps, warmup, numClasses: manifest.num_classes });
  return { backend: backend.name, adapter: backend.adapter, threads, steps, warmup, bakeFrozen, openSeconds, crossOriginIsolated: globalThis.crossOriginIsolated, hardwareConcurrency: navigator.hardwareConcurrency, ...timed };
}

run().then(
  (result) => { window.benchResult = result; document.getElementById('log').textContent = JSON.stringify(result, null, 1); },
  (err) => { window.benchResult = { error: String(err && err.stack || err) }; document.getElementById('log').textContent = String(err); },
);
