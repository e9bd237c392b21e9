// Loads the fixtures make_fixtures.py writes (EDGEPFL_WEB_FIXTURES=dir; scripts/web-env.sh sets it up).

import { readFileSync, readdirSync, statSync } from 'node:fs';
import { join, relative } from 'node:path';
import { parseContract } from '../src/contract.js';
import { decodeSafetensors } from '../src/safetensors.js';

export const FIXTURES = process.env.EDGEPFL_WEB_FIXTURES || '';
/** node:test `skip` value for tests that need the fixtures: false when present, else the reason. */
export const NEEDS_FIXTURES = FIXTURES
  ? false
  : 'EDGEPFL_WEB_FIXTURES is unset: run scripts/web-env.sh, which writes the Python fixtures first';

/** Bytes of a fixture file. */
export function fixtureBytes(path) {
  return new Uint8Array(readFileSync(join(FIXTURES, path)));
}

/** Tensors of a fixture safetensors file. */
export function fixtureTensors(path) {
  return decodeSafetensors(fixtureBytes(path), path).tensors;
}

/** expected.json of the fixtures. */
export function expected() {
  return JSON.parse(readFileSync(join(FIXTURES, 'expected.json'), 'utf8'));
}

/** The device contract as the server serves it (device_runtime/contract.py, written by make_fixtures.py). */
export function fixtureContract() {
  return parseContract(JSON.parse(readFileSync(join(FIXTURES, 'contract.json'), 'utf8')));
}

/** The fixture bundle as the page holds it: its manifest and a Map of bundle-relative path -> bytes. */
export function fixtureBundle() {
  return bundleAt(join(FIXTURES, 'bundle'));
}

/** A bundle folder as the page holds it: its manifest and a Map of bundle-relative path -> bytes. */
export function bundleAt(root) {
  const manifest = JSON.parse(readFileSync(join(root, 'manifest.json'), 'utf8'));
  const files = new Map();
  const walk = (dir) => {
    for (const name of readdirSync(dir)) {
      const path = join(dir, name);
      if (statSync(path).isDirectory()) walk(path);
      else files.set(relative(root, path).split('\\').join('/'), new Uint8Array(readFileSync(path)));
    }
  };
  walk(root);
  return { manifest, files };
}

/** Largest |a - b| over two equal-length numeric arrays. */
export function maxAbsDiff(a, b) {
  if (a.length !== b.length) throw new Error(`lengths differ: ${a.length} vs ${b.length}`);
  let worst = 0;
  for (let i = 0; i < a.length; i++) worst = Math.max(worst, Math.abs(Number(a[i]) - Number(b[i])));
  return worst;
}
