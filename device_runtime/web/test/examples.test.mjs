// The person's examples as the page keeps them: appended, then removed by class or by the last addition.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { appendExamples, emptyExamples, keepExamples, withoutClass, withoutLastAdded } from '../src/data.js';

/** `count` 2x1 grey examples, example i's pixels [i, i], of the given labels. */
function batch(labels, first = 0) {
  const pixels = new Uint8Array(labels.length * 2);
  labels.forEach((_, i) => {
    pixels.fill(first + i, 2 * i, 2 * i + 2);
  });
  return { pixels, labels: Int32Array.from(labels), count: labels.length };
}

test('a class removed takes its examples (pixels with labels) and nothing else; the last addition is forgotten', () => {
  let examples = appendExamples(emptyExamples([1, 1, 2]), batch([0, 1, 0]));
  examples = appendExamples(examples, batch([2, 1], 3));
  assert.equal(examples.lastAdded, 2);
  const left = withoutClass(examples, 1);
  assert.deepEqual([...left.labels], [0, 0, 2]);
  assert.deepEqual([...left.pixels], [0, 0, 2, 2, 3, 3]);
  assert.deepEqual([left.count, left.lastAdded, left.shape], [3, 0, [1, 1, 2]]);
  const undone = withoutLastAdded(examples);
  assert.deepEqual([...undone.labels], [0, 1, 0]);
  assert.deepEqual([...undone.pixels], [0, 0, 1, 1, 2, 2]);
  assert.equal(withoutLastAdded(left).count, 3, 'after a removal nothing counts as the last addition');
  assert.equal(keepExamples(examples, () => true).count, 0);
});
