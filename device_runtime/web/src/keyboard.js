// @ts-check
// A keyboard that learns, a text bundle's Try it: the person writes in a box; chips above it offer the three words
// their own model (the one the device keeps) and their own dictionary give (suggest.js), updated at every keystroke
// (the model asked again at each word boundary, a word's completions filtered from its answer); a tap writes one.
// Every sentence they finish (Enter, or a full stop, question or exclamation mark and a space) joins what the phone
// keeps (collection.js), with the keyboard's own measure: how many of their words a suggestion gave.

import { DeviceError } from './errors.js';
import { pct, plural } from './results.js';
import { learnDictionary, suggestions, typedParts, unknownScript, vocabularyScripts } from './suggest.js';
import { phraseContext, tokenize } from './text.js';
import { $, fatal, showProblem } from './ui.js';

/** @typedef {import('./kinds.js').TryParts} TryParts */
/** @typedef {import('./records.js').Typing} Typing */
/** @typedef {import('./text.js').Vocabulary} Vocabulary */
/** @typedef {import('./collection.js').Collection<string>} Sentences */

const CHIPS = 3; // words offered at a time
const SENTENCE_END = /[.!?\u2026]+["')\]]*(?=\s)|\n/gu; // what finishes a sentence while the person writes on
const WORD = /^[\p{L}\p{N}]+(?:'[\p{L}\p{N}]+)*$/u; // a token that is a word (tokenize's)

/**
 * The writing box, its chips and its measure.
 * @param {TryParts & {vocabulary: Vocabulary, collection: Sentences, typing: Typing}} parts
 * @returns {{modelChanged: () => void}}
 */
export function setUpKeyboard({ engine, held, queue, vocabulary, collection, typing }) {
  const box = $('writing', HTMLTextAreaElement);
  const chips = $('chips');
  const scripts = vocabularyScripts(vocabulary);
  const warned = new Set(); // scripts already said to be the model's unknown, once a page
  let dictionary = learnDictionary(collection.items(), vocabulary);
  collection.onChange(() => {
    dictionary = learnDictionary(collection.items(), vocabulary);
    showMeasure();
    offer(performance.now());
  });
  let measure = typing;
  let committed = 0; // characters of the box already kept (finished sentences)
  let tapped = 0; // words a chip wrote into the sentence being written
  /** @type {{context: string, probabilities: Float32Array | null}} the model's answer for the context asked last */
  let asked = { context: '\0', probabilities: null };

  const showMeasure = () => {
    $('typed-measure').textContent = measure.words
      ? `Suggestions typed ${measure.suggested} of the ${plural(measure.words, 'word')} you wrote here.`
      : '';
    Object.assign($('typed-measure').dataset, { words: String(measure.words), suggested: String(measure.suggested) });
  };

  /** The chips for what is typed now: the model's answer for its context (asked when it changed), filtered. */
  const offer = (/** @type {number} */ since) => {
    const { context, prefix, typedWord } = typedParts(box.value.slice(committed));
    if (context !== asked.context) {
      const askedFor = context;
      asked = { context, probabilities: null };
      queue(async () => {
        if (asked.context !== askedFor) return; // typed on since: the newer context is asked instead
        const ids = BigInt64Array.from(phraseContext(askedFor, vocabulary, engine.sampleSize), BigInt);
        const probabilities = await engine.predict(ids, 1, await held());
        if (asked.context !== askedFor) return;
        asked = { context: askedFor, probabilities };
        offer(since);
      });
      return;
    }
    if (!asked.probabilities) return; // the answer is on its way
    const offered = suggestions(asked.probabilities, vocabulary, dictionary.words(), prefix, CHIPS);
    chips.replaceChildren(
      ...offered.map(({ word, probability, learned }) => {
        const item = document.createElement('li');
        const button = document.createElement('button');
        button.type = 'button';
        button.textContent = word;
        button.title = learned ? 'a word of yours' : pct(probability);
        if (learned) button.classList.add('learned');
        button.addEventListener('click', () => write(word, typedWord));
        item.append(button);
        return item;
      }),
    );
    // for people's tools, the browser test and bench/web_capture.py: what was offered for what, and how fast
    Object.assign(chips.dataset, {
      typed: box.value.slice(committed),
      words: JSON.stringify(offered.map((s) => s.word)),
      learned: JSON.stringify(offered.filter((s) => s.learned).map((s) => s.word)),
      ms: String(performance.now() - since),
    });
  };

  /** A chip tapped: its word in place of the word being typed, then a space. */
  const write = (/** @type {string} */ word, /** @type {string} */ typedWord) => {
    const before = box.value.slice(0, box.value.length - typedWord.length);
    const joined = WORD.test(word) || !before.endsWith(' ') ? before : before.slice(0, -1); // "hello," not "hello ,"
    box.value = `${joined}${word} `;
    tapped += 1;
    box.focus();
    box.dispatchEvent(new Event('input'));
  };

  /** Keep finished sentences, each a line (with the measure); false when the browser could not keep them. */
  const keep = async (/** @type {string[]} */ finished) => {
    const lines = finished.map((s) => s.replace(/\s+/gu, ' ').trim()).filter((s) => tokenize(s).length);
    if (!lines.length) return true;
    const tokens = lines.flatMap(tokenize);
    const words = tokens.filter((token) => WORD.test(token)).length;
    const next = { words: measure.words + words, suggested: measure.suggested + Math.min(tapped, words) };
    const said = lines.length === 1 ? 'Kept your sentence on this phone.' : `Kept ${lines.length} sentences.`;
    if (!(await collection.add(lines, said, { typing: next }))) return false;
    measure = next;
    tapped = 0;
    showMeasure();
    const script = unknownScript(tokens, scripts);
    if (script && !warned.has(script)) {
      warned.add(script);
      showProblem(
        new DeviceError(
          `your model knows no words written in ${script} script, so it cannot suggest them`,
          'write in the language of the model to get its suggestions; your sentence is kept, and your own words ' +
            'typed twice are suggested from then on',
        ),
      );
    }
    return true;
  };

  let keeping = Promise.resolve();
  let committedText = ''; // the box's text up to `committed`, to see when the person changed it
  /** Keep `sentences` after those being kept; `undo` when the browser could not (they go back in the box). */
  const keepLater = (/** @type {string[]} */ sentences, /** @type {() => void} */ undo) => {
    keeping = keeping
      .then(() => keep(sentences))
      .then((kept) => (kept ? undefined : undo()))
      .catch(fatal);
  };

  box.addEventListener('input', () => {
    const since = performance.now();
    const typed = box.value;
    if (!typed.startsWith(committedText)) {
      // the person changed what was kept: only what they write after its last finished sentence is new
      committed = finishedSentences(typed.slice(0, Math.min(committed, typed.length)), 0, false).end;
    }
    const { sentences, end } = finishedSentences(typed, committed, false);
    if (sentences.length) {
      const from = committed;
      keepLater(sentences, () => {
        committed = Math.min(from, committed); // kept next time, with what follows
        committedText = box.value.slice(0, committed);
      });
      committed = end;
    }
    committedText = typed.slice(0, committed);
    offer(since);
  });
  box.addEventListener('keydown', (event) => {
    if (event.key !== 'Enter' || event.shiftKey || event.isComposing) return;
    event.preventDefault(); // Enter sends what is written, as a messaging app does
    const rest = box.value.slice(committed);
    keepLater(finishedSentences(rest, 0, true).sentences, () => {
      box.value = `${rest.trimStart()}${box.value}`; // not kept: back in the box, kept with the next sentence
    });
    box.value = '';
    committed = 0;
    committedText = '';
    offer(performance.now());
  });
  $('keyboard').hidden = false;
  showMeasure();
  offer(performance.now()); // the words a sentence starts with
  return {
    modelChanged: () => {
      asked = { context: '\0', probabilities: null }; // the same text, the new model's words
      offer(performance.now());
    },
  };
}

/**
 * The sentences finished in `text` from `from` on (`all`: its rest is one too) and where the last one ends.
 * @param {string} text
 * @param {number} from
 * @param {boolean} all
 */
export function finishedSentences(text, from, all) {
  const rest = text.slice(from);
  const ends = [...rest.matchAll(SENTENCE_END)].map((m) => (m.index || 0) + m[0].length);
  if (all && rest.slice(ends.at(-1) || 0).trim()) ends.push(rest.length);
  const sentences = ends.map((end, i) => rest.slice(i ? ends[i - 1] : 0, end));
  return { sentences, end: from + (ends.at(-1) || 0) };
}
