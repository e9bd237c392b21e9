// The page on a sensor bundle: a CSV of windows read as device_runtime/task_data.py reads it (windows × channels ×
// time, labels by name or index, normalised per channel), and every malformed file refused in one line with its fix.

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import { splitTrainVal } from '../src/algorithms.js';
import { DeviceError } from '../src/errors.js';
import { checkChannels, normalizeReadings, readSensorCsv } from '../src/sensors.js';
import { splitWindows } from '../src/kind_sensor.js';
import { FIXTURES, NEEDS_FIXTURES, expected } from './fixtures.mjs';

const MANIFEST = /** @type {any} */ ({
  num_classes: 3,
  class_names: ['walking', 'sitting', 'lying'],
  input: { shape: [2, 3], mean: [1, 0], std: [2, 1], layout: 'CT' },
  task: { kind: 'sensor', channels: ['acc_x', 'acc_y'], window: 3, rate_hz: 50 },
});
const HEADER = 'window,label,acc_x,acc_y';
const CSV = [
  HEADER,
  'w1,walking,1,4',
  'w1,walking,2,5',
  'w1,walking,3,6',
  '',
  'w2,2,-1.5,0',
  'w2,2,0.25,1e1',
  'w2,2,7,"8"',
  '',
].join('\r\n');

test("a sensor CSV gives exactly the Python device's normalised windows and labels", { skip: NEEDS_FIXTURES }, () => {
  const { manifest, x, y } = expected().sensor;
  const windows = readSensorCsv(readFileSync(join(FIXTURES, 'sensor.csv'), 'utf8'), manifest, 'sensor.csv');
  assert.deepEqual(Array.from(normalizeReadings(windows.x, manifest.input)), x);
  assert.deepEqual(Array.from(windows.y), y);
});

test('a CSV of windows gives windows x channels x time, labels by name or index', () => {
  const windows = readSensorCsv(CSV, MANIFEST, 'walk.csv');
  assert.equal(windows.count, 2);
  assert.deepEqual(Array.from(windows.x), [1, 2, 3, 4, 5, 6, -1.5, 0.25, 7, 0, 10, 8]);
  assert.deepEqual(Array.from(windows.y), [0, 2]);
  const normalised = [0, 0.5, 1, 4, 5, 6, -1.25, -0.375, 3, 0, 10, 8];
  assert.deepEqual(Array.from(normalizeReadings(windows.x, MANIFEST.input)), normalised);
  const untouched = { ...MANIFEST.input, mean: [], std: [] };
  assert.equal(normalizeReadings(windows.x, untouched), windows.x);
});

test("channels other than the bundle's are refused by name and order", () => {
  const refused = (/** @type {RegExp} */ problem, /** @type {RegExp} */ fix) => (/** @type {unknown} */ err) =>
    err instanceof DeviceError && problem.test(err.problem) && fix.test(err.fix);
  const check = (/** @type {string[]} */ channels) => () => checkChannels(channels, MANIFEST, 'a.csv');
  const lacks = /a\.csv lacks the channel "acc_y" \(the model reads acc_x, acc_y\)/;
  assert.throws(check(['acc_x']), refused(lacks, /record exactly these channels: acc_x, acc_y/));
  assert.throws(
    check(['acc_x', 'acc_y', 'gyro_z']),
    refused(/has the channel "gyro_z", which the model does not read/, /acc_x, acc_y/),
  );
  const order = /order the columns as the model reads them: acc_x, acc_y/;
  assert.throws(check(['acc_y', 'acc_x']), refused(/in another order \(acc_y, acc_x\)/, order));
  assert.throws(() => readSensorCsv('window,label,acc_y,acc_x\nw,walking,1,2', MANIFEST, 'a.csv'), /another order/);
});

test('a malformed recording is refused in one line with its fix', () => {
  const refusal = (/** @type {string[]} */ rows, /** @type {RegExp} */ problem, /** @type {RegExp} */ fix) =>
    assert.throws(
      () => readSensorCsv(rows.join('\n'), MANIFEST, 'r.csv'),
      (err) => err instanceof DeviceError && problem.test(err.problem) && fix.test(err.fix),
    );
  const window = (/** @type {string} */ label, /** @type {string[]} */ x) => x.map((v, t) => `w,${label},${v},${t}`);
  refusal(['label,window,acc_x,acc_y'], /does not start with the header window,label/, /header row first/);
  refusal([HEADER], /holds no readings/, /one row per reading/);
  refusal([HEADER, 'w,walking,1'], /line 2 has 3 cells, the header 4/, /fill every cell/);
  refusal([HEADER, ...window('walking', ['1', '2'])], /window w has 2 readings, the model takes 3/, /windows of 3/);
  refusal([HEADER, ...window('walking', ['1', '2']), 'w,sitting,3,3'], /window w has more than one label/, /one label/);
  refusal([HEADER, ...window('running', ['1', '2', '3'])], /window w has the label "running"/, /walking, sitting/);
  refusal([HEADER, ...window('3', ['1', '2', '3'])], /window w has the label "3"/, /use one of/);
  refusal([HEADER, ...window('walking', ['1', 'NaN', '3'])], /window w holds NaN or Inf readings/, /fill the gaps/);
  refusal([HEADER, ...window('walking', ['1', '1e400', '3'])], /NaN or Inf/, /fill the gaps/);
  refusal([HEADER, ...window('walking', ['1', 'x', '3'])], /a reading that is not a number \("x"\)/, /write numbers/);
  refusal([HEADER, ...window('walking', ['1', '0x10', '3'])], /not a number/, /write numbers/);
});

test('windows split by the seeded split, normalised per channel', () => {
  const rows = [HEADER];
  for (let w = 0; w < 10; w++) for (let t = 0; t < 3; t++) rows.push(`w${w},${MANIFEST.class_names[w % 3]},${w},${t}`);
  const read = readSensorCsv(rows.join('\n'), MANIFEST, 'walk.csv');
  const windows = Array.from(read.y, (label, i) => ({ x: read.x.slice(i * 6, (i + 1) * 6), label }));
  const { train, val } = splitWindows(windows, MANIFEST, 0.2, 7);
  const want = splitTrainVal(10, 0.2, 7);
  assert.deepEqual(
    Array.from(val.y),
    Array.from(want.val, (w) => w % 3),
  );
  const first = (want.train[0] - 1) / 2; // acc_x of the first training window, normalised
  assert.deepEqual(Array.from(train.x.subarray(0, 3)), [first, first, first]);
});
