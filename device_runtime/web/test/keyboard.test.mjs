// The keyboard's rules (src/suggest.js, src/keyboard.js): the person's dictionary (typed twice is learned, capped,
// the least recently typed dropped), the words offered (the model's by probability, the dictionary's in <oov>'s
// place, completions of the word being typed), what is typed cut into its context and its word, the sentences a
// person finishes, and a word in a script the vocabulary lacks.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { finishedSentences } from '../src/keyboard.js';
import {
  LEARN_AT,
  UserDictionary,
  learnDictionary,
  scriptOf,
  suggestions,
  typedParts,
  unknownScript,
  vocabularyScripts,
} from '../src/suggest.js';
import { Vocabulary, tokenize } from '../src/text.js';

const VOCABULARY = new Vocabulary(['<pad>', '<oov>', '<bos>', '<eos>', 'to', 'be', 'or', 'not', ',', 'bees', 'the']);

test('a word outside the vocabulary typed twice is learned; vocabulary words and punctuation never are', () => {
  assert.equal(LEARN_AT, 2);
  const dictionary = new UserDictionary(VOCABULARY);
  dictionary.learn(tokenize('Zoë to be, zorblax!'));
  assert.deepEqual(dictionary.words(), []);
  assert.deepEqual(dictionary.entries(), [
    ['zoë', 1],
    ['zorblax', 1],
  ]);
  dictionary.learn(tokenize('ZOË again'));
  assert.deepEqual(dictionary.words(), ['zoë']);
  dictionary.learn(tokenize("zorblax's zorblax"));
  // the most recently typed first; "zorblax's" is a word of its own (tokenize keeps inner apostrophes)
  assert.deepEqual(dictionary.words(), ['zorblax', 'zoë']);
  assert.deepEqual(
    dictionary.entries().map(([word]) => word),
    ['zoë', 'again', "zorblax's", 'zorblax'],
  );
});

test('the dictionary keeps its cap, dropping the least recently typed word', () => {
  const dictionary = learnDictionary(['alpha beta', 'gamma alpha', 'delta'], VOCABULARY, 3);
  // beta is the least recently typed when delta comes: dropped, alpha (typed again) stays
  assert.deepEqual(dictionary.entries(), [
    ['gamma', 1],
    ['alpha', 2],
    ['delta', 1],
  ]);
  assert.deepEqual(dictionary.words(), ['alpha']);
});

test("the words offered: the model's by probability, the learned words at <oov>'s, those that start as typed", () => {
  //                         pad  oov  bos  eos  to   be   or   not  ,    bees the
  const probabilities = [0.5, 0.2, 0.4, 0.3, 0.05, 0.1, 0.2, 0.01, 0.15, 0.01, 0.02];
  const words = (/** @type {string[]} */ learned, prefix = '', k = 3) =>
    suggestions(probabilities, VOCABULARY, learned, prefix, k).map((s) => [s.word, s.probability, s.learned]);
  // no special token is offered however likely; "or" and <oov>'s 0.2 tie: the lower id (<oov>) first
  assert.deepEqual(words([]), [
    ['or', 0.2, false],
    [',', 0.15, false],
    ['be', 0.1, false],
  ]);
  assert.deepEqual(words(['zorblax', 'zoë']), [
    ['zorblax', 0.2, true],
    ['zoë', 0.2, true],
    ['or', 0.2, false],
  ]);
  // completions of the word being typed, the model's and the dictionary's
  assert.deepEqual(words(['zorblax', 'bee'], 'b'), [
    ['bee', 0.2, true],
    ['be', 0.1, false],
    ['bees', 0.01, false],
  ]);
  assert.deepEqual(words([], 'q'), []);
});

test('what is typed is cut into the context the model reads and the word being typed', () => {
  assert.deepEqual(typedParts('to be or no'), { context: 'to be or ', typedWord: 'no', prefix: 'no' });
  assert.deepEqual(typedParts('to be '), { context: 'to be ', typedWord: '', prefix: '' });
  assert.deepEqual(typedParts('To be,'), { context: 'To be,', typedWord: '', prefix: '' });
  assert.deepEqual(typedParts('I DON\u2019'), { context: 'I ', typedWord: 'DON\u2019', prefix: "don'" });
  assert.deepEqual(typedParts("he said 'Zo"), { context: "he said '", typedWord: 'Zo', prefix: 'zo' });
  assert.deepEqual(typedParts(''), { context: '', typedWord: '', prefix: '' });
});

test('a sentence is finished by its full stop, question or exclamation mark and a space, or a line break', () => {
  const text = 'Hello there. How are you?\nFine! e.g. this';
  assert.deepEqual(finishedSentences(text, 0, false), {
    sentences: ['Hello there.', ' How are you?', '\n', 'Fine!', ' e.g.'],
    end: 36,
  });
  assert.deepEqual(finishedSentences(text, 36, false), { sentences: [], end: 36 });
  assert.deepEqual(finishedSentences(text, 36, true), { sentences: [' this'], end: 41 });
  assert.deepEqual(finishedSentences('Done. ', 0, true), { sentences: ['Done.'], end: 5 });
  assert.deepEqual(finishedSentences('   ', 0, true), { sentences: [], end: 0 });
  assert.deepEqual(finishedSentences('"Really?" she said', 0, false).sentences, ['"Really?"']);
});

test("a word in a script none of the vocabulary's words is written in is found", () => {
  const scripts = vocabularyScripts(VOCABULARY);
  assert.deepEqual([...scripts], ['Latin']);
  assert.equal(unknownScript(tokenize('hello привет мир'), scripts), 'Cyrillic');
  assert.equal(unknownScript(tokenize('hello, 42 zoë!'), scripts), '');
  assert.deepEqual(['日本', 'ελλάδα', '42', ','].map(scriptOf), ['Han', 'Greek', '', '']);
});
