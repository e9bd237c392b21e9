// The browser device's delta encodings against edgepfl/encoding.py: the same bits, accepted by the server's
// decoder, the clip norm kept after decoding, and error feedback that neither loses nor doubles what is owed.

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import {
  baseDelta,
  decodeDelta,
  decodeDownload,
  deltaNorm,
  encodeDelta,
  encodeWithFeedback,
  halfBits,
  parseEncoding,
  uniformRandom,
  uploadsDelta,
} from '../src/encoding.js';
import { encodeUpdate } from '../src/protocol.js';
import { encodeSafetensors } from '../src/safetensors.js';

const PYTHON = process.env.EDGEPFL_WEB_PYTHON || '';
const NEEDS_PYTHON = PYTHON ? false : 'EDGEPFL_WEB_PYTHON is unset: run scripts/web-env.sh';

/** A seeded delta of two tensors (one not a multiple of the block size), values of mixed magnitude. */
function sampleDelta(seed = 1, scale = 0.01) {
  const next = uniformRandom([seed]);
  const make = (n) => Float32Array.from({ length: n }, () => (next() - 0.5) * scale * (next() < 0.1 ? 20 : 1));
  return { 'hidden.weight': { shape: [10, 7], data: make(70) }, 'hidden.bias': { shape: [10], data: make(10) } };
}

function python(script, ...args) {
  return JSON.parse(execFileSync(PYTHON, ['-c', script, ...args], { encoding: 'utf8' }));
}

// biome-ignore lint/suspicious/noApproximativeNumericConstant: an ordinary float32 value near pi, not pi
const NEAR_PI = 3.14159;

test('labels parse as the server spells them and others are refused', () => {
  assert.deepEqual(parseEncoding('int8-block256-sr'), {
    name: 'int8',
    blockSize: 256,
    stochastic: true,
    label: 'int8-block256-sr',
  });
  for (const bad of ['int4', 'fp16-sr', 'fp32-block8', 'int8-block0', ''])
    assert.throws(() => parseEncoding(bad), /unknown encoding/);
  assert.equal(uploadsDelta({}), false);
  assert.equal(uploadsDelta({ upload_encoding: 'fp32', clip_norm: 1 }), true);
  assert.equal(uploadsDelta({ upload_encoding: 'fp16' }), true);
});

test("fp16 bits equal numpy's float32 -> float16 cast", { skip: NEEDS_PYTHON }, () => {
  const next = uniformRandom([7]);
  const specials = [
    0,
    1,
    -1,
    65504,
    -65504,
    2 ** -24,
    2 ** -25,
    3 * 2 ** -26,
    2 ** -14,
    2 ** -14 * (1 - 2 ** -11),
    1 + 2 ** -11,
    1 + 3 * 2 ** -11,
    1e-8,
    0.1,
    NEAR_PI,
  ];
  const values = Float32Array.from([
    ...specials,
    ...Array.from({ length: 400 }, () => (next() - 0.5) * 10 ** Math.floor(next() * 12 - 8)),
  ]);
  const bits = Array.from(values, halfBits);
  const expected = python(
    'import json, sys, numpy as np; v = np.array(json.loads(sys.argv[1]), np.float32); print(json.dumps(v.astype(np.float16).view(np.uint16).tolist()))',
    JSON.stringify(Array.from(values)),
  );
  assert.deepEqual(bits, expected);
  assert.equal(halfBits(-0), 0x8000); // JSON has no -0: numpy's answer, checked here
});

test('fp16, int8 and int8-sr payloads are bit for bit those of edgepfl/encoding.py (same seed)', {
  skip: NEEDS_PYTHON,
}, () => {
  const delta = sampleDelta();
  const script = [
    'import json, sys, numpy as np',
    'from edgepfl.encoding import Encoding, encode_delta',
    'delta = {k: np.array(v["data"], np.float32).reshape(v["shape"]) for k, v in json.loads(sys.argv[1]).items()}',
    'out = {}',
    'for label in ("fp16", "int8", "int8-block16", "int8-block16-sr"):',
    '    e = Encoding.parse(label)',
    '    t = encode_delta(delta, e, np.random.default_rng([5, 3]) if e.stochastic else None).tensors',
    '    out[label] = {k: (v.view(np.uint16) if v.dtype == np.float16 else v).astype(np.float64).ravel().tolist() for k, v in t.items()}',
    'print(json.dumps(out))',
  ].join('\n');
  const plain = Object.fromEntries(
    Object.entries(delta).map(([k, t]) => [k, { shape: t.shape, data: Array.from(t.data) }]),
  );
  const expected = python(script, JSON.stringify(plain));
  for (const [label, tensors] of Object.entries(expected)) {
    const encoding = parseEncoding(label);
    const ours = encodeDelta(delta, encoding, encoding.stochastic ? uniformRandom([5, 3]) : null).tensors;
    assert.deepEqual(Object.keys(ours).sort(), Object.keys(tensors).sort(), label);
    for (const [name, values] of Object.entries(tensors))
      assert.deepEqual(Array.from(ours[name].data, Number), values, `${label} ${name}`);
  }
});

test("an encoded, clipped upload is accepted by the server's decoder and checks, within the clip norm", {
  skip: NEEDS_PYTHON,
}, () => {
  const folder = mkdtempSync(join(tmpdir(), 'edgepfl-web-enc-'));
  const meta = { baseLayoutHash: 'ab', numSamples: 12, trainLoss: 0.5, valAccuracy: 0.75, valLoss: 0.6 };
  for (const label of ['fp32', 'fp16', 'int8', 'int8-block16-sr']) {
    const encoding = parseEncoding(label);
    const encoded = encodeWithFeedback(sampleDelta(2, 1), null, encoding, {
      rng: uniformRandom([1, 1]),
      clipNorm: 0.25,
    });
    const path = join(folder, `${label}.safetensors`);
    writeFileSync(path, encodeUpdate(encoded.tensors, meta, encoded.metadata));
    const script = [
      'import json, sys',
      'from edgepfl.manifest import TensorSpec',
      'from edgepfl.privacy import delta_norm',
      'from edgepfl.protocol import RoundSettings, UploadMeta',
      'from edgepfl.server.uploads import read_upload_delta',
      'from edgepfl.wire import decode_metadata, decode_tensors',
      'raw = open(sys.argv[1], "rb").read()',
      'specs = [TensorSpec("hidden.weight", (10, 7), "float32", "base", 0), TensorSpec("hidden.bias", (10,), "float32", "base", 0)]',
      'settings = RoundSettings(upload_encoding=sys.argv[2], clip_norm=0.25)',
      'delta = read_upload_delta(decode_tensors(raw), decode_metadata(raw), settings, specs)',
      'UploadMeta.from_metadata(decode_metadata(raw))',
      'print(json.dumps({"norm": delta_norm(delta), "values": {k: v.ravel().tolist() for k, v in delta.items()}}))',
    ].join('\n');
    const read = python(script, path, label);
    assert.ok(read.norm <= 0.25 * (1 + 1e-6), `${label}: ${read.norm}`);
    assert.ok(read.norm > 0.24, `${label}: clipped to the norm, not below it (${read.norm})`);
    const ours = decodeDelta(encoded.tensors, encoded.metadata, encoding);
    for (const [name, values] of Object.entries(read.values))
      assert.deepEqual(Array.from(ours[name].data), values, `${label} ${name}`);
  }
});

test('error feedback: over rounds what was sent is what was trained, less the residual still owed', () => {
  for (const label of ['fp16', 'int8', 'int8-block16-sr']) {
    const encoding = parseEncoding(label);
    let residual = null;
    const sent = sampleDelta(0, 0);
    const trained = sampleDelta(0, 0);
    for (let round = 1; round <= 6; round++) {
      const delta = sampleDelta(10 + round);
      const encoded = encodeWithFeedback(delta, residual, encoding, { rng: uniformRandom([3, round]) });
      const decoded = decodeDelta(encoded.tensors, encoded.metadata, encoding);
      for (const name of Object.keys(delta)) {
        for (let i = 0; i < delta[name].data.length; i++) {
          sent[name].data[i] += decoded[name].data[i];
          trained[name].data[i] += delta[name].data[i];
        }
      }
      residual = encoded.residual;
    }
    for (const name of Object.keys(sent)) {
      for (let i = 0; i < sent[name].data.length; i++) {
        assert.ok(
          Math.abs(sent[name].data[i] + residual[name].data[i] - trained[name].data[i]) < 1e-6,
          `${label} ${name}[${i}]`,
        );
      }
    }
    assert.ok(deltaNorm(residual) < deltaNorm(trained) / 20, label); // and what is owed stays one round's error
  }
});

test('the delta is trained minus received, and a base is decoded only in the encoding the round named', () => {
  const trained = { w: { dtype: 'float32', shape: [3], data: Float32Array.from([1, 2.5, -1]) } };
  const received = { w: { dtype: 'float32', shape: [3], data: Float32Array.from([0.5, 2.5, 1]) } };
  assert.deepEqual(Array.from(baseDelta(trained, received).w.data), [0.5, 0, -2]);
  const half = encodeDelta({ w: { shape: [3], data: Float32Array.from([0.1, -2, 1e-3]) } }, parseEncoding('fp16'));
  const bytes = encodeSafetensors(half.tensors, half.metadata);
  const base = decodeDownload(bytes, 'fp16', 'the base');
  assert.equal(base.w.dtype, 'float32');
  for (const [i, x] of [0.1, -2, 1e-3].entries()) assert.ok(Math.abs(base.w.data[i] - x) <= Math.abs(x) * 2 ** -11);
  assert.throws(() => decodeDownload(encodeSafetensors(trained), 'fp16', 'the base'), /encoded as "nothing", not fp16/);
  assert.deepEqual(decodeDownload(encodeSafetensors(trained), 'fp32', 'the base').w.data, trained.w.data);
});
