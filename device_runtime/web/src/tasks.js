// @ts-check
// What a person gives the page for each kind of bundle (manifest.json `task.kind`), free of the DOM: photos for
// an image bundle (data.js), one text file for a next-word bundle, one CSV of windows for a sensor bundle. A text
// or sensor file is kept as its text (a "recording") and made into samples when a round trains, split as the
// Python device splits it (edgepfl/kinds/, edgepfl/data.py): text in time order, the last part held out, with
// accuracy counting only the targets the manifest's `metric_ignores` leaves; sensor windows by the seeded split.

import { splitTrainVal } from './algorithms.js';
import { DataError, EngineError } from './errors.js';
import { sampleEntry } from './manifest.js';
import { normalizeReadings, readSensorCsv } from './sensors.js';
import { nextWordSamples, readText, timeOrderSplit } from './text.js';

/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./algorithms.js').Samples} Samples */
/** @typedef {import('./text.js').Vocabulary} Vocabulary */
/** @typedef {import('./text.js').TextTask} TextTask */
/** The kind of sample a bundle's model reads. @typedef {import('./results.js').SampleKind} TaskKind */
/**
 * A text or sensor bundle's data: the file a person picked (its name and text) with how many samples it makes
 * and how many classes its samples show (a sensor file's activities; 0 for text).
 * @typedef {{kind: 'next-word' | 'sensor', name: string, text: string, count: number, classesHeld: number}} Recording
 */
/**
 * How a recording becomes samples: the bundle's manifest and, for text, its vocabulary.
 * @typedef {{kind: 'next-word' | 'sensor', manifest: Manifest, vocabulary: Vocabulary | null}} RecordingTask
 */

/** The words the page shows for a kind of file: the section's title, what to give, the picker, the file types. */
export const RECORDING_WORDS = {
  'next-word': {
    title: 'Your text',
    needs:
      'The model learns to suggest your next word from text you wrote: pick a UTF-8 .txt file, one message or ' +
      'sentence a line (notes, messages you sent). The last part of it is kept aside to check the suggestions.',
    pick: 'Pick a text file (.txt)',
    accept: '.txt,text/plain',
    suffix: '.txt',
    notFix: 'pick a plain-text (.txt) file, saved as UTF-8',
  },
  sensor: {
    title: 'Your recordings',
    needs:
      'The model learns your activities from motion recordings: pick a .csv file whose header is window,label, ' +
      "then the model's channels; each row is one reading, each window has its label.",
    pick: 'Pick a recording (.csv)',
    accept: '.csv,text/csv',
    suffix: '.csv',
    notFix: 'pick a .csv of windows (header: window,label,<channels>); save an .npz as CSV first',
  },
};

/** The bundle's kind of sample: "next-word", "sensor" or "image" (edgepfl/kinds/). */
export function taskKind(/** @type {Manifest} */ manifest) {
  const kind = String(sampleEntry(manifest).kind || 'image');
  if (kind !== 'image' && kind !== 'next-word' && kind !== 'sensor') {
    throw new EngineError(
      `the server's model reads samples of kind "${kind}", which this page cannot`,
      'ask whoever runs the server to update the page',
    );
  }
  return /** @type {TaskKind} */ (kind);
}

/** A text bundle's `task` entry. */
export function textTask(/** @type {Manifest} */ manifest) {
  return /** @type {TextTask} */ (sampleEntry(manifest));
}

/**
 * A picked file as a recording, checked through and through (its samples made once here, and again each round).
 * @param {Uint8Array} bytes
 * @param {string} name the file's name
 * @param {RecordingTask} task
 * @returns {Recording}
 */
export function readRecording(bytes, name, task) {
  const words = RECORDING_WORDS[task.kind];
  if (!name.toLowerCase().endsWith(words.suffix)) {
    throw new DataError(`the file ${name} is not a ${words.suffix} file`, words.notFix);
  }
  const text = readText(bytes, fileWords(name));
  /** @type {Recording} */
  const recording = { kind: task.kind, name, text, count: 0, classesHeld: 0 };
  const samples = recordingSamples(recording, task);
  return { ...recording, count: samples.count, classesHeld: task.kind === 'sensor' ? new Set(samples.y).size : 0 };
}

/**
 * A recording's samples as the model reads them: token windows for text, normalised windows for sensors.
 * @param {Recording} recording
 * @param {RecordingTask} task
 * @returns {Samples}
 */
export function recordingSamples(recording, task) {
  if (task.kind === 'next-word') {
    const vocabulary = /** @type {Vocabulary} */ (task.vocabulary);
    return nextWordSamples(recording.text, vocabulary, textTask(task.manifest).seq_len, fileWords(recording.name));
  }
  const windows = readSensorCsv(recording.text, task.manifest, fileWords(recording.name));
  return { ...windows, x: normalizeReadings(windows.x, task.manifest.input) };
}

/**
 * The train/held-out split of a recording's samples (edgepfl/data.py split_time_order, split_train_val): text in time order, sensor windows by the
 * seeded split; the held-out part keeps only the targets accuracy counts (data.py scored).
 * @param {Recording} recording
 * @param {RecordingTask} task
 * @param {number} valFraction the contract's `device.val_fraction`
 * @param {number} seed its `device.split_seed`
 * @returns {{train: Samples, val: Samples}}
 */
export function splitRecording(recording, task, valFraction, seed) {
  const samples = recordingSamples(recording, task);
  const ignores = sampleEntry(task.manifest).metric_ignores || [];
  const { train, val } =
    task.kind === 'next-word'
      ? timeOrderSplit(samples.y, valFraction, ignores)
      : splitTrainVal(samples.count, valFraction, seed);
  const counted = task.kind === 'next-word' ? val : val.filter((i) => !ignores.includes(samples.y[i]));
  return { train: pick(samples, train), val: pick(samples, counted) };
}

/** A picked file as the page's lines name it ("the file notes.txt": a line starts in capitals, a file's name not). */
export function fileWords(/** @type {string} */ name) {
  return `the file ${name}`;
}

/** The samples at `positions`, in their order. */
export function pick(/** @type {Samples} */ samples, /** @type {ArrayLike<number>} */ positions) {
  const size = samples.count ? samples.x.length / samples.count : 0;
  const x = new /** @type {any} */ (samples.x.constructor)(positions.length * size);
  const y = new Int32Array(positions.length);
  Array.from(positions).forEach((at, i) => {
    x.set(/** @type {any} */ (samples.x).subarray(at * size, (at + 1) * size), i * size);
    y[i] = samples.y[at];
  });
  return { x, y, count: positions.length };
}
