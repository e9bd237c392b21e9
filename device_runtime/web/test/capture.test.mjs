// The keyboard and the motion recorder against Python (make_capture_fixtures.py): the person's dictionary and the
// words offered are edgepfl/kinds/userwords.py's on every case; a phone's readings become a sensor bundle's channels
// in its units exactly as the sensor kind's from_motion makes them, and the CSV Save my data writes is read back by
// Python's reader to those same numbers; the .txt it writes gives Python's next-word samples.

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { textFile, textSamples } from '../src/kind_next_word.js';
import { sampleEntry } from '../src/manifest.js';
import { Resampler, Windower, channelSources } from '../src/resample.js';
import { writeSensorCsv } from '../src/sensors.js';
import { learnDictionary, suggestions } from '../src/suggest.js';
import { Vocabulary, loadVocabulary } from '../src/text.js';
import { FIXTURES, NEEDS_FIXTURES, bundleAt } from './fixtures.mjs';

const PYTHON = process.env.EDGEPFL_WEB_PYTHON || '';
const WITH_PYTHON = { skip: NEEDS_FIXTURES || (!PYTHON && 'EDGEPFL_WEB_PYTHON is unset: run scripts/web-env.sh') };
const capture = () => JSON.parse(readFileSync(join(FIXTURES, 'capture.json'), 'utf8'));

test("the dictionary and the words offered are Python's on every case", { skip: NEEDS_FIXTURES }, () => {
  const { words, sentences, dictionaries, learned, offers } = capture();
  const vocabulary = new Vocabulary(words);
  for (const want of dictionaries) {
    const dictionary = learnDictionary(sentences.slice(0, want.sentences), vocabulary, want.cap);
    const what = `cap ${want.cap}, ${want.sentences} sentences`;
    assert.deepEqual(dictionary.entries(), want.entries, what);
    assert.deepEqual(dictionary.words(), want.words, what);
  }
  assert.ok(learned.includes('zorblax') && !learned.includes('to'), 'the cases learn a word and not a known one');
  for (const { probabilities, prefix, offered } of offers) {
    const got = suggestions(Float32Array.from(probabilities), vocabulary, learned, prefix, 3);
    assert.deepEqual(
      got.map((s) => [s.word, s.probability]),
      offered.map(([, word, probability]) => [word, probability]),
      JSON.stringify({ prefix, probabilities }),
    );
  }
});

/** The one window the page cuts of a case's readings: both sensors read every period, on the sample's time. */
function recorded(/** @type {any} */ motion) {
  const { entry, acceleration, rotation } = motion;
  const sources = channelSources(entry.channels, entry.units);
  /** @type {Float32Array[]} */
  const windows = [];
  const windower = new Windower(entry.channels.length, entry.window, entry.step, (w) => windows.push(w));
  const resampler = new Resampler(sources, entry.rate_hz, {
    sample: (_, values) => windower.push(values),
    gap: () => {},
  });
  acceleration.forEach((/** @type {number[]} */ [x, y, z], /** @type {number} */ k) => {
    const t = (k * 1000) / entry.rate_hz;
    resampler.push('acc', { t, x, y, z });
    const [rx, ry, rz] = rotation[k];
    resampler.push('gyro', { t, x: rx, y: ry, z: rz });
  });
  assert.equal(windows.length, 1);
  return windows[0];
}

test("a phone's readings become the bundle's channels in its units as the sensor kind converts them", {
  skip: NEEDS_FIXTURES,
}, () => {
  for (const motion of capture().motion) {
    assert.deepEqual(Array.from(recorded(motion)), motion.channels.flat(), JSON.stringify(motion.entry));
  }
});

test(
  "Save my data's CSV and .txt, read by Python's readers, give the page's windows and samples",
  WITH_PYTHON,
  async () => {
    const folder = mkdtempSync(join(tmpdir(), 'edgepfl-capture-'));
    for (const [i, motion] of capture().motion.entries()) {
      const { entry } = motion;
      const manifest = /** @type {any} */ ({
        num_classes: 2,
        class_names: ['still', 'moving, fast'],
        input: { shape: [entry.channels.length, entry.window] },
        sample: entry,
      });
      const window = recorded(motion);
      const path = join(folder, `my-recordings-${i}.csv`);
      writeFileSync(
        path,
        writeSensorCsv(
          [
            { x: window, label: 1 },
            { x: window.map((v) => -v), label: 0 },
          ],
          manifest,
        ),
      );
      const script = [
        'import json, sys',
        'from pathlib import Path',
        'from edgepfl.kinds import InputSpec, SensorKind',
        'entry = json.loads(sys.argv[2])',
        'kind = SensorKind.from_entry(entry, InputSpec(shape=(len(entry["channels"]), entry["window"])), 2)',
        'x, y, _ = kind.read_csv(Path(sys.argv[1]), ["still", "moving, fast"])',
        'print(json.dumps({"x": x.tolist(), "y": y.tolist()}))',
      ].join('\n');
      const read = JSON.parse(execFileSync(PYTHON, ['-c', script, path, JSON.stringify(entry)], { encoding: 'utf8' }));
      assert.deepEqual(read.y, [1, 0]);
      assert.deepEqual(read.x.flat(2), [...motion.channels.flat(), ...motion.channels.flat().map((v) => -v)]);
    }
    const { manifest, files } = bundleAt(join(FIXTURES, 'text', 'bundle'));
    const entry = /** @type {any} */ (sampleEntry(manifest));
    const vocabulary = await loadVocabulary(files.get(entry.vocab), entry);
    const lines = [
      'To be, or not to be?',
      '  whether \u2019tis nobler',
      'zorblax in the mind',
      'ay, there\u2019s the rub!',
    ];
    const path = join(folder, 'my-text.txt');
    writeFileSync(path, textFile(lines));
    const script = [
      'import json, sys',
      'from pathlib import Path',
      'from edgepfl.manifest import load_manifest',
      'bundle = Path(sys.argv[2])',
      'manifest = load_manifest(bundle)',
      'samples = manifest.kind.read(Path(sys.argv[1]), bundle, manifest.class_labels)',
      'print(json.dumps({"x": samples.x.tolist(), "y": samples.y.tolist()}))',
    ].join('\n');
    const bundle = join(FIXTURES, 'text', 'bundle');
    const read = JSON.parse(execFileSync(PYTHON, ['-c', script, path, bundle], { encoding: 'utf8' }));
    const samples = textSamples(lines, vocabulary, entry);
    assert.deepEqual(Array.from(samples.y), read.y.flat()); // the next token at every position
    assert.deepEqual(Array.from(samples.x, Number), read.x.flat());
  },
);
