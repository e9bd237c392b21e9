// The safetensors codec against files written by Python's safetensors, and JS-written files read by Python.

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { halfToNumber } from '../src/encoding.js';
import { decodeSafetensors, encodeSafetensors } from '../src/safetensors.js';
import { NEEDS_FIXTURES, expected, fixtureBytes } from './fixtures.mjs';

const PYTHON = process.env.EDGEPFL_WEB_PYTHON || '';

function sample() {
  return {
    'b.weight': { dtype: 'float32', shape: [2, 3], data: Float32Array.from([1.5, -2, 3.25, 0, 1e-7, -1e30]) },
    'a.count': { dtype: 'int64', shape: [2], data: BigInt64Array.from([-(2n ** 40n), 7n]) },
    'c.half': { dtype: 'float16', shape: [1], data: Uint16Array.from([0x3c00]) },
    'd.idx': { dtype: 'int32', shape: [1, 2], data: Int32Array.from([-5, 6]) },
    'e.mask': { dtype: 'uint8', shape: [3], data: Uint8Array.from([0, 1, 255]) },
    'f.scalar': { dtype: 'float32', shape: [], data: Float32Array.from([0.5]) },
    'g.empty': { dtype: 'float32', shape: [0, 4], data: new Float32Array(0) },
  };
}

/** A hand-built file: 8-byte header length, header JSON, data bytes. */
function rawFile(header, dataLength) {
  const json = new TextEncoder().encode(JSON.stringify(header));
  const out = new Uint8Array(8 + json.length + dataLength);
  new DataView(out.buffer).setBigUint64(0, BigInt(json.length), true);
  out.set(json, 8);
  return out;
}

test('encode then decode returns every dtype, shape, value and the metadata', () => {
  const bytes = encodeSafetensors(sample(), { num_samples: '12' });
  assert.equal((Number(new DataView(bytes.buffer).getBigUint64(0, true)) + 8) % 8, 0, 'data is 8-byte aligned');
  const { tensors, metadata } = decodeSafetensors(bytes);
  assert.deepEqual(metadata, { num_samples: '12' });
  assert.deepEqual(tensors, sample());
});

test('malformed files are refused with a line naming the problem', () => {
  const f32 = (offsets, shape = [2]) => ({ dtype: 'F32', shape, data_offsets: offsets });
  const cases = [
    [new Uint8Array(5), /only 5 bytes/],
    [rawFile({ a: f32([0, 8]) }, 8).subarray(0, 12), /header length \d+ exceeds the file/],
    [
      (() => {
        const f = rawFile({ a: f32([0, 8]) }, 8);
        f[8] = 0x5b;
        return f;
      })(),
      /header is not JSON|not a JSON object/,
    ],
    [rawFile({ a: f32([0, 8]), b: f32([4, 12]) }, 12), /overlaps another tensor/],
    [rawFile({ a: f32([0, 8]), b: f32([8, 24]) }, 16), /lies beyond the end of the file/],
    [rawFile({ a: f32([0, 12]) }, 12), /has 12 bytes for shape \[2\]/],
    [rawFile({ a: f32([0, 8]) }, 10), /2 trailing bytes/],
    [rawFile({ a: { dtype: 'X9', shape: [1], data_offsets: [0, 1] } }, 1), /unknown dtype/],
    [rawFile({ a: f32([0, 8], [-2]) }, 8), /bad shape/],
    [rawFile({ __metadata__: { n: 3 }, a: f32([0, 8]) }, 8), /__metadata__ is not a map of strings/],
  ];
  for (const [bytes, message] of cases) assert.throws(() => decodeSafetensors(bytes, 'upload'), message);
  // JSON.parse would keep the second "a" silently
  const text =
    '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}';
  const json = new TextEncoder().encode(text);
  const dup = new Uint8Array(8 + json.length + 4);
  new DataView(dup.buffer).setBigUint64(0, BigInt(json.length), true);
  dup.set(json, 8);
  assert.throws(() => decodeSafetensors(dup), /tensor "a" appears twice/);
  assert.throws(
    () => encodeSafetensors({ a: { dtype: 'float32', shape: [3], data: new Float32Array(2) } }),
    /not a Float32Array of 3 elements/,
  );
  assert.throws(
    () => encodeSafetensors({ a: { dtype: 'complex64', shape: [1], data: new Float32Array(2) } }),
    /unknown dtype/,
  );
  assert.throws(() => encodeSafetensors({}, { n: 3 }), /metadata "n" is not a string/);
});

test('a file written by Python safetensors decodes to the same values', { skip: NEEDS_FIXTURES }, () => {
  const { tensors, metadata } = decodeSafetensors(fixtureBytes('python_written.safetensors'));
  const want = expected().python_written;
  assert.deepEqual(metadata, { who: 'python', n: '7' });
  assert.deepEqual(Object.keys(tensors).sort(), Object.keys(want).sort());
  for (const [name, spec] of Object.entries(want)) {
    assert.equal(tensors[name].dtype, spec.dtype, name);
    assert.deepEqual(tensors[name].shape, spec.shape, name);
    const values =
      spec.dtype === 'float16' ? Array.from(tensors[name].data, halfToNumber) : Array.from(tensors[name].data, Number);
    assert.deepEqual(
      values,
      spec.values.map((v) => (spec.dtype === 'float32' ? Math.fround(v) : v)),
      name,
    );
  }
});

test("an upload encoded in JS is byte-identical to the Python device's encoding", { skip: NEEDS_FIXTURES }, () => {
  const python = fixtureBytes('python_upload.safetensors');
  const { tensors, metadata } = decodeSafetensors(python);
  assert.deepEqual(encodeSafetensors(tensors, metadata), python);
});

test('a file written in JS is read by Python safetensors and the server decoder', {
  skip: NEEDS_FIXTURES || (!PYTHON && 'EDGEPFL_WEB_PYTHON is unset: run scripts/web-env.sh'),
}, () => {
  const path = join(mkdtempSync(join(tmpdir(), 'edgepfl-web-')), 'js.safetensors');
  writeFileSync(path, encodeSafetensors(sample(), { base_layout_hash: 'ab', num_samples: '3' }));
  const script = [
    'import json, sys',
    'from safetensors.numpy import load_file',
    'from edgepfl.wire import decode_metadata, decode_tensors',
    'raw = open(sys.argv[1], "rb").read()',
    'ours = decode_tensors(raw)',
    'theirs = load_file(sys.argv[1])',
    'assert sorted(ours) == sorted(theirs)',
    'print(json.dumps({"meta": decode_metadata(raw), "tensors": {k: [str(v.dtype), list(v.shape), v.astype("float64").ravel().tolist()] for k, v in theirs.items()}}))',
  ].join('\n');
  const read = JSON.parse(execFileSync(PYTHON, ['-c', script, path], { encoding: 'utf8' }));
  assert.deepEqual(read.meta, { base_layout_hash: 'ab', num_samples: '3' });
  for (const [name, t] of Object.entries(sample())) {
    const values = t.dtype === 'float16' ? Array.from(t.data, halfToNumber) : Array.from(t.data, Number);
    assert.deepEqual(read.tensors[name], [t.dtype, t.shape, values], name);
  }
});
