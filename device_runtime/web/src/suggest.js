// @ts-check
// What the keyboard offers, by the rules edgepfl/kinds/next_word.py follows too (a fixture written by Python pins
// both): the person's own dictionary of words outside the bundle's vocabulary (AOSP LatinIME's rule: a word typed
// twice is learned; at most DICTIONARY_CAP words, the least recently typed dropped), and the words offered after
// what is typed: the model's words by probability, the dictionary's learned words in <oov>'s place (the model's
// belief that the next word is one it does not know), those that start with the word being typed.

import { OOV_ID, tokenize } from './text.js';

/** @typedef {import('./text.js').Vocabulary} Vocabulary */
/** One word offered: the word, its probability (a dictionary word: <oov>'s), and where it comes from. @typedef {{word: string, probability: number, learned: boolean}} Suggestion */

export const LEARN_AT = 2; // LatinIME: a word typed twice is the person's own word
export const DICTIONARY_CAP = 1000; // words the dictionary keeps (learned or on their way), the least recently typed dropped
const WORD = /^[\p{L}\p{N}]+(?:'[\p{L}\p{N}]+)*$/u; // a token that is a word (tokenize's), not punctuation
const SPECIALS = 4; // <pad>, <oov>, <bos>, <eos>: never offered (nobody types them)

/** The person's own words outside the vocabulary: each with how often it was typed, least recently typed first. */
export class UserDictionary {
  /**
   * @param {Vocabulary} vocabulary the bundle's: its words are the model's, never the dictionary's
   * @param {number} [cap]
   */
  constructor(vocabulary, cap = DICTIONARY_CAP) {
    this.vocabulary = vocabulary;
    this.cap = cap;
    /** @type {Map<string, number>} word -> times typed, in the order last typed (a Map keeps insertion order) */
    this.counts = new Map();
  }

  /** Count the words of one finished sentence (its tokens, in order) that the vocabulary lacks. */
  learn(/** @type {string[]} */ tokens) {
    for (const token of tokens) {
      if (!WORD.test(token) || this.vocabulary.index.has(token)) continue;
      const count = (this.counts.get(token) || 0) + 1;
      this.counts.delete(token); // typed now: the most recent
      this.counts.set(token, count);
      if (this.counts.size > this.cap) this.counts.delete(/** @type {string} */ (this.counts.keys().next().value));
    }
  }

  /** The learned words (typed LEARN_AT times or more), the most recently typed first. */
  words() {
    return [...this.counts]
      .filter(([, count]) => count >= LEARN_AT)
      .map(([word]) => word)
      .reverse();
  }

  /** [word, count] pairs, least recently typed first (the fixture's form). */
  entries() {
    return [...this.counts];
  }
}

/** The dictionary learned from sentences in the order they were finished (the page's store, or a .txt's lines). */
export function learnDictionary(
  /** @type {string[]} */ sentences,
  /** @type {Vocabulary} */ vocabulary,
  cap = DICTIONARY_CAP,
) {
  const dictionary = new UserDictionary(vocabulary, cap);
  for (const sentence of sentences) dictionary.learn(tokenize(sentence));
  return dictionary;
}

/**
 * What is typed so far, cut where the model reads it: the text before the word being typed (`context`), that word
 * as typed (`typedWord`) and as tokenize writes it (`prefix`; both '' right after a space or a punctuation mark).
 * @param {string} typed
 */
export function typedParts(typed) {
  const partial = (/[\p{L}\p{N}'\u2019]*$/u.exec(typed) || [''])[0].replace(/^['\u2019]+/, '');
  const prefix = partial.normalize('NFKC').toLowerCase().replaceAll('\u2019', "'");
  return { context: typed.slice(0, typed.length - partial.length), typedWord: partial, prefix };
}

/**
 * The `k` words to offer after a context: the vocabulary's words by the model's probability (no special token),
 * with the dictionary's learned words in <oov>'s place, each at <oov>'s probability; only words that start with
 * `prefix`. Ties: the lower id first (a dictionary word's is <oov>'s), then the more recently typed.
 * @param {ArrayLike<number>} probabilities the model's, one per vocabulary word
 * @param {Vocabulary} vocabulary
 * @param {string[]} learned the dictionary's words, most recently typed first (UserDictionary.words())
 * @param {string} prefix
 * @param {number} k
 * @returns {Suggestion[]}
 */
export function suggestions(probabilities, vocabulary, learned, prefix, k) {
  const model = vocabulary.words.map((word, id) => ({ word, id, order: 0, learned: false }));
  const own = learned.map((word, order) => ({ word, id: OOV_ID, order, learned: true }));
  return [...model.slice(SPECIALS), ...own]
    .filter(({ word }) => word.startsWith(prefix))
    .map((candidate) => ({ ...candidate, probability: probabilities[candidate.id] }))
    .sort((a, b) => b.probability - a.probability || a.id - b.id || a.order - b.order)
    .slice(0, k)
    .map(({ word, probability, learned: isOwn }) => ({ word, probability, learned: isOwn }));
}

// the scripts a vocabulary's words and a person's words are told apart by (Unicode's Script property)
const SCRIPTS = ['Latin', 'Cyrillic', 'Greek', 'Arabic', 'Hebrew', 'Devanagari', 'Han', 'Hiragana', 'Katakana']
  .concat(['Hangul', 'Thai', 'Armenian', 'Georgian', 'Bengali', 'Tamil'])
  .map((name) => /** @type {[string, RegExp]} */ ([name, new RegExp(`\\p{Script=${name}}`, 'u')]));

/** The script of a word's first letter ('' for none of those the page tells apart, or no letter). */
export function scriptOf(/** @type {string} */ word) {
  const letter = /\p{L}/u.exec(word);
  if (!letter) return '';
  const found = SCRIPTS.find(([, test]) => test.test(letter[0]));
  return found ? found[0] : '';
}

/** The scripts of a vocabulary's words. */
export function vocabularyScripts(/** @type {Vocabulary} */ vocabulary) {
  return new Set(vocabulary.words.slice(SPECIALS).map(scriptOf).filter(Boolean));
}

/** The first script among `tokens` that none of the vocabulary's words is written in ('' when there is none). */
export function unknownScript(/** @type {string[]} */ tokens, /** @type {Set<string>} */ known) {
  for (const token of tokens) {
    const script = scriptOf(token);
    if (script && !known.has(script)) return script;
  }
  return '';
}
