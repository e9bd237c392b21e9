// @ts-check
// Next-word text, the kind of a text bundle (manifest `sample.kind` "next-word"): the sentences a person finishes
// in the keyboard (keyboard.js) or the lines of a .txt they pick, kept on the phone (collection.js) and made into
// next-word samples by ONE function, textSamples, as edgepfl/kinds/nextword.py makes them from a .txt: in time
// order, the last part held out, accuracy counting only the targets the manifest's `metric_ignores` leaves. Saved,
// the sentences are that .txt, a line each. Try it is the keyboard itself.

import { pickSamples } from './algorithms.js';
import { openCollection } from './collection.js';
import { DataError } from './errors.js';
import { setUpKeyboard } from './keyboard.js';
import { sampleEntry } from './manifest.js';
import { decodeSentence, decodeTyping, sentenceRecord } from './records.js';
import {
  LINE_BREAK,
  MIN_DEVICE_WORDS,
  loadVocabulary,
  nextWordSamples,
  readText,
  timeOrderSplit,
  tokenize,
} from './text.js';

/** @typedef {import('./kinds.js').KindWords} KindWords */
/** @typedef {import('./kinds.js').SampleKind} SampleKind */
/** @typedef {import('./algorithms.js').Samples} Samples */
/** @typedef {import('./text.js').Vocabulary} Vocabulary */
/** @typedef {import('./text.js').TextTask} TextEntry */
/** @typedef {import('./collection.js').Collecting<string>} Sentences */

export const MAX_SENTENCES = 2000; // sentences the phone keeps, the oldest dropped (a few months of messages)
const SOURCE = 'the text on this phone'; // how a line names the collected sentences

/** @type {KindWords} */
const WORDS = {
  one: 'next word',
  sample: 'sentence', // a sample is a line's words (20 at most), every next word of it taught and scored
  right: 'guessed right',
  more: ' (write more)',
  rate: 'sentences',
  measure:
    "This counts how often the word you wrote next is the model's first guess " +
    '(words the model does not know are not counted).',
};

/** @type {SampleKind} */
export const nextWordKind = {
  name: 'next-word',
  words: WORDS,
  // the keyboard's chips come faster from an engine on the page's thread (bench/web_capture.py)
  freeThread: false,
  async open({ manifest, store, contract, bundleFile }) {
    // the bundle's vocabulary comes with the bundle, its sha256 checked against the manifest's
    const entry = /** @type {TextEntry} */ (/** @type {unknown} */ (sampleEntry(manifest)));
    const vocabulary = await loadVocabulary(await bundleFile(entry.vocab), entry);
    const collection = await openCollection({ store, contract, kind: sentences(vocabulary, entry) });
    const typing = decodeTyping((await store.get('typing')).typing);
    return {
      examples: collection.examples,
      tryIt: (parts) => setUpKeyboard({ ...parts, vocabulary, collection, typing }),
    };
  },
};

/**
 * The next-word samples of sentences (lines) in their order: THE one place the page makes them (NextWordKind.read,
 * edgepfl/kinds/nextword.py); refused when the sentences hold fewer than MIN_DEVICE_WORDS words.
 * @param {string[]} lines
 * @param {Vocabulary} vocabulary
 * @param {TextEntry} entry
 * @param {string} [source] how a refusal names the text
 * @returns {Samples}
 */
export function textSamples(lines, vocabulary, entry, source = SOURCE) {
  return nextWordSamples(lines.join('\n'), vocabulary, entry.seq_len, source);
}

/**
 * The time-order split of sentences' samples (edgepfl/data.py split_time_order): the last part held out, of which accuracy counts
 * only the targets the manifest's `metric_ignores` leaves.
 * @param {string[]} lines
 * @param {Vocabulary} vocabulary
 * @param {TextEntry} entry
 * @param {number} valFraction
 */
export function splitText(lines, vocabulary, entry, valFraction) {
  return timeOrderParts(textSamples(lines, vocabulary, entry), entry, valFraction);
}

/** Samples split in time order (the last part held out, counting only targets outside `metric_ignores`). */
function timeOrderParts(
  /** @type {Samples} */ samples,
  /** @type {TextEntry} */ entry,
  /** @type {number} */ valFraction,
) {
  const { train, val } = timeOrderSplit(samples.y, samples.count, valFraction, entry.metric_ignores || []);
  return { train: pickSamples(samples, train), val: pickSamples(samples, val) };
}

/** The .txt Save my data writes: a line a sentence (`edgepfl device train --data` reads the same lines back). */
export function textFile(/** @type {string[]} */ lines) {
  return lines.map((line) => `${line}\n`).join('');
}

/**
 * The lines of a picked .txt file that hold words (a line without any makes no sample, here or in Python).
 * @param {Uint8Array} bytes
 * @param {string} name
 */
export function textLines(bytes, name) {
  const source = `the file ${name}`;
  const lines = readText(bytes, source)
    .split(LINE_BREAK)
    .filter((line) => tokenize(line).length);
  if (!lines.length) throw new DataError(`${source} holds no words`, 'pick a text with words in it, a line a message');
  return lines;
}

/** How sentences are collected: one record each, the .txt that Save my data writes and a picked one. */
function sentences(/** @type {Vocabulary} */ vocabulary, /** @type {TextEntry} */ entry) {
  const words = (/** @type {string[]} */ lines) => lines.reduce((sum, line) => sum + tokenize(line).length, 0);
  // the samples of the sentences held now (the collection hands a new array after each change): made once, by
  // textSamples, for the count, the split and the probe; too few words make none
  /** @type {{lines: string[] | null, samples: Samples | null}} */
  let made = { lines: null, samples: null };
  const samplesOf = (/** @type {string[]} */ lines) => {
    if (made.lines !== lines) {
      made = { lines, samples: words(lines) < MIN_DEVICE_WORDS ? null : textSamples(lines, vocabulary, entry) };
    }
    return made.samples;
  };
  /** @type {Sentences} */
  const kind = {
    name: nextWordKind.name,
    words: WORDS,
    file: {
      title: 'Your text',
      needs:
        'The model learns to suggest your next word from what you write: every sentence you finish in the box ' +
        'above stays on this phone and teaches it in the next round. A UTF-8 .txt file (a line a message) adds ' +
        'more. The last part is kept aside to check the suggestions.',
      pick: 'Add a text file (.txt)',
      accept: '.txt,text/plain',
      suffix: '.txt',
      notFix: 'pick a plain-text (.txt) file, saved as UTF-8',
      record: 'sentence',
      forget: 'Forget what I typed',
      fileName: 'my-text.txt',
      fileType: 'text/plain;charset=utf-8',
    },
    cap: MAX_SENTENCES,
    decode: decodeSentence,
    encode: sentenceRecord,
    read: textLines,
    write: textFile,
    // below MIN_DEVICE_WORDS words (too few to train on) the sentences are counted: the page asks for more
    count: (lines) => samplesOf(lines)?.count ?? lines.length,
    classesHeld: () => 0,
    // too few words: textSamples refuses them in one line
    split: (lines, valFraction) =>
      timeOrderParts(samplesOf(lines) || textSamples(lines, vocabulary, entry), entry, valFraction),
    probe: (lines, count) => {
      const samples = samplesOf(lines);
      if (!samples) return null;
      const n = Math.min(count, samples.count);
      return { x: samples.x.subarray(0, n * entry.seq_len), count: n };
    },
    forgotten: { typing: undefined },
  };
  return kind;
}
