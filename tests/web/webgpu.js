// The browser engine on WebGPU next to WebAssembly, on the steps tests/test_web_browser.py had the Python portable
// engine run. Each step starts from the Python engine's state before it (set with setTensors: the trained tensors
// and the statistics, so that a frozen set stays the same tensors and its frozen variant runs from the third step),
// and its result is compared with Python's after it. Sets window.webgpuResult = {adapter, placements, sets: {set:
// {losses, wasmLosses, vsPython, vsWasm, wasmVsPython, variantSteps, onGpu}}}.
// Query: bundle and data (URL folders), sets, lr, log (a session log severity for the WebGPU sessions, 0 = verbose).

import { chooseBackend, loadRuntime } from '/src/backend.js';
import { openEngine, portableFiles } from '/src/engine.js';
import { decodeSafetensors } from '/src/safetensors.js';

const params = new URLSearchParams(location.search);

async function bytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`GET ${url}: ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
}

async function tensors(url) {
  return decodeSafetensors(await bytes(url), url).tensors;
}

async function bundleFiles(folder) {
  const manifest = JSON.parse(new TextDecoder().decode(await bytes(`${folder}/manifest.json`)));
  const { required, variants } = portableFiles(manifest);
  const files = new Map();
  for (const path of [...required, ...variants]) files.set(path, await bytes(`${folder}/${path}`));
  return { manifest, files };
}

/** Largest |a - b| over all tensors of `want`, and the tensor where it is. */
function worst(got, want) {
  let out = { diff: 0, name: '' };
  let squares = 0;
  for (const [name, t] of Object.entries(want)) {
    for (let i = 0; i < t.data.length; i++) {
      const diff = Math.abs(got[name].data[i] - t.data[i]);
      squares += diff * diff;
      if (diff > out.diff) out = { diff, name };
    }
  }
  return { ...out, l2: Math.sqrt(squares) };
}

/** Each step of `set` on `backend` from Python's state before it: its loss and the state after it. */
async function steps(ort, backend, bundle, set, placements) {
  const data = params.get('data');
  const logSeverityLevel = backend === 'webgpu' && params.get('log') ? Number(params.get('log')) : undefined;
  const onPlacement = (path, placement) => placements.push({ path, ...placement });
  const engine = await openEngine(ort, bundle.manifest, bundle.files, { backend, onPlacement, logSeverityLevel });
  const trained = new Set([...engine.entry.steps[set].trainable, ...engine.entry.buffers]);
  const feeds = await tensors(`${data}/feeds.safetensors`);
  const counts = Array.from(feeds.counts.data, Number);
  const size = engine.batchSize;
  const sample = engine.sampleSize;
  const out = { losses: [], states: [], onGpu: [] };
  for (let i = 0; i < counts.length; i++) {
    const before = await tensors(`${data}/${set}-${i}.safetensors`);
    engine.setTensors(Object.fromEntries(Object.entries(before).filter(([name]) => trained.has(name))));
    const x = feeds.x.data.subarray(i * size * sample, (i * size + counts[i]) * sample);
    const y = feeds.y.data.subarray(i * size, i * size + counts[i]);
    out.losses.push(await engine.trainStep(x, y, counts[i], Number(params.get('lr')), set));
    // where the step left the tensors it trained, before anything reads them back
    out.onGpu.push([...trained].every((name) => engine.state.get(name).location === 'gpu-buffer'));
    out.states.push(await engine.getTensors());
  }
  out.variantSteps = engine.variantSteps;
  await engine.release();
  return out;
}

async function run() {
  const backend = await chooseBackend(navigator.gpu, 'webgpu');
  if (backend.name !== 'webgpu') throw new Error(`no WebGPU here: ${backend.reason}`);
  const ort = await loadRuntime('webgpu', new URL('/vendor/', location.href));
  const bundle = await bundleFiles(params.get('bundle'));
  const result = { adapter: backend.adapter, placements: [], sets: {} };
  for (const set of params.get('sets').split(',')) {
    const gpu = await steps(ort, 'webgpu', bundle, set, result.placements);
    const wasm = await steps(ort, 'wasm', bundle, set, []);
    const vsPython = [];
    const wasmVsPython = [];
    const vsWasm = [];
    const vsExact = [];
    const wasmVsExact = [];
    for (let i = 0; i < gpu.states.length; i++) {
      const after = await tensors(`${params.get('data')}/${set}-${i + 1}.safetensors`);
      vsPython.push(worst(gpu.states[i], after));
      wasmVsPython.push(worst(wasm.states[i], after));
      vsWasm.push(worst(gpu.states[i], wasm.states[i]));
      if (params.get('exact')) {
        const exact = await tensors(`${params.get('data')}/${set}-${i + 1}-f64.safetensors`);
        vsExact.push(worst(gpu.states[i], exact));
        wasmVsExact.push(worst(wasm.states[i], exact));
      }
    }
    result.sets[set] = { losses: gpu.losses, wasmLosses: wasm.losses, vsPython, wasmVsPython, vsWasm, vsExact, wasmVsExact, variantSteps: gpu.variantSteps, onGpu: gpu.onGpu };
  }
  return result;
}

run().then(
  (result) => {
    window.webgpuResult = result;
    document.getElementById('log').textContent = JSON.stringify(result, null, 1);
  },
  (err) => {
    window.webgpuResult = { error: String((err && err.stack) || err) };
    document.getElementById('log').textContent = String(err);
  },
);
