// SHA-256: the JavaScript fallback (pages without WebCrypto) agrees with WebCrypto and the standard vectors.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { checkSha256, sha256Hex, sha256HexPortable } from '../src/sha256.js';

test('known vectors', async () => {
  const abc = new TextEncoder().encode('abc');
  assert.equal(sha256HexPortable(abc), 'ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad');
  assert.equal(
    sha256HexPortable(new Uint8Array(0)),
    'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855',
  );
  assert.equal(await sha256Hex(abc), sha256HexPortable(abc));
});

test('the fallback equals WebCrypto on every padding boundary and a large buffer', async () => {
  for (const length of [1, 55, 56, 57, 63, 64, 65, 119, 120, 128, 1000, 1 << 20]) {
    const bytes = Uint8Array.from({ length }, (_, i) => (i * 131 + 7) & 0xff);
    assert.equal(sha256HexPortable(bytes), await sha256Hex(bytes), `length ${length}`);
  }
});

test('a mismatch names the file', async () => {
  const bytes = new TextEncoder().encode('abc');
  await checkSha256(bytes, 'BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD', 'x');
  await assert.rejects(
    checkSha256(bytes, '00'.repeat(32), 'bundle file portable/eval.onnx'),
    /bundle file portable\/eval.onnx has sha256 ba7816bf8f01/,
  );
});
