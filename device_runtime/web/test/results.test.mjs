// The words around a measured accuracy (src/results.js): which model was measured on what, guessing for reference,
// and a result below guessing flagged with what to do.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { imageKind } from '../src/kind_image.js';
import { chanceWords, measuredModel, pct, plural, scoreSentence } from '../src/results.js';

const { words } = imageKind;

test('a phone that joined after training ended is told it measured the shared model, never trained on its examples', () => {
  const line = scoreSentence({ accuracy: 1 / 15, count: 15, final: true, roundsHere: 0, round: 6, words });
  assert.equal(
    line,
    '6.7% of the 15 examples kept aside are recognised by the shared model, which never trained on your examples (this phone took part in no round)',
  );
  assert.doesNotMatch(line, /your model/);
});

test('a phone that trained is told it measured its own model: after a round, or the final one with its own part', () => {
  assert.equal(measuredModel({ final: false, roundsHere: 2, round: 3 }), 'your model after round 3');
  assert.equal(
    measuredModel({ final: true, roundsHere: 2, round: 3 }),
    'your model (the final shared model with the part this phone trained)',
  );
  assert.equal(measuredModel({ final: false, roundsHere: 0, round: null }), 'the model as it came, untrained');
  assert.equal(
    scoreSentence({ accuracy: 0.8125, count: 16, final: false, roundsHere: 1, round: 1, words }),
    '81.3% of the 16 examples kept aside are recognised by your model after round 1',
  );
});

test('results below guessing are flagged with what to do; at or above guessing they are not', () => {
  for (const accuracy of [0.05, 1 / 30]) {
    // the trial's 5.0% and 3.3% with 10 classes
    const words = chanceWords(accuracy, 60, 10);
    assert.ok(words.below, String(accuracy));
    assert.equal(
      words.text,
      'Guessing among your 10 classes would get 10.0%. This is below guessing: the model has not learned your classes yet. Add more examples of each class, and check that each example is under the right class.',
    );
  }
  const few = chanceWords(0.2, 10, 4);
  assert.ok(few.below);
  assert.match(
    few.text,
    /^Guessing among your 4 classes would get 25\.0%\. With only 10 examples kept aside the number is rough, but this is below guessing: .* Add more examples of each class/,
  );
  assert.deepEqual(chanceWords(0.1, 60, 10), { text: 'Guessing among your 10 classes would get 10.0%.', below: false });
  assert.deepEqual(chanceWords(0.9, 60, 10).below, false);
  assert.deepEqual(chanceWords(null, 0, 3), { text: 'Guessing among your 3 classes would get 33.3%.', below: false });
  assert.match(chanceWords(0.0, 5, 1).text, /^All your examples show one class/);
});

test('percentages and counts in words', () => {
  assert.equal(pct(0.05), '5.0%');
  assert.equal(pct(null), '–');
  assert.equal(pct(NaN), '–');
  assert.equal(plural(1, 'example'), '1 example');
  assert.equal(plural(3, 'class', 'classes'), '3 classes');
});
