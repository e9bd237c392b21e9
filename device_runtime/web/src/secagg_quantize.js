// @ts-check
// The quantizer of edgepfl/secagg/quantize.py: a device's delta clipped, scaled by its weight, rotated and rounded
// to ring elements, the same integers as Python's for the same seeds.

import { clipDelta } from './encoding.js';
import { SecAggError } from './errors.js';
import { bitLength, levels, paddedSize, rotationBlock, weightDigits } from './secagg_config.js';
import { graphSeed } from './secagg_graph.js';
import { derive } from './secagg_keys.js';
import { compareIds } from './secagg_messages.js';
import { maskVector } from './secagg_ring.js';

/** @typedef {import('./secagg_messages.js').KeyBook} KeyBook */
/** @typedef {{shape: number[], data: Float32Array}} Tensor */

/** Walsh-Hadamard per block, orthonormal, butterflies (a + b, a - b) in quantize.py's order. @param {Float64Array} values @param {number} block */
function hadamard(values, block) {
  for (let start = 0; start < values.length; start += block) {
    for (let half = 1; half < block; half *= 2) {
      for (let i = start; i < start + block; i += 2 * half) {
        for (let j = i; j < i + half; j++) {
          const a = values[j],
            b = values[j + half];
          values[j] = a + b;
          values[j + half] = a - b;
        }
      }
    }
  }
  const root = Math.sqrt(block);
  for (let i = 0; i < values.length; i++) values[i] /= root;
}

/** The seeded rotation of the slots: permute, flip signs, Hadamard per block. @param {Float64Array} slots @param {number} block @param {Uint8Array} seed */
export async function rotate(slots, block, seed) {
  const length = slots.length;
  const indexBits = Math.max(1, bitLength(length - 1));
  const keyBits = Math.min(32, 53 - indexBits); // key * 2^indexBits + index stays exact in a float64
  const words = await maskVector(await derive(seed, 'rotation-permutation', ''), length);
  const composite = new Float64Array(length);
  for (let i = 0; i < length; i++) composite[i] = Math.floor(words[i] / 2 ** (32 - keyBits)) * 2 ** indexBits + i;
  composite.sort();
  const signs = await maskVector(await derive(seed, 'rotation-signs', ''), length);
  const out = new Float64Array(length);
  for (let i = 0; i < length; i++) out[i] = slots[composite[i] % 2 ** indexBits] * (1 - 2 * (signs[i] & 1));
  hadamard(out, block);
  return out;
}

/**
 * A device's ring vector of its base delta ({name: {shape, data}}) and sample count: clip to C, scale by w / W,
 * rotate, round to [-q, q] (stochastically with `rng`, numpy's Generator.random stream via uniformRandom; to
 * nearest without), then the weight's digits. The same integers as quantize.py's quantize_delta.
 * @param {Record<string, Tensor>} delta @param {number} weight @param {KeyBook} book @param {(() => number)|null} rng
 */
export async function quantizeDelta(delta, weight, book, rng = null) {
  const { config, plan } = book;
  const names = Object.keys(delta).sort(compareIds);
  const size = names.reduce((n, name) => n + delta[name].data.length, 0);
  if (size !== book.base_size)
    throw new SecAggError(
      `the delta has ${size} values, the round sums ${book.base_size}`,
      "send every shared tensor of the round's base",
    );
  if (!Number.isInteger(weight) || weight < 0)
    throw new SecAggError(`weight ${weight} is not a non-negative integer`, "pass the device's sample count");
  if (names.some((name) => delta[name].data.some((v) => !Number.isFinite(v))))
    throw new SecAggError('the delta has NaN or Inf values', 'lower the learning rate; the device sits this round out');
  const w = Math.min(weight, config.max_weight);
  // the contribution (w / W) delta must fit the ring: clip it to C (quantize.py, the same float64 expressions)
  const scale = w / (config.weight_scale ?? config.max_weight);
  const clipped = clipDelta(delta, scale > 0 ? config.clip_norm / scale : config.clip_norm);
  const padded = paddedSize(size);
  const slots = new Float64Array(padded);
  let offset = 0;
  for (const name of names) {
    slots.set(clipped[name].data, offset);
    offset += clipped[name].data.length;
  }
  for (let i = 0; i < size; i++) slots[i] *= scale;
  const rotated = await rotate(slots, rotationBlock(size), await graphSeed(book));
  const q = levels(plan.devices, plan.bits);
  const step = (config.coordinate_sigmas * config.clip_norm) / Math.sqrt(padded) / q;
  const [base, count] = weightDigits(plan.devices, plan.bits, config.max_weight);
  const out = new Uint32Array(padded + count);
  const modulus = 2 ** plan.bits;
  for (let i = 0; i < padded; i++) {
    const ratio = rotated[i] / step;
    const rounded = rng ? Math.floor(ratio + rng()) : roundHalfEven(ratio);
    const z = Math.max(-q, Math.min(q, rounded));
    out[i] = z < 0 ? z + modulus : z;
  }
  for (let i = 0; i < count; i++) out[padded + i] = Math.floor(w / base ** i) % base;
  return out;
}

/** @param {number} x */
function roundHalfEven(x) {
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 ? 2 * Math.round(x / 2) : r;
}
