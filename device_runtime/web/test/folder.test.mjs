// Image folders read by the page's readFolder against the Python loader (make_fixtures.py write_folders): the same
// labels and pixels, or the same refusal line, for the same files.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import pngjs from 'pngjs';
import { classNames, DataError, readFolder } from '../src/data.js';
import { NEEDS_FIXTURES, expected, fixtureBytes, fixtureTensors } from './fixtures.mjs';

const { PNG } = pngjs;

/** The files as `<input webkitdirectory>` lists them: File-like objects whose paths start at the chosen folder. */
function chosenFolder(entry) {
  return entry.files.map((path) => {
    const relative = path.split('/').slice(2).join('/'); // folders/<case>/<root>/... -> <root>/...
    return { name: relative.split('/').pop(), webkitRelativePath: relative, bytes: fixtureBytes(path) };
  });
}

/** The test's decoder in place of the browser's createImageBitmap: PNG bytes -> RGBA (pngjs expands every PNG type). */
async function decodePng(file) {
  const png = PNG.sync.read(Buffer.from(file.bytes));
  return {
    rgba: new Uint8Array(png.data.buffer, png.data.byteOffset, png.data.length),
    width: png.width,
    height: png.height,
  };
}

test('every folder case gets the Python loader labels and pixels, or its refusal line', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const cases = expected().folders;
  const pixels = fixtureTensors('folders_expected.safetensors');
  assert.ok(cases.length >= 10);
  for (const entry of cases) {
    const names = classNames({ class_names: entry.class_names, num_classes: entry.num_classes });
    const reading = readFolder(chosenFolder(entry), { shape: entry.shape }, names, decodePng);
    if (entry.refused) {
      const { problem, fix } = entry.refused;
      const decoding = problem.includes('is not a readable image (');
      await assert.rejects(reading, (err) => {
        assert.ok(err instanceof DataError, `${entry.case}: ${err}`);
        // a file that does not decode: the same line up to the decoder's own words
        assert.equal(
          decoding ? err.problem.split(' (')[0] : err.problem,
          decoding ? problem.split(' (')[0] : problem,
          entry.case,
        );
        assert.equal(err.fix, fix, entry.case);
        return true;
      });
      continue;
    }
    const examples = await reading;
    assert.deepEqual(Array.from(examples.labels), entry.labels, `${entry.case} labels`);
    assert.deepEqual(examples.pixels, pixels[entry.case].data, `${entry.case} pixels`);
  }
});

test('the trial folder 3/5/7 is classes 3, 5 and 7; a class count stands for the names 0..n-1', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const entry = expected().folders.find((c) => c.case === 'numbers');
  assert.deepEqual(entry.labels, [3, 5, 7]);
  const examples = await readFolder(chosenFolder(entry), { shape: entry.shape }, entry.num_classes, decodePng);
  assert.deepEqual(Array.from(examples.labels), [3, 5, 7]);
});

test('class names: the manifest\'s, or "0".."n-1" without them', () => {
  assert.deepEqual(classNames({ class_names: ['cat', 'dog'], num_classes: 2 }), ['cat', 'dog']);
  assert.deepEqual(classNames({ class_names: [], num_classes: 3 }), ['0', '1', '2']);
  assert.deepEqual(classNames({ num_classes: 2 }), ['0', '1']); // a bundle exported before class names
});
