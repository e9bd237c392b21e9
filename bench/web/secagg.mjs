// Times the browser device's secure aggregation under Node (bench/secagg.py runs it): key generation, sharing with
// k neighbours, quantizing a base delta of d values, masking with k partners and revealing, each the median over
// three devices of one round. Usage: node bench/web/secagg.mjs '{"config": {...}, "plan": {...}, "base_size": d}'
// (the key book's settings and plan); prints JSON.

import { ClientSession, quantizeDelta, uniformRandom } from '../../device_runtime/web/src/secagg.js';

const TIMED = 3;
const { config, plan, base_size: size } = JSON.parse(process.argv[2]);
const context = 'bench/round-1';
const ids = Array.from({ length: plan.devices }, (_, i) => `phone-${String(i).padStart(4, '0')}`);
const times = { keygen_s: [], share_s: [], quantize_s: [], mask_s: [], reveal_s: [] };

async function timed(stage, work) {
  const start = performance.now();
  const result = await work();
  times[stage].push((performance.now() - start) / 1000);
  return result;
}

const sessions = [];
for (const [i, id] of ids.entries()) sessions.push(i < TIMED ? await timed('keygen_s', () => ClientSession.start(id, context)) : await ClientSession.start(id, context));
const book = { context, config, randomness: new Uint8Array(32).fill(7), adverts: sessions.map((s) => s.advert()), plan, base_size: size };
const bundles = [];
for (const [i, session] of sessions.entries()) bundles.push(i < TIMED ? await timed('share_s', () => session.receiveBook(book)) : await session.receiveBook(book));

const next = uniformRandom([1]);
const delta = { base: { shape: [size], data: Float32Array.from({ length: size }, () => (next() - 0.5) * 0.004) } };
let partners = 0;
for (const session of sessions.slice(0, TIMED)) {
  const inbox = { device: session.device, sealed: {} };
  for (const bundle of bundles) if (session.device in bundle.sealed) inbox.sealed[bundle.device] = bundle.sealed[session.device];
  partners = Object.keys(inbox.sealed).length;
  const vector = await timed('quantize_s', () => quantizeDelta(delta, 100, book, uniformRandom([2])));
  await timed('mask_s', () => session.receiveInbox(inbox, vector));
  await timed('reveal_s', async () => session.receiveUnmask({ survivors: ids, dropped: [] }));
}
const median = (values) => values.sort((a, b) => a - b)[Math.floor(values.length / 2)];
const result = Object.fromEntries(Object.entries(times).map(([stage, values]) => [stage, median(values)]));
console.log(JSON.stringify({ partners, devices_timed: TIMED, ...result, total_s: Object.values(result).reduce((a, b) => a + b, 0) }));
