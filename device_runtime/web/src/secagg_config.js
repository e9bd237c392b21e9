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

const CONFIG_FIELDS = [
  'clip_norm',
  'threshold',
  'neighbours',
  'dropout',
  'collusion',
  'bits',
  'max_weight',
  'coordinate_sigmas',
  'weight_scale',
];
const PLAN_FIELDS = ['devices', 'neighbours', 'threshold', 'min_survivors', 'bits'];

/**
 * A key book's settings and plan as SecAggConfig and Plan read them (config.py): the fields they have, each of its
 * type and in its range, so that no later step computes with null, text or Infinity (1e999 in JSON); else one line.
 * @param {unknown} config @param {unknown} plan
 */
export function checkSettings(config, plan) {
  const real = (/** @type {unknown} */ v) => typeof v === 'number' && Number.isFinite(v);
  const int = (/** @type {unknown} */ v) => Number.isSafeInteger(v);
  const fraction = (/** @type {unknown} */ v) => v === null || (real(v) && Number(v) >= 0 && Number(v) < 1);
  const has = (/** @type {any} */ o, /** @type {string[]} */ names) =>
    o !== null &&
    typeof o === 'object' &&
    !Array.isArray(o) &&
    Object.keys(o).sort().join() === [...names].sort().join();
  /** @type {any} */
  const c = config;
  /** @type {any} */
  const p = plan;
  const ok =
    has(c, CONFIG_FIELDS) &&
    real(c.clip_norm) &&
    c.clip_norm > 0 &&
    real(c.threshold) &&
    c.threshold > 0 &&
    c.threshold <= 1 &&
    (c.neighbours === 'auto' ||
      c.neighbours === 'all' ||
      (int(c.neighbours) && c.neighbours >= 2 && c.neighbours % 2 === 0)) &&
    fraction(c.dropout) &&
    fraction(c.collusion) &&
    (c.bits === null || (int(c.bits) && c.bits >= MIN_BITS && c.bits <= 32)) &&
    int(c.max_weight) &&
    c.max_weight >= 1 &&
    c.max_weight < 2 ** 31 &&
    real(c.coordinate_sigmas) &&
    c.coordinate_sigmas > 0 &&
    (c.weight_scale === null || (real(c.weight_scale) && c.weight_scale > 0)) &&
    has(p, PLAN_FIELDS) &&
    PLAN_FIELDS.every((name) => int(p[name]) && p[name] >= 0);
  if (!ok)
    throw new SecAggError(
      "the key book's settings or plan are not SecAggConfig and Plan fields of their types and ranges",
      'the server must send the settings and plan edgepfl.secagg.config writes',
    );
}
