// @ts-check
// The ring of secure aggregation (edgepfl/secagg/ring.py): the masks, AES-256-CTR keystreams bit for bit those of
// Python, and the packing of ring elements at `bits` bits each.

import { SecAggError } from './errors.js';
import { buffer, subtle } from './secagg_keys.js';

const LITTLE_ENDIAN = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;

/** `length` ring elements < 2^bits: AES-256-CTR keystream of the seed from a zero 128-bit counter, little-endian words. @param {Uint8Array} seed @param {number} length */
export async function maskVector(seed, length, bits = 32) {
  if (seed.length !== 32)
    throw new SecAggError(`a mask seed has ${seed.length} bytes, not 32`, 'derive seeds with HKDF-SHA256');
  const key = await subtle().importKey('raw', buffer(seed), 'AES-CTR', false, ['encrypt']);
  const stream = await subtle().encrypt(
    { name: 'AES-CTR', counter: new Uint8Array(16), length: 128 },
    key,
    new Uint8Array(4 * length),
  );
  let words;
  if (LITTLE_ENDIAN) words = new Uint32Array(stream);
  else {
    const view = new DataView(stream);
    words = Uint32Array.from({ length }, (_, i) => view.getUint32(4 * i, true));
  }
  if (bits < 32) {
    const mask = 2 ** bits - 1;
    for (let i = 0; i < length; i++) words[i] &= mask;
  }
  return words;
}

/** Ring elements packed at `bits` bits each, least significant bit first (ring.py pack). @param {Uint32Array} values @param {number} bits */
export function pack(values, bits) {
  const out = new Uint8Array(Math.ceil((values.length * bits) / 8));
  let acc = 0,
    held = 0,
    pos = 0;
  for (let i = 0; i < values.length; i++) {
    acc += values[i] * 2 ** held;
    held += bits;
    while (held >= 8) {
      out[pos++] = acc % 256;
      acc = Math.floor(acc / 256);
      held -= 8;
    }
  }
  if (held > 0) out[pos] = acc;
  return out;
}

/** The inverse of `pack`. @param {Uint8Array} payload @param {number} length @param {number} bits */
export function unpack(payload, length, bits) {
  const out = new Uint32Array(length);
  let acc = 0,
    held = 0,
    pos = 0;
  for (let i = 0; i < length; i++) {
    while (held < bits) {
      acc += payload[pos++] * 2 ** held;
      held += 8;
    }
    out[i] = acc % 2 ** bits;
    acc = Math.floor(acc / 2 ** bits);
    held -= bits;
  }
  return out;
}
