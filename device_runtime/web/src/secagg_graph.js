// @ts-check
// Who shares with whom in a secure round (edgepfl/secagg/graph.py): the public seed of the key book, and each
// device's neighbours on the seeded ring.

import { concat } from './bytes.js';
import { derive, lengthPrefixed, sha256 } from './secagg_keys.js';
import { compareIds } from './secagg_messages.js';

/** @typedef {import('./secagg_messages.js').KeyBook} KeyBook */

const encoder = new TextEncoder();

/** The public seed of the graph and the rotation (graph.py graph_seed). @param {KeyBook} book */
export async function graphSeed(book) {
  const parts = book.adverts.map((a) => concat(lengthPrefixed([a.device]), a.cipher_key, a.mask_key));
  return derive(await sha256(concat(book.randomness, ...parts)), 'graph', book.context);
}

/** Each device's neighbours (sorted): k/2 either side on the seeded ring; k >= n - 1 joins every pair. @param {string[]} devices @param {Uint8Array} seed @param {number} k */
export async function neighbourMap(devices, seed, k) {
  const n = devices.length;
  /** @type {Record<string, string[]>} */
  const graph = {};
  if (k >= n - 1) {
    for (const d of devices) graph[d] = devices.filter((o) => o !== d).sort(compareIds);
    return graph;
  }
  const keyed = await Promise.all(
    devices.map(async (d) => ({ d, key: await sha256(concat(seed, encoder.encode(d))) })),
  );
  keyed.sort((a, b) => compareBytes(a.key, b.key) || compareIds(a.d, b.d));
  const order = keyed.map((e) => e.d);
  const half = k / 2;
  order.forEach((d, position) => {
    const near = [];
    for (let step = -half; step <= half; step++) if (step) near.push(order[(((position + step) % n) + n) % n]);
    graph[d] = near.sort(compareIds);
  });
  return graph;
}

/** @param {Uint8Array} a @param {Uint8Array} b */
function compareBytes(a, b) {
  for (let i = 0; i < Math.min(a.length, b.length); i++) if (a[i] !== b[i]) return a[i] - b[i];
  return a.length - b.length;
}
