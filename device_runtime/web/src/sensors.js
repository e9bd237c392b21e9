// @ts-check
// A person's own sensor recordings for a sensor bundle, read as the sensor kind (edgepfl/kinds/sensor.py) reads them: a CSV of
// fixed windows (a header `window,label,<channel>,...`, then one row per reading, the window's readings in time
// order), its channels the bundle's by name and in its order, every reading a finite number; written back the same
// way (Save my data: read again, by either side, the same windows); normalised per channel as the sensor kind's
// normalize does (float32 (x - mean) / std).

import { classNames } from './data.js';
import { DataError } from './errors.js';
import { sampleEntry } from './manifest.js';

/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./engine.js').InputSpec} InputSpec */
/**
 * Windows of readings (N*C*T float32, channels first) and their labels.
 * @typedef {{x: Float32Array, y: Int32Array, count: number}} Windows
 */
/**
 * What a sensor bundle's manifest says of its windows (manifest.json `sample`, `task` before it): the channels in
 * input order, each one's unit, the window's length, the step between windows' starts, the sampling rate.
 * @typedef {{kind: string, channels: string[], units?: string[], window?: number, step?: number, rate_hz?: number}} SensorEntry
 */

const CSV_COLUMNS = ['window', 'label']; // the columns before the channels
const NUMBER = /^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i; // a finite number as Python's float() reads it
const NOT_FINITE = /^[+-]?(nan|inf|infinity)$/i; // what it reads as NaN or Inf

/** The sensor bundle's entry. */
export function sensorEntry(/** @type {Manifest} */ manifest) {
  return /** @type {SensorEntry} */ (/** @type {unknown} */ (sampleEntry(manifest)));
}

/** Readings a window holds, by the manifest (its entry's `window`, else the input's last dimension). */
export function windowSteps(/** @type {Manifest} */ manifest) {
  return Number(sensorEntry(manifest).window || manifest.input.shape[manifest.input.shape.length - 1]);
}

/**
 * Refuse, in one line, channels other than the bundle's (by name, in its order): edgepfl/kinds/sensor.py check_channels.
 * @param {string[]} channels
 * @param {Manifest} manifest
 * @param {string} source the file's name
 */
export function checkChannels(channels, manifest, source) {
  const expected = (sensorEntry(manifest).channels || []).map(String);
  if (channels.length === expected.length && channels.every((name, i) => name === expected[i])) return;
  const missing = expected.filter((name) => !channels.includes(name));
  const extra = channels.filter((name) => !expected.includes(name));
  if (missing.length || extra.length) {
    const problem = missing.length
      ? `lacks the channel "${missing[0]}"`
      : `has the channel "${extra[0]}", which the model does not read`;
    throw new DataError(
      `${source} ${problem} (the model reads ${expected.join(', ')})`,
      `record exactly these channels: ${expected.join(', ')}`,
    );
  }
  throw new DataError(
    `${source} has the model's channels in another order (${channels.join(', ')})`,
    `order the columns as the model reads them: ${expected.join(', ')}`,
  );
}

/**
 * The windows of a sensor CSV (edgepfl/kinds/sensor.py read_csv): windows in the order they first appear, each of the
 * model's window length and one label (a class name, or its index); anything else is one DataError.
 * @param {string} text the file's text
 * @param {Manifest} manifest
 * @param {string} source the file's name
 * @returns {Windows}
 */
export function readSensorCsv(text, manifest, source) {
  const rows = text.split(/\r\n|\n|\r/).map(csvCells);
  if (
    !rows.length ||
    rows[0]
      .slice(0, 2)
      .map((cell) => cell.trim())
      .join() !== CSV_COLUMNS.join()
  ) {
    throw new DataError(
      `${source} does not start with the header window,label,<channel>,...`,
      'write the header row first, then one row per reading',
    );
  }
  const header = rows[0];
  const channels = header.slice(2).map((cell) => cell.trim());
  checkChannels(channels, manifest, source);
  const steps = windowSteps(manifest);
  const names = classNames(manifest);
  /** @type {Map<string, {rows: string[][], line: number}>} */
  const windows = new Map();
  rows.slice(1).forEach((row, i) => {
    if (!row.some((cell) => cell.trim())) return;
    if (row.length !== header.length) {
      const problem = `${source} line ${i + 2} has ${row.length} cells, the header ${header.length}`;
      throw new DataError(problem, 'fill every cell of every row');
    }
    const id = row[0].trim();
    if (!windows.has(id)) windows.set(id, { rows: [], line: i + 2 });
    /** @type {{rows: string[][]}} */ (windows.get(id)).rows.push(row);
  });
  if (!windows.size) throw new DataError(`${source} holds no readings`, 'add one row per reading under the header');
  const size = channels.length * steps;
  const x = new Float32Array(windows.size * size);
  const y = new Int32Array(windows.size);
  let n = 0;
  for (const [id, { rows: readings }] of windows) {
    if (readings.length !== steps) {
      throw new DataError(
        `${source}: window ${id} has ${readings.length} readings, the model takes ${steps}`,
        `cut the recording into windows of ${steps} readings`,
      );
    }
    const labels = new Set(readings.map((row) => row[1].trim()));
    if (labels.size !== 1) {
      throw new DataError(`${source}: window ${id} has more than one label`, 'give each window one label');
    }
    y[n] = classIndex([...labels][0], names, `${source}: window ${id}`);
    readings.forEach((row, t) => {
      row.slice(2).forEach((cell, c) => {
        x[n * size + c * steps + t] = reading(cell.trim(), `${source}: window ${id}`);
      });
    });
    n += 1;
  }
  return { x, y, count: windows.size };
}

/**
 * Windows as the CSV readSensorCsv reads (and the sensor kind, edgepfl/kinds/sensor.py): a window a block of rows, named w1, w2, ... and labelled
 * by its class name, each reading written as the shortest decimal that reads back as the same float32.
 * @param {{x: Float32Array, label: number}[]} windows C*T readings each, channels first
 * @param {Manifest} manifest
 */
export function writeSensorCsv(windows, manifest) {
  const channels = (sensorEntry(manifest).channels || []).map(String);
  const steps = windowSteps(manifest);
  const names = classNames(manifest);
  const rows = [[...CSV_COLUMNS, ...channels].map(csvCell).join(',')];
  windows.forEach(({ x, label }, w) => {
    const id = `w${w + 1},${csvCell(names[label])}`;
    for (let t = 0; t < steps; t++) rows.push(`${id},${channels.map((_, c) => decimal(x[c * steps + t])).join(',')}`);
  });
  return `${rows.join('\n')}\n`;
}

/** A float32 reading as the shortest decimal that reads back as it (its sign kept: -0 too). */
function decimal(/** @type {number} */ value) {
  return Object.is(value, -0) ? '-0' : String(value);
}

/** A CSV cell as Python's csv module writes it: quoted (its quotes doubled) when it holds a comma, quote or break. */
function csvCell(/** @type {string} */ cell) {
  return /[",\r\n]/.test(cell) ? `"${cell.replaceAll('"', '""')}"` : cell;
}

/**
 * Windows as the model reads them: float32 (x - mean) / std per channel where the bundle normalises (data.py
 * normalize).
 * @param {Float32Array} x N*C*T readings
 * @param {InputSpec} inputSpec
 */
export function normalizeReadings(x, inputSpec) {
  const [channels, steps] = inputSpec.shape;
  const mean = inputSpec.mean && inputSpec.mean.length ? inputSpec.mean : null;
  if (!mean) return x;
  const out = new Float32Array(x.length);
  for (let i = 0; i < x.length; i++) {
    const c = Math.floor(i / steps) % channels;
    out[i] = Math.fround(Math.fround(x[i] - Math.fround(mean[c])) / Math.fround(inputSpec.std[c]));
  }
  return out;
}

/** One reading: a finite number, else refused (as Python's float(), then check_readings). */
function reading(/** @type {string} */ cell, /** @type {string} */ where) {
  if (!NUMBER.test(cell) && !NOT_FINITE.test(cell)) {
    throw new DataError(`${where} has a reading that is not a number (${JSON.stringify(cell)})`, 'write numbers');
  }
  const value = Number(cell);
  if (!Number.isFinite(value) || !Number.isFinite(Math.fround(value))) {
    const fix = 'drop or fill the gaps in the recording (e.g. interpolate) before cutting windows';
    throw new DataError(`${where} holds NaN or Inf readings`, fix);
  }
  return Math.fround(value);
}

/** A window's label as a class index: its class name, or the index itself (edgepfl/kinds/sensor.py). */
function classIndex(/** @type {string} */ label, /** @type {string[]} */ names, /** @type {string} */ where) {
  const named = names.indexOf(label);
  if (named >= 0) return named;
  if (/^\d+$/.test(label) && Number(label) < names.length) return Number(label);
  throw new DataError(`${where} has the label ${JSON.stringify(label)}`, `use one of: ${names.join(', ')}`);
}

/** The cells of one CSV line (Python's csv module, default dialect: commas, double quotes, "" inside quotes). */
function csvCells(/** @type {string} */ line) {
  /** @type {string[]} */
  const cells = [];
  let cell = '';
  let quoted = false;
  for (let i = 0; i < line.length; i++) {
    const char = line[i];
    if (quoted) {
      if (char === '"' && line[i + 1] === '"') {
        cell += '"';
        i += 1;
      } else if (char === '"') quoted = false;
      else cell += char;
    } else if (char === '"' && !cell) quoted = true;
    else if (char === ',') {
      cells.push(cell);
      cell = '';
    } else cell += char;
  }
  return line ? [...cells, cell] : [];
}
