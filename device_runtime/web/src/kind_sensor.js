// @ts-check
// Sensor windows, the kind of an activity bundle (manifest `sample.kind` "sensor"): windows of the bundle's
// channels, recorded from the phone's own motion (recorder.js) or read from a CSV of windows (sensors.js, as
// edgepfl/kinds/sensor.py reads it), kept on the phone in the bundle's units (collection.js), normalised per
// channel and split by the seeded split as edgepfl/data.py does. Saved, they are that CSV. Try it names the activity
// the model sees: live while the phone moves, or for each window of a CSV.

import { pickSamples, splitTrainVal } from './algorithms.js';
import { openCollection } from './collection.js';
import { classNames } from './data.js';
import { topClasses } from './engine.js';
import { DeviceError } from './errors.js';
import { sampleEntry } from './manifest.js';
import { decodeWindow, windowRecord } from './records.js';
import { setUpRecorder } from './recorder.js';
import { pct } from './results.js';
import { normalizeReadings, readSensorCsv, sensorEntry, writeSensorCsv } from './sensors.js';
import { readText } from './text.js';
import { $, showProblem } from './ui.js';

/** @typedef {import('./kinds.js').KindWords} KindWords */
/** @typedef {import('./kinds.js').SampleKind} SampleKind */
/** @typedef {import('./kinds.js').TryParts} TryParts */
/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./algorithms.js').Samples} Samples */
/** A window kept on the phone: C*T readings in the bundle's units, and its class. @typedef {{x: Float32Array, label: number}} Window */
/** @typedef {import('./collection.js').Collecting<Window>} Windows */

export const MAX_WINDOWS = 3000; // windows the phone keeps, the oldest dropped (over an hour of HAPT's 2.56 s windows)
const WINDOWS_SHOWN = 20; // windows of a CSV whose activity Try it lists

/** @type {KindWords} */
const WORDS = { one: 'window', right: 'recognised', more: ' (record more)', rate: 'windows' };

/** @type {SampleKind} */
export const sensorKind = {
  name: 'sensor',
  words: WORDS,
  // the readings come on the page's thread: a step there would lose them (bench/web_capture.py)
  freeThread: true,
  async open({ manifest, store, contract }) {
    const collection = await openCollection({ store, contract, kind: windows(manifest) });
    const recorder = setUpRecorder({ manifest, entry: sensorEntry(manifest), collection, contract });
    return {
      examples: collection.examples,
      tryIt: (parts) => {
        tryRecordings(parts, manifest);
        return recorder.live(parts);
      },
    };
  },
};

/**
 * Windows as the model reads them, and their labels: normalised per channel (data.py normalize).
 * @param {Window[]} items
 * @param {Manifest} manifest
 * @returns {Samples}
 */
export function windowSamples(items, manifest) {
  const size = manifest.input.shape.reduce((a, b) => a * b, 1);
  const x = new Float32Array(items.length * size);
  items.forEach((item, i) => {
    x.set(item.x, i * size);
  });
  return {
    x: normalizeReadings(x, manifest.input),
    y: Int32Array.from(items, (item) => item.label),
    count: items.length,
  };
}

/**
 * The seeded split of windows (data.py split_train_val); the held-out part keeps only the classes accuracy counts.
 * @param {Window[]} items
 * @param {Manifest} manifest
 * @param {number} valFraction
 * @param {number} seed
 */
export function splitWindows(items, manifest, valFraction, seed) {
  const samples = windowSamples(items, manifest);
  const ignores = sampleEntry(manifest).metric_ignores || [];
  const { train, val } = splitTrainVal(samples.count, valFraction, seed);
  const counted = val.filter((i) => !ignores.includes(samples.y[i]));
  return { train: pickSamples(samples, train), val: pickSamples(samples, counted) };
}

/** How windows are collected: one record each, the CSV that Save my data writes and a picked one. */
function windows(/** @type {Manifest} */ manifest) {
  const size = manifest.input.shape.reduce((a, b) => a * b, 1);
  /** @type {Windows} */
  const kind = {
    name: sensorKind.name,
    words: WORDS,
    file: {
      title: 'Your recordings',
      needs:
        'The model learns your activities from your own motion: pick an activity above and record it. A .csv of ' +
        "windows (header window,label, then the model's channels; a row a reading) adds more.",
      pick: 'Add recordings (.csv)',
      accept: '.csv,text/csv',
      suffix: '.csv',
      notFix: 'pick a .csv of windows (header: window,label,<channels>); save an .npz as CSV first',
      record: 'window',
      forget: 'Forget what I recorded',
      fileName: 'my-recordings.csv',
      fileType: 'text/csv;charset=utf-8',
    },
    cap: MAX_WINDOWS,
    decode: (record) => decodeWindow(record, size, manifest.num_classes),
    encode: (item) => windowRecord(item.x, item.label),
    read: (bytes, name) => {
      const source = `the file ${name}`;
      const read = readSensorCsv(readText(bytes, source), manifest, source);
      return Array.from(read.y, (label, i) => ({ x: read.x.slice(i * size, (i + 1) * size), label }));
    },
    write: (items) => writeSensorCsv(items, manifest),
    count: (items) => items.length,
    classesHeld: (items) => new Set(items.map((item) => item.label)).size,
    split: (items, valFraction, seed) => splitWindows(items, manifest, valFraction, seed),
    probe: (items, count) => {
      const samples = windowSamples(items.slice(0, count), manifest);
      return { x: samples.x, count: samples.count };
    },
  };
  return kind;
}

/** Try it on a CSV of windows: the activity of each (the first WINDOWS_SHOWN). */
function tryRecordings(/** @type {TryParts} */ { engine, held, queue }, /** @type {Manifest} */ manifest) {
  const names = classNames(manifest);
  const tryWindows = async (/** @type {File} */ file) => {
    let read;
    try {
      const source = `the file ${file.name}`;
      read = readSensorCsv(readText(new Uint8Array(await file.arrayBuffer()), source), manifest, source);
    } catch (err) {
      if (!(err instanceof DeviceError)) throw err;
      showProblem(err);
      return;
    }
    const count = Math.min(read.count, WINDOWS_SHOWN);
    const x = normalizeReadings(read.x, manifest.input).subarray(0, count * engine.sampleSize);
    const probabilities = await engine.predict(x, count, await held());
    const classes = names.length;
    const list = $('try-activities');
    list.replaceChildren(
      ...Array.from({ length: count }, (_, i) => {
        const [best] = topClasses(probabilities.subarray(i * classes, (i + 1) * classes), names, 1);
        const item = document.createElement('li');
        item.textContent = `window ${i + 1}: ${best.name} (${pct(best.probability)})`;
        item.dataset.label = String(best.index);
        return item;
      }),
    );
    list.dataset.probabilities = JSON.stringify(Array.from(probabilities));
  };
  const input = $('try-window', HTMLInputElement);
  input.addEventListener('change', () => {
    const file = input.files && input.files[0];
    if (file) queue(() => tryWindows(file).finally(() => (input.value = '')));
  });
  $('try-windows').hidden = false;
}
