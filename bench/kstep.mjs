// The K-step graphs of bench/kstep.py on onnxruntime-web's WebAssembly build from Node (the page's wasm engine
// runs the same build), one thread as the page by default: per SGD step, each run fed the tensors the run before
// it returned, as the engine does. Prints one JSON line {threads, seconds: {K: [seconds per SGD step, a round]}}.
// Usage: node bench/kstep.mjs --dir DIR [--rounds 5] [--steps 8] [--threads 1]
//   DIR: kstep.py --wasm's folder (k{K}.onnx and k{K}.safetensors, the feeds of each K; carried.json, the input
//   each new tensor feeds in the next run, from kstep.py's carried_input)

import { readdir, readFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';

const here = dirname(fileURLToPath(import.meta.url));
const web = join(here, '../device_runtime/web');
const { values: args } = parseArgs({
  options: {
    dir: { type: 'string' },
    rounds: { type: 'string', default: '5' },
    steps: { type: 'string', default: '8' },
    threads: { type: 'string', default: '1' },
  },
});
if (!args.dir) {
  console.error('error: --dir is missing: pass the folder bench/kstep.py --wasm writes');
  process.exit(2);
}
const { decodeSafetensors } = await import(pathToFileURL(join(web, 'src/safetensors.js')).href);
const ort = await import(pathToFileURL(join(web, 'node_modules/onnxruntime-web/dist/ort.node.min.mjs')).href);
ort.env.wasm.numThreads = Number(args.threads);

/** @type {Record<string, string>} */
const carried = JSON.parse(await readFile(join(args.dir, 'carried.json'), 'utf8'));

const ks = (await readdir(args.dir)).filter((f) => /^k\d+\.onnx$/.test(f)).map((f) => Number(f.slice(1, -5)));
const runs = {};
for (const k of ks.sort((a, b) => a - b)) {
  const session = await ort.InferenceSession.create(join(args.dir, `k${k}.onnx`), { executionProviders: ['wasm'] });
  const stored = decodeSafetensors(new Uint8Array(await readFile(join(args.dir, `k${k}.safetensors`)))).tensors;
  const feeds = {};
  for (const name of session.inputNames) {
    const t = stored[name];
    feeds[name] = new ort.Tensor(t.dtype, t.data, t.shape);
  }
  runs[k] = { session, feeds };
}
const seconds = Object.fromEntries(ks.map((k) => [k, []]));
for (let round = 0; round < Number(args.rounds); round++) {
  for (const k of ks) {
    const { session, feeds } = runs[k];
    const count = Math.max(1, Math.floor(Number(args.steps) / k));
    let start = 0;
    for (let i = 0; i <= count; i++) {
      if (i === 1) start = performance.now(); // run 0: the warm-up
      const out = await session.run(feeds);
      for (const [name, value] of Object.entries(out)) if (carried[name]) feeds[carried[name]] = value;
    }
    seconds[k].push((performance.now() - start) / 1000 / (count * k));
  }
}
console.log(JSON.stringify({ threads: Number(args.threads), seconds }));
process.exit(0);
