// @ts-check
// Word-level text for a next-word bundle, by the rules of edgepfl/text.py: the one tokenizer (NFKC, lower case,
// curly apostrophes made straight, control characters as spaces; a word is a run of letters and digits joined by
// inner apostrophes, any other visible character a token of its own), the bundle's vocab.json checked against its
// manifest, and the window of ids the model reads. A fixture written by Python (test/make_fixtures.py) pins
// tokens, ids and windows of tricky strings on both sides. A person's own text becomes next-word samples as
// edgepfl/kinds/nextword.py makes them (a line's sequences with the next token at every position, in time order,
// the last part held out), and a phrase the model's right-padded window.

import { roundHalfEven } from './algorithms.js';
import { DataError, DeviceError } from './errors.js';
import { checkSha256 } from './sha256.js';

export const SPECIALS = ['<pad>', '<oov>', '<bos>', '<eos>'];
export const PAD_ID = 0;
export const OOV_ID = 1;
export const BOS_ID = 2;
export const EOS_ID = 3;
export const VOCAB_FORMAT = 'edgepfl-vocab/1';

// Python's whitespace (str.isspace) rather than JavaScript's \s, which also counts U+FEFF; the control characters
// among them are spaces already
const SPACE = '\\t\\n\\v\\f\\r\\x1c-\\x1f \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000';
const TOKEN = new RegExp(`[\\p{L}\\p{N}]+(?:'[\\p{L}\\p{N}]+)*|_|[^\\p{L}\\p{N}_${SPACE}]`, 'gu');
// biome-ignore lint/suspicious/noControlCharactersInRegex: the control characters are what this removes
const CONTROL = /[\x00-\x1f\x7f-\x9f]/g;
// Python's str.splitlines boundaries, control characters among them
// biome-ignore lint/suspicious/noControlCharactersInRegex: Python splits lines at these control characters
export const LINE_BREAK = /\r\n|[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]/;
export const MIN_DEVICE_WORDS = 10; // edgepfl/kinds/nextword.py: fewer words make too few samples to train on and hold some out

/** A problem with a text bundle's vocabulary, with the fix (a person's own text is refused as a DataError). */
export class TextError extends DeviceError {}

/**
 * The words and punctuation of `text`, as Python's `edgepfl.text.tokenize` gives them.
 * @param {string} text
 * @returns {string[]}
 */
export function tokenize(text) {
  const plain = text.normalize('NFKC').toLowerCase().replaceAll('\u2019', "'").replace(CONTROL, ' ');
  return plain.match(TOKEN) || [];
}

/**
 * The last `seqLen` ids, right-padded with <pad>: what the model reads to predict the token after the last one.
 * @param {ArrayLike<number>} ids
 * @param {number} seqLen
 * @returns {number[]}
 */
export function context(ids, seqLen) {
  const tail = Array.from(ids).slice(Math.max(ids.length - seqLen, 0));
  return [...tail, ...new Array(seqLen - tail.length).fill(PAD_ID)];
}

/** The words a bundle's model knows, by id (vocab.json), with the encoder of tokens to ids. */
export class Vocabulary {
  /** @param {string[]} words the specials first, then the corpus's words by frequency */
  constructor(words) {
    if (SPECIALS.some((special, i) => words[i] !== special)) {
      throw new TextError(`a vocabulary must start with ${SPECIALS.join(', ')}`, 'export the bundle again');
    }
    /** @type {string[]} */
    this.words = words;
    /** @type {Map<string, number>} */
    this.index = new Map(words.map((word, id) => [word, id]));
    if (this.index.size !== words.length) {
      throw new TextError('the vocabulary lists a word twice', 'export the bundle again');
    }
  }

  /**
   * Token ids, <oov> for a word the vocabulary lacks.
   * @param {string[]} tokens
   * @returns {number[]}
   */
  encode(tokens) {
    return tokens.map((token) => this.index.get(token) ?? OOV_ID);
  }

  /**
   * Words of ids.
   * @param {ArrayLike<number>} ids
   * @returns {string[]}
   */
  decode(ids) {
    return Array.from(ids, (id) => this.words[id]);
  }
}

/**
 * What the model reads to suggest the word after `phrase` (a line typed so far): <bos> and its words, windowed.
 * @param {string} phrase
 * @param {Vocabulary} vocabulary
 * @param {number} seqLen
 * @returns {number[]}
 */
export function phraseContext(phrase, vocabulary, seqLen) {
  return context([BOS_ID, ...vocabulary.encode(tokenize(phrase))], seqLen);
}

/**
 * @typedef {object} TextTask what a text bundle's manifest says of its samples (manifest.json `task`)
 * @property {string} kind "next-word"
 * @property {string} vocab the vocabulary's file in the bundle
 * @property {string} vocab_sha256 its sha256
 * @property {number} vocab_size words, specials included
 * @property {number} seq_len tokens a sample reads
 * @property {number[]} metric_ignores target ids accuracy does not count
 */

/**
 * A bundle's vocabulary from the bytes of its vocab.json, refused unless they are the ones the manifest names.
 * @param {Uint8Array} bytes
 * @param {TextTask} task
 * @returns {Promise<Vocabulary>}
 */
export async function loadVocabulary(bytes, task) {
  await checkSha256(bytes, task.vocab_sha256, task.vocab || 'vocab.json');
  /** @type {unknown} */
  let document;
  try {
    document = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes));
  } catch {
    document = null;
  }
  const words = document && typeof document === 'object' ? /** @type {{words?: unknown}} */ (document).words : null;
  const format = document && typeof document === 'object' ? /** @type {{format?: unknown}} */ (document).format : null;
  if (format !== VOCAB_FORMAT || !Array.isArray(words) || !words.every((word) => typeof word === 'string')) {
    throw new TextError(`${task.vocab || 'vocab.json'} is not an edgepfl vocabulary`, 'export the bundle again');
  }
  const vocabulary = new Vocabulary(words);
  if (vocabulary.words.length !== task.vocab_size) {
    throw new TextError(
      `the vocabulary has ${vocabulary.words.length} words, the manifest says ${task.vocab_size}`,
      'export the bundle again',
    );
  }
  return vocabulary;
}

/**
 * A person's text file as text: UTF-8 (a leading byte-order mark dropped, as Python's utf-8-sig), else refused.
 * @param {Uint8Array} bytes
 * @param {string} name the file's name, for the error
 * @returns {string}
 */
export function readText(bytes, name) {
  try {
    return new TextDecoder('utf-8', { fatal: true }).decode(bytes);
  } catch {
    const fix = 'save it as UTF-8 (most editors: Save As… → encoding UTF-8) and pick it again';
    throw new DataError(`${name} is not UTF-8 text`, fix);
  }
}

/**
 * The next-word samples of a person's text (edgepfl/kinds/nextword.py read, edgepfl/text.py next_word_samples):
 * each line with words as <bos> words <eos>, cut into sequences of seqLen + 1 ids (each starting where the last
 * one's targets ended, the last right-padded with <pad>), in the text's order: x the first seqLen of each, y the
 * next token at every position (seqLen a sample); refused when the text holds fewer than MIN_DEVICE_WORDS words.
 * @param {string} text
 * @param {Vocabulary} vocabulary
 * @param {number} seqLen
 * @param {string} name the file's name, for the error
 * @returns {{x: BigInt64Array, y: Int32Array, count: number}}
 */
export function nextWordSamples(text, vocabulary, seqLen, name) {
  const lines = text
    .split(LINE_BREAK)
    .map(tokenize)
    .filter((tokens) => tokens.length);
  const words = lines.reduce((sum, tokens) => sum + tokens.length, 0);
  if (words < MIN_DEVICE_WORDS) {
    const what = words ? `only ${words} word${words === 1 ? '' : 's'}` : 'no words';
    const problem = `${name} holds ${what}; the model needs at least ${MIN_DEVICE_WORDS}`;
    throw new DataError(problem, 'pick a longer text (a line per message or sentence)');
  }
  /** @type {number[]} */
  const inputs = [];
  /** @type {number[]} */
  const targets = [];
  for (const tokens of lines) {
    const ids = [BOS_ID, ...vocabulary.encode(tokens), EOS_ID];
    for (let start = 0; start < ids.length - 1; start += seqLen) {
      const row = new Array(seqLen + 1).fill(PAD_ID);
      ids.slice(start, start + seqLen + 1).forEach((id, i) => {
        row[i] = id;
      });
      inputs.push(...row.slice(0, seqLen));
      targets.push(...row.slice(1));
    }
  }
  return { x: BigInt64Array.from(inputs, BigInt), y: Int32Array.from(targets), count: targets.length / seqLen };
}

/**
 * The time-order split of `count` next-word samples (edgepfl/data.py split_time_order, scored): the first ones train,
 * the last `valFraction` (at least one sample trains) are held out, those with a target accuracy counts (not
 * `ignores`; the engine weighs each position).
 * @param {Int32Array} targets every sample's targets, `targets.length / count` a sample
 * @param {number} count
 * @param {number} valFraction
 * @param {number[]} ignores the manifest's `metric_ignores`
 * @returns {{train: Int32Array, val: Int32Array}}
 */
export function timeOrderSplit(targets, count, valFraction, ignores) {
  const per = count ? targets.length / count : 1;
  const cut = count - Math.min(roundHalfEven(count * valFraction), count - 1);
  const positions = Array.from({ length: count }, (_, i) => i);
  const counts = (/** @type {number} */ i) =>
    targets.subarray(i * per, (i + 1) * per).some((t) => !ignores.includes(t));
  const val = positions.slice(cut).filter(counts);
  return { train: Int32Array.from(positions.slice(0, cut)), val: Int32Array.from(val) };
}
