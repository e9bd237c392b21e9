// PNG pre-processing in JS against the Python loader's arrays (resize, grey conversion, normalisation).

import assert from 'node:assert/strict';
import { test } from 'node:test';
import pngjs from 'pngjs';
import { normalizePixels, resizeTaps, toModelInput, toModelPixels } from '../src/preprocess.js';
import { NEEDS_FIXTURES, expected, fixtureBundle, fixtureBytes, fixtureTensors } from './fixtures.mjs';

const { PNG } = pngjs;

test('PNGs larger and smaller than the input give exactly the Python loader pixels and model input', {
  skip: NEEDS_FIXTURES,
}, () => {
  const { manifest } = fixtureBundle();
  const want = fixtureTensors('images_expected.safetensors');
  const { files, grey_spec: greySpec } = expected().images;
  const plane = (t, i) => t.data.subarray((i * t.data.length) / t.shape[0], ((i + 1) * t.data.length) / t.shape[0]);
  files.forEach((file, i) => {
    const png = PNG.sync.read(Buffer.from(fixtureBytes(file)));
    const rgba = new Uint8Array(png.data.buffer, png.data.byteOffset, png.data.length);
    assert.deepEqual(
      toModelPixels(rgba, png.width, png.height, manifest.input),
      plane(want.rgb_pixels, i),
      `${file} pixels`,
    );
    assert.deepEqual(
      toModelInput(rgba, png.width, png.height, manifest.input),
      plane(want.rgb_input, i),
      `${file} input`,
    );
    assert.deepEqual(
      toModelPixels(rgba, png.width, png.height, greySpec),
      plane(want.grey_pixels, i),
      `${file} grey pixels`,
    );
    assert.deepEqual(
      toModelInput(rgba, png.width, png.height, greySpec),
      plane(want.grey_input, i),
      `${file} grey input`,
    );
  });
});

test('resize taps: bilinear with pixel centres when growing, widened triangle when shrinking', () => {
  assert.deepEqual(
    resizeTaps(2, 4).map((t) => [t.first, t.weights]),
    [
      [0, [1]],
      [0, [0.75, 0.25]],
      [0, [0.25, 0.75]],
      [1, [1]],
    ],
  );
  const row = new Uint8Array(6 * 4).fill(255);
  row.fill(0, 0, 6 * 4 - 1);
  for (let p = 0; p < 6; p++) row[4 * p + 3] = 255;
  row[4 * 2] = 80; // red of the third pixel, as in tests/test_resize.py
  const planes = toModelPixels(row, 6, 1, { shape: [3, 1, 3] });
  assert.deepEqual(Array.from(planes), [11, 30, 0, 0, 0, 0, 0, 0, 0]);
});

test('same-size images only normalise; bad input is refused', () => {
  const spec = { shape: [1, 1, 2], mean: [0.5], std: [0.25] };
  const rgba = Uint8Array.from([255, 255, 255, 255, 0, 0, 0, 255]);
  assert.deepEqual(Array.from(toModelInput(rgba, 2, 1, spec)), [2, -2]);
  assert.deepEqual(Array.from(normalizePixels(Uint8Array.from([255]), { shape: [1, 1, 1] })), [1]);
  assert.throws(() => toModelInput(rgba, 3, 1, spec), /an image of 3x1 has 8 RGBA values/);
  assert.throws(() => toModelInput(rgba, 2, 1, { shape: [4, 2, 2] }), /the model takes 4-channel images/);
});
