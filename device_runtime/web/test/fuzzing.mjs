// Runs a fast-check property with its example count and seed: fixed in CI (deterministic), scaled and drawn at
// random by scripts/fuzz.sh (EDGEPFL_FUZZ_SCALE, EDGEPFL_FUZZ_SEED); the examples each property ran are appended
// to EDGEPFL_FUZZ_REPORT (JSON lines) when it is set, for the long run's report.

import assert from 'node:assert/strict';
import { appendFileSync } from 'node:fs';
import fc from 'fast-check';
import { DeviceError } from '../src/errors.js';

const SCALE = Number(process.env.EDGEPFL_FUZZ_SCALE || '1');
/** The seed of every property in this process: fixed unless fuzz.sh draws one. */
export const SEED = process.env.EDGEPFL_FUZZ_SEED ? Number(process.env.EDGEPFL_FUZZ_SEED) : 55;

/**
 * Check that `predicate` holds for `runs` examples of `arbitrary` (scaled in the long run); a failure names the seed
 * and the shrunk counterexample.
 * @template T
 * @param {string} name @param {number} runs @param {fc.Arbitrary<T>} arbitrary
 * @param {(value: T) => void | Promise<void>} predicate throws (an assertion) when the property does not hold
 */
export async function holds(name, runs, arbitrary, predicate) {
  let examples = 0;
  const property = fc.asyncProperty(arbitrary, async (value) => {
    examples++;
    await predicate(value);
  });
  await fc.assert(property, { numRuns: Math.max(1, Math.round(runs * SCALE)), seed: SEED, includeErrorInReport: true });
  const path = process.env.EDGEPFL_FUZZ_REPORT;
  if (path) appendFileSync(path, `${JSON.stringify({ suite: 'node', property: name, examples, seed: SEED })}\n`);
}

/** `decode()` gives a value `valid` accepts, or throws a DeviceError naming its problem and fix. */
export function decodesOrRefuses(/** @type {() => unknown} */ decode, /** @type {(value: any) => void} */ valid) {
  let value;
  try {
    value = decode();
  } catch (err) {
    assert.ok(err instanceof DeviceError, `threw ${err?.constructor?.name}: ${err?.message ?? err}`);
    assert.ok(err.problem && err.fix, 'an error names its problem and fix');
    return;
  }
  valid(value);
}
