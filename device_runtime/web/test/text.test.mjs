// The page's tokenizer, vocabulary and next-word window against Python's (edgepfl/text.py, via make_fixtures.py).

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { DeviceError } from '../src/errors.js';
import { BOS_ID, OOV_ID, PAD_ID, Vocabulary, context, loadVocabulary, phraseContext, tokenize } from '../src/text.js';
import { NEEDS_FIXTURES, expected, fixtureBytes } from './fixtures.mjs';

test("tricky strings give exactly Python's tokens, ids and next-word windows", { skip: NEEDS_FIXTURES }, async () => {
  const { task, cases } = expected().text;
  const vocabulary = await loadVocabulary(fixtureBytes('text/vocab.json'), task);
  assert.equal(vocabulary.words.length, task.vocab_size);
  for (const { text, tokens, ids, context: window } of cases) {
    assert.deepEqual(tokenize(text), tokens, JSON.stringify(text));
    assert.deepEqual(vocabulary.encode(tokenize(text)), ids, JSON.stringify(text));
    assert.deepEqual(phraseContext(text, vocabulary, task.seq_len), window, JSON.stringify(text));
  }
});

test("a vocabulary other than the manifest's is refused in one line", { skip: NEEDS_FIXTURES }, async () => {
  const { task } = expected().text;
  const bytes = fixtureBytes('text/vocab.json');
  const changed = bytes.slice();
  changed[changed.length - 3] ^= 1;
  await assert.rejects(
    loadVocabulary(changed, task),
    (err) => err instanceof DeviceError && /sha256/.test(err.problem),
  );
  await assert.rejects(
    loadVocabulary(bytes, { ...task, vocab_size: task.vocab_size + 1 }),
    (err) => err instanceof DeviceError && /the manifest says/.test(err.problem),
  );
});

test('a window keeps the last ids and pads on the right', () => {
  assert.deepEqual(context([7, 8, 9], 5), [7, 8, 9, PAD_ID, PAD_ID]);
  assert.deepEqual(context([5, 6, 7, 8, 9], 3), [7, 8, 9]);
  const vocabulary = new Vocabulary(['<pad>', '<oov>', '<bos>', '<eos>', 'hello']);
  assert.deepEqual(phraseContext('Hello there', vocabulary, 4), [BOS_ID, 4, OOV_ID, PAD_ID]);
  assert.throws(() => new Vocabulary(['hello']), /must start with <pad>/);
  assert.throws(() => new Vocabulary(['<pad>', '<oov>', '<bos>', '<eos>', 'a', 'a']), /twice/);
});
