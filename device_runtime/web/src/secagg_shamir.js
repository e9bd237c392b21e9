// @ts-check
// Shamir shares over GF(2^256 + 297) that the Python server reconstructs (edgepfl/secagg/shamir.py).

import { hex } from './bytes.js';
import { SecAggError } from './errors.js';

/** @typedef {import('./secagg_keys.js').RandomBytes} RandomBytes */

export const PRIME = (1n << 256n) + 297n;
export const SECRET_BYTES = 32;
export const SHARE_BYTES = 33;

/** @param {Uint8Array} bytes */
export function toBigInt(bytes) {
  return bytes.length ? BigInt(`0x${hex(bytes)}`) : 0n;
}

/** @param {bigint} value @param {number} length */
function fromBigInt(value, length) {
  const text = value.toString(16).padStart(2 * length, '0');
  return Uint8Array.from({ length }, (_, i) => parseInt(text.slice(2 * i, 2 * i + 2), 16));
}

/** Shares {holder index: 33 bytes} of a 32-byte secret; any `threshold` of them give it back. @param {Uint8Array} secret @param {number[]} holders @param {number} threshold @param {RandomBytes} randomBytes */
export function shamirSplit(secret, holders, threshold, randomBytes) {
  if (secret.length !== SECRET_BYTES)
    throw new SecAggError(`a shared secret has ${secret.length} bytes, not 32`, 'share 32-byte secrets');
  if (
    !(threshold >= 1 && threshold <= holders.length) ||
    new Set(holders).size !== holders.length ||
    Math.min(...holders) < 1
  ) {
    throw new SecAggError(
      `cannot share among ${holders.length} holders with threshold ${threshold}`,
      'use distinct indices from 1',
    );
  }
  const coefficients = [toBigInt(secret)];
  for (let j = 1; j < threshold; j++) coefficients.push(toBigInt(randomBytes(SECRET_BYTES)));
  /** @type {Record<number, Uint8Array>} */
  const shares = {};
  for (const x of holders) {
    let value = 0n;
    for (let j = coefficients.length - 1; j >= 0; j--) value = (value * BigInt(x) + coefficients[j]) % PRIME;
    shares[x] = fromBigInt(value, SHARE_BYTES);
  }
  return shares;
}
