// @ts-check
// The numbers of a secure round that follow from the server's settings (edgepfl/secagg/config.py): the ring's
// levels and weight digits, the rotation's block, the masked vector's length, and a device's check of the plan.

import { SecAggError } from './errors.js';

/** @typedef {import('./secagg_messages.js').KeyBook} KeyBook */

const MIN_BITS = 8;
const INT8_LEVELS = 127;
const ROTATION_BLOCK = 1024;

/** @param {number} n */
export function bitLength(n) {
  return n > 0 ? Math.floor(Math.log2(n)) + 1 : 0;
}

/** q: each value quantizes to [-q, q]. @param {number} devices @param {number} bits */
export function levels(devices, bits) {
  const q = Math.floor((2 ** (bits - 1) - 1) / devices);
  if (q < 1)
    throw new SecAggError(`a ring of ${bits} bits cannot sum ${devices} devices`, 'ask the operator for more bits');
  return q;
}

/** [base, count] of the weight's digits. @param {number} devices @param {number} bits @param {number} maxWeight */
export function weightDigits(devices, bits, maxWeight) {
  const base = Math.floor((2 ** bits - 1) / devices) + 1;
  let count = 1;
  while (base ** count <= maxWeight) count++;
  return [base, count];
}

/** @param {number} size */
export function rotationBlock(size) {
  return Math.min(ROTATION_BLOCK, 2 ** bitLength(Math.max(size - 1, 0)));
}

/** @param {number} size */
export function paddedSize(size) {
  return Math.ceil(size / rotationBlock(size)) * rotationBlock(size);
}

/** Ring elements of a masked vector. @param {KeyBook} book */
export function vectorLength(book) {
  return paddedSize(book.base_size) + weightDigits(book.plan.devices, book.plan.bits, book.config.max_weight)[1];
}

/** A device's check that the server's plan follows from its settings (config.py check_plan). @param {KeyBook} book */
export function checkPlan(book) {
  const { plan, config } = book;
  const n = plan.devices,
    k = plan.neighbours;
  let ok = k === n - 1 || (k % 2 === 0 && k >= 2 && k < n - 2);
  if (config.neighbours === 'all' && k !== n - 1) ok = false;
  const t = Math.max(2, Math.ceil(config.threshold * (k + 1)));
  const bits = config.bits ?? Math.max(MIN_BITS, 1 + bitLength(INT8_LEVELS * n));
  if (
    !ok ||
    plan.threshold !== t ||
    plan.min_survivors !== Math.max(t, Math.ceil(config.threshold * n)) ||
    plan.bits !== bits ||
    n !== book.adverts.length
  ) {
    throw new SecAggError(
      `the server's plan ${JSON.stringify(plan)} does not follow from its settings`,
      'the server must send a consistent key book',
    );
  }
  levels(n, bits);
}
