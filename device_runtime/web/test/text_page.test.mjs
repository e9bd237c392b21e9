// The page on a text bundle against the Python device (make_text_fixtures.py): a person's .txt file gives the
// samples and the time-order split of device_runtime/task_data.py, a step on them the portable engine's tensors,
// and "Try it" the words `device predict --text` suggests. Then what the page says to a wrong file.

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import * as ort from 'onnxruntime-web';
import { shortfallLine, shortfallReason } from '../src/data.js';
import { openEngine } from '../src/engine.js';
import { checkModelFile, deviceModelFile } from '../src/modelfile.js';
import { DataError } from '../src/errors.js';
import { scoreSentence } from '../src/results.js';
import { sampleEntry } from '../src/manifest.js';
import { decodeSafetensors } from '../src/safetensors.js';
import { nextWordKind, splitText, textLines, textSamples } from '../src/kind_next_word.js';
import { sensorKind } from '../src/kind_sensor.js';
import { suggestions } from '../src/suggest.js';
import { Vocabulary, loadVocabulary, phraseContext } from '../src/text.js';
import { FIXTURES, NEEDS_FIXTURES, bundleAt, fixtureContract, maxAbsDiff } from './fixtures.mjs';

const TOLERANCE = 1e-5; // as text_engine.test.mjs
const TEXT = join(FIXTURES, 'text');

/** The fixture's text bundle as the page holds it, its vocabulary checked, and what Python made of notes.txt. */
async function textBundle() {
  const { manifest, files } = bundleAt(join(TEXT, 'bundle'));
  const entry = sampleEntry(manifest);
  const vocabulary = await loadVocabulary(files.get(entry.vocab), entry);
  const want = JSON.parse(readFileSync(join(TEXT, 'expected.json'), 'utf8'));
  return { manifest, files, vocabulary, entry, want };
}

const notes = () => new Uint8Array(readFileSync(join(TEXT, 'notes.txt')));

const FIXTURED = { skip: NEEDS_FIXTURES };

test(
  "a person's text gives Python's next-word samples and time-order split, <oov> targets not counted",
  FIXTURED,
  async () => {
    const { vocabulary, entry, want } = await textBundle();
    const lines = textLines(notes(), 'notes.txt');
    const samples = textSamples(lines, vocabulary, entry);
    assert.equal(samples.count, want.notes.y.length);
    assert.deepEqual(Array.from(samples.x, Number), want.notes.x.flat());
    assert.deepEqual(Array.from(samples.y), want.notes.y.flat()); // the next token at every position
    const { train, val } = splitText(lines, vocabulary, entry, want.notes.val_fraction);
    assert.deepEqual(
      Array.from(train.y),
      want.notes.train.flatMap((i) => want.notes.y[i]),
    );
    assert.deepEqual(
      Array.from(val.y),
      want.notes.held_out.flatMap((i) => want.notes.y[i]),
    );
    assert.deepEqual(
      Array.from(val.x, Number),
      want.notes.held_out.flatMap((i) => want.notes.x[i]),
    );
    // each held-out sample has a target the metric counts (the engine weighs the others 0)
    const per = entry.seq_len;
    for (let i = 0; i < val.count; i++)
      assert.ok(val.y.subarray(i * per, (i + 1) * per).some((id) => !entry.metric_ignores.includes(id)));
  },
);

test("a step on the page's samples of the text gives the Python portable engine's tensors", FIXTURED, async () => {
  const { manifest, files, vocabulary, entry, want } = await textBundle();
  const engine = await openEngine(ort, manifest, files, { threads: 1 });
  const { train } = splitText(textLines(notes(), 'notes.txt'), vocabulary, entry, want.notes.val_fraction);
  const count = want.notes.step.count;
  const x = train.x.subarray(0, count * engine.sampleSize);
  const y = train.y.subarray(0, count * engine.targetSize);
  const loss = await engine.trainStep(x, y, count, want.lr, 'full');
  assert.ok(Math.abs(loss - want.notes.step.loss) <= TOLERANCE, `loss ${loss} vs ${want.notes.step.loss}`);
  const after = decodeSafetensors(new Uint8Array(readFileSync(join(TEXT, 'after-notes.safetensors'))), 'after').tensors;
  const got = await engine.getTensors();
  for (const name of Object.keys(after)) {
    assert.ok(maxAbsDiff(got[name].data, after[name].data) <= TOLERANCE, `${name} differs from Python`);
  }
  // "Save the model" on a text bundle: the file takes token ids and answers as the engine does on the person's text
  const { model_file: spec } = fixtureContract();
  const device = { trained: true, lastCompletedRound: 1, description: 'trained: after round 1' };
  const file = deviceModelFile(files.get('model.onnx'), await engine.getTensors(), manifest, spec, device);
  const probes = train.x.subarray(0, 8 * engine.sampleSize);
  assert.ok((await checkModelFile(ort, file, engine, probes, 8, spec)) <= spec.check_tolerance);
});

test("the keyboard's chips for a phrase are the words `device predict --text` offers", FIXTURED, async () => {
  const { manifest, files, vocabulary, want } = await textBundle();
  const engine = await openEngine(ort, manifest, files, { threads: 1 });
  for (const [phrase, expected] of Object.entries(want.notes.suggestions)) {
    const ids = BigInt64Array.from(phraseContext(phrase, vocabulary, engine.sampleSize), BigInt);
    const words = suggestions(await engine.predict(ids, 1), vocabulary, [], '', 3);
    const shown = JSON.stringify(phrase);
    assert.deepEqual(
      words.map((w) => w.word),
      expected.map(([, word]) => word),
      shown,
    );
    assert.ok(
      maxAbsDiff(
        words.map((w) => w.probability),
        expected.map((e) => e[2]),
      ) <= TOLERANCE,
      shown,
    );
  }
});

test('a file that is not UTF-8 or holds no words is refused in words a person can act on', () => {
  const refused = (/** @type {RegExp} */ problem, /** @type {RegExp} */ fix) => (/** @type {unknown} */ err) =>
    err instanceof DataError && problem.test(err.problem) && fix.test(err.fix);
  const utf8 = (/** @type {string} */ text) => new TextEncoder().encode(text);
  assert.throws(
    () => textLines(new Uint8Array([0x68, 0xff, 0x0a]), 'notes.txt'),
    refused(/the file notes\.txt is not UTF-8 text/, /UTF-8/),
  );
  assert.throws(() => textLines(utf8('\n \n'), 'notes.txt'), refused(/holds no words/, /text with words/));
  // lines without words make no sample, here or in Python: they are not kept
  assert.deepEqual(textLines(utf8('\ufeffhello there\r\n\n...\n  hello you\u2028!'), 'n.txt'), [
    'hello there',
    '...',
    '  hello you',
    '!',
  ]);
  // too few words to train on: counted as words (the page asks for more), never split
  const entry = { kind: 'next-word', seq_len: 3, metric_ignores: [0, 1], vocab: '', vocab_sha256: '', vocab_size: 5 };
  const vocabulary = new Vocabulary(['<pad>', '<oov>', '<bos>', '<eos>', 'hello']);
  const short = /the text on this phone holds only 3 words; the model needs at least 10/;
  assert.throws(() => textSamples(['hello hello.'], vocabulary, entry), refused(short, /longer text/));
  const samples = textSamples(['hello there, hello you. hello!', 'hello hello'], vocabulary, entry);
  // 8 tokens and <eos>: 9 targets, 3 sequences of 3; then 2 and <eos>: one sequence
  assert.equal(samples.count, 3 + 1);
  assert.deepEqual(Array.from(samples.y.subarray(9)), [4, 4, 3]);
});

test("the page counts a text bundle's samples as sentences, scores its next words, and asks for more text", () => {
  const device = { val_fraction: 0.2, min_train_examples: 8, min_held_out: 2 };
  assert.equal(
    shortfallLine(7, device, nextWordKind.words),
    'Add 3 more sentences (write more) to take part in the rounds.',
  );
  assert.equal(
    shortfallReason(7, device, nextWordKind.words),
    'The model needs 10 sentences: 8 to learn from and 2 kept aside to check how well it does.',
  );
  assert.equal(shortfallLine(0, device, sensorKind.words), 'Add 10 windows (record more) to take part in the rounds.');
  const measured = { accuracy: 0.25, count: 16, final: false, roundsHere: 1, round: 1 };
  const after = 'by your model after round 1';
  assert.equal(
    scoreSentence({ ...measured, words: nextWordKind.words }),
    `25.0% of the 16 next words kept aside are guessed right ${after}`,
  );
  assert.equal(
    scoreSentence({ ...measured, words: sensorKind.words }),
    `25.0% of the 16 windows kept aside are recognised ${after}`,
  );
});
