// @ts-check
// The records a text or sensor bundle keeps in the page's store (store.js `samples`, and the keyboard's measure
// under `typing`), written and read back here only: whatever a browser hands back (a record of an older page, a
// damaged one) decodes to a valid value or is refused with one DataError, so a bad record never reaches training.

import { DataError } from './errors.js';
import { LINE_BREAK } from './text.js';

/** A stored sentence as the store keeps it. @typedef {{sentence: string}} SentenceRecord */
/** A stored window as the store keeps it: C*T readings in the bundle's units, and its class. @typedef {{window: Float32Array, label: number}} WindowRecord */
/** The keyboard's own measure: words typed, and how many a suggestion gave. @typedef {{words: number, suggested: number}} Typing */

const FIX = 'forget what this page collected (its data section), or reload the page';

/** A sentence as the store keeps it. */
export function sentenceRecord(/** @type {string} */ sentence) {
  /** @type {SentenceRecord} */
  const record = { sentence };
  return record;
}

/** A stored sentence: one line of text (no line break Python's splitlines sees), else refused. */
export function decodeSentence(/** @type {unknown} */ record) {
  const sentence = field(record, 'sentence');
  if (typeof sentence !== 'string' || LINE_BREAK.test(sentence)) {
    throw new DataError('a sentence kept on this phone cannot be read', FIX);
  }
  return sentence;
}

/** A window as the store keeps it. */
export function windowRecord(/** @type {Float32Array} */ x, /** @type {number} */ label) {
  /** @type {WindowRecord} */
  const record = { window: x, label };
  return record;
}

/**
 * A stored window: `size` finite float32 readings and a class below `classes`, else refused.
 * @param {unknown} record
 * @param {number} size readings a window holds (channels x steps)
 * @param {number} classes
 * @returns {{x: Float32Array, label: number}}
 */
export function decodeWindow(record, size, classes) {
  const x = field(record, 'window');
  const label = field(record, 'label');
  const bad = (/** @type {string} */ what) =>
    new DataError(`a window recorded on this phone cannot be read (${what})`, FIX);
  if (!(x instanceof Float32Array) || x.length !== size) throw bad(`it is not ${size} readings`);
  if (!x.every(Number.isFinite)) throw bad('it holds NaN or Inf');
  if (typeof label !== 'number' || !Number.isInteger(label) || label < 0 || label >= classes) {
    throw bad('its activity is not one of the model');
  }
  return { x, label };
}

/** The keyboard's stored measure: counts, the suggested ones among the words typed; none stored: zero. */
export function decodeTyping(/** @type {unknown} */ value) {
  if (value === undefined) return { words: 0, suggested: 0 };
  const words = field(value, 'words');
  const suggested = field(value, 'suggested');
  const count = (/** @type {unknown} */ n) => typeof n === 'number' && Number.isSafeInteger(n) && n >= 0;
  if (!count(words) || !count(suggested) || /** @type {number} */ (suggested) > /** @type {number} */ (words)) {
    throw new DataError("the keyboard's count of typed words cannot be read", FIX);
  }
  /** @type {Typing} */
  const typing = { words: /** @type {number} */ (words), suggested: /** @type {number} */ (suggested) };
  return typing;
}

/** An own field of a plain record (undefined for anything else: a getter or a prototype's is not read). */
function field(/** @type {unknown} */ record, /** @type {string} */ name) {
  if (!record || typeof record !== 'object' || Array.isArray(record)) return undefined;
  const own = Object.getOwnPropertyDescriptor(record, name);
  return own && 'value' in own ? own.value : undefined;
}
