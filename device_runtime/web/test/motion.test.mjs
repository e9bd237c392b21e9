// From the phone's motion to a sensor bundle's windows (src/motion.js, src/resample.js, src/sensors.js): each
// channel's sensor, axis and unit; a DeviceMotionEvent's readings by engine; the jittery stream resampled at the
// bundle's rate; windows cut with its overlap; gaps, a sensor that stops, a permission refused or taken back; and
// the CSV Save my data writes, read back to the same windows.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { DeviceError } from '../src/errors.js';
import {
  ROTATION_AXES,
  SILENT_MS,
  motionReadings,
  motionUnavailable,
  rotationAxes,
  startMotion,
} from '../src/motion.js';
import { MAX_GAP_MS, Resampler, STANDARD_GRAVITY, Windower, channelSources } from '../src/resample.js';
import { readSensorCsv, writeSensorCsv } from '../src/sensors.js';

const HAPT = ['acc-x', 'acc-y', 'acc-z', 'gyro-x', 'gyro-y', 'gyro-z'];

test("each channel is read from its sensor and axis, converted to the bundle's unit (HAPT's when unnamed)", () => {
  const sources = channelSources(HAPT, undefined);
  assert.deepEqual(
    sources.map(({ stream, axis }) => `${stream}.${axis}`),
    ['acc.x', 'acc.y', 'acc.z', 'gyro.x', 'gyro.y', 'gyro.z'],
  );
  assert.deepEqual(
    sources.map((s) => s.scale),
    [1 / STANDARD_GRAVITY, 1 / STANDARD_GRAVITY, 1 / STANDARD_GRAVITY, 1, 1, 1],
  );
  const named = channelSources(['Accel_Z', 'gyroscope x'], ['m/s^2', 'deg/s']);
  assert.deepEqual(
    named.map(({ stream, axis, scale }) => [stream, axis, scale]),
    [
      ['acc', 'z', 1],
      ['gyro', 'x', 180 / Math.PI],
    ],
  );
  const refused = (/** @type {RegExp} */ problem) => (/** @type {unknown} */ err) =>
    err instanceof DeviceError && problem.test(err.problem) && /\.csv/.test(err.fix);
  assert.throws(
    () => channelSources(['heart-rate'], undefined),
    refused(/channel "heart-rate", which the page cannot/),
  );
  assert.throws(() => channelSources(['acc-x'], ['furlongs']), refused(/"acc-x" in furlongs/));
});

test("a DeviceMotionEvent's readings in SI units, its rotation axes as the engine gives them", () => {
  const event = {
    timeStamp: 1000,
    accelerationIncludingGravity: { x: 0.5, y: 9.8, z: -1 },
    rotationRate: { alpha: 5.7, beta: 11.5, gamma: 17.2 },
  };
  const deg = Math.PI / 180;
  // Chromium (tests/test_web_browser.py pins it): the gyroscope's x, y, z arrive as alpha, beta, gamma
  assert.deepEqual(motionReadings(event, ROTATION_AXES.blink), {
    acc: { t: 1000, x: 0.5, y: 9.8, z: -1 },
    gyro: { t: 1000, x: 5.7 * deg, y: 11.5 * deg, z: 17.2 * deg },
  });
  // the spec's prose: alpha around z, beta around x, gamma around y
  assert.deepEqual(motionReadings(event, ROTATION_AXES.spec).gyro, {
    t: 1000,
    x: 11.5 * deg,
    y: 17.2 * deg,
    z: 5.7 * deg,
  });
  assert.deepEqual(rotationAxes({ userAgentData: {} }), ROTATION_AXES.blink);
  assert.deepEqual(rotationAxes({}), ROTATION_AXES.spec);
  // a phone without a gyroscope gives no rotation; none of either: nothing
  const bare = { timeStamp: 1, accelerationIncludingGravity: { x: null, y: null, z: null }, rotationRate: null };
  assert.deepEqual(motionReadings(bare, ROTATION_AXES.blink), {});
});

/** A resampler of acc-x and gyro-z at `rate`, collecting what it gives. */
function resampler(rate = 50) {
  const out = { samples: /** @type {[number, number[]][]} */ ([]), gaps: /** @type {number[]} */ ([]) };
  const r = new Resampler(channelSources(['acc-x', 'gyro-z'], ['m/s^2', 'rad/s']), rate, {
    sample: (t, values) => out.samples.push([t, Array.from(values)]),
    gap: (ms) => out.gaps.push(ms),
  });
  return { r, out };
}

test("a jittery ~60 Hz stream is resampled at the bundle's rate by linear interpolation on the readings' times", () => {
  const { r, out } = resampler(50);
  // acc-x = t / 10, gyro-z = -t / 100, read at uneven times (one sensor a little behind the other)
  const times = [0, 15, 35, 49, 66, 84, 99, 118, 133, 150];
  for (const t of times) {
    r.push('acc', { t, x: t / 10, y: 0, z: 0 });
    r.push('gyro', { t: t + 3, x: 0, y: 0, z: -(t + 3) / 100 });
  }
  // samples from when both have begun (3 ms), every 20 ms, while both have readings past them
  assert.deepEqual(
    out.samples.map(([t]) => t),
    [3, 23, 43, 63, 83, 103, 123, 143],
  );
  for (const [t, [acc, gyro]] of out.samples) {
    assert.ok(Math.abs(acc - Math.fround(t / 10)) < 1e-5, `acc at ${t}: ${acc}`);
    assert.ok(Math.abs(gyro - Math.fround(-t / 100)) < 1e-6, `gyro at ${t}: ${gyro}`);
  }
  assert.deepEqual(out.gaps, []);
  r.push('acc', { t: 140, x: 0, y: 0, z: 0 }); // older than the last: ignored
  assert.equal(out.samples.length, 8);
});

test('readings that stop for longer than MAX_GAP_MS, or one sensor alone for a second, leave a gap', () => {
  const { r, out } = resampler(50);
  for (const t of [0, 16, 33]) {
    r.push('acc', { t, x: 1, y: 0, z: 0 });
    r.push('gyro', { t, x: 0, y: 0, z: 1 });
  }
  const before = out.samples.length;
  r.push('acc', { t: 33 + MAX_GAP_MS + 1, x: 2, y: 0, z: 0 });
  assert.deepEqual(out.gaps, [MAX_GAP_MS + 1]);
  r.push('gyro', { t: 33 + MAX_GAP_MS + 2, x: 0, y: 0, z: 2 });
  assert.equal(out.samples.length, before, 'nothing bridges the gap');
  r.push('acc', { t: 33 + MAX_GAP_MS + 16, x: 2, y: 0, z: 0 });
  assert.equal(out.samples.length, before + 1, 'a fresh start once both send again');
  for (let i = 0; i < 70; i++) r.push('acc', { t: 300 + i * 16, x: 1, y: 0, z: 0 });
  assert.equal(out.gaps.length, 2, 'the gyroscope sent nothing for a second');
});

test("windows of the bundle's length, cut every `step` samples, channels first", () => {
  /** @type {number[][]} */
  const cut = [];
  const windower = new Windower(2, 4, 2, (window) => cut.push(Array.from(window)));
  for (let t = 0; t < 9; t++) windower.push(Float32Array.of(t, 10 + t));
  assert.deepEqual(cut, [
    [0, 1, 2, 3, 10, 11, 12, 13],
    [2, 3, 4, 5, 12, 13, 14, 15],
    [4, 5, 6, 7, 14, 15, 16, 17],
  ]);
  assert.equal(windower.reset(), 3, 'the window begun (6, 7, 8) is dropped');
  windower.push(Float32Array.of(9, 19));
  assert.equal(cut.length, 3);
});

/** A browser's window as startMotion sees it, with a clock the test moves. */
function fakeScope({ secure = true, denied = false } = {}) {
  const scope = {
    isSecureContext: secure,
    DeviceMotionEvent: class {},
    clock: 0,
    state: denied ? 'denied' : 'granted',
    listeners: /** @type {((event: any) => void)[]} */ ([]),
    intervals: /** @type {(() => unknown)[]} */ ([]),
    performance: { now: () => scope.clock },
    navigator: { permissions: { query: async () => ({ state: scope.state }) } },
    addEventListener: (/** @type {string} */ _, /** @type {any} */ f) => scope.listeners.push(f),
    removeEventListener: () => {
      scope.listeners = [];
    },
    setInterval: (/** @type {() => unknown} */ f) => scope.intervals.push(f) - 1,
    clearInterval: (/** @type {number} */ i) => {
      scope.intervals[i] = () => {};
    },
    /** Move the clock on, sending a motion event every 16 ms while `sending` (with a rotation), and run the timers. */
    async advance(/** @type {number} */ ms, sending = true, rotation = true) {
      for (const end = scope.clock + ms; scope.clock < end; scope.clock += 16) {
        const event = { timeStamp: scope.clock, accelerationIncludingGravity: { x: 0, y: 9.8, z: 0 } };
        const rotationRate = rotation ? { alpha: 0, beta: 0, gamma: 0 } : null;
        if (sending) for (const f of scope.listeners) f({ ...event, rotationRate });
        for (const f of scope.intervals) await f();
      }
    },
  };
  return scope;
}

test('the sensors cannot be read on an insecure page, without a sensor API, or with the permission refused', async () => {
  assert.match(motionUnavailable({ isSecureContext: false, DeviceMotionEvent: class {} }), /secure page \(https\)/);
  assert.match(motionUnavailable({ isSecureContext: true }), /gives pages no motion sensors/);
  const listener = { reading: () => {}, stopped: () => {} };
  const refused = (/** @type {RegExp} */ problem) => (/** @type {unknown} */ err) =>
    err instanceof DeviceError && problem.test(err.problem) && /\.csv/.test(err.fix);
  await assert.rejects(startMotion(listener, ['acc'], { scope: fakeScope({ secure: false }) }), refused(/secure/));
  await assert.rejects(
    startMotion(listener, ['acc'], { scope: fakeScope({ denied: true }) }),
    refused(/does not let this page read the motion sensors/),
  );
  const ios = fakeScope();
  Object.assign(ios.DeviceMotionEvent, { requestPermission: async () => 'denied' });
  await assert.rejects(startMotion(listener, ['acc'], { scope: ios }), refused(/does not let this page/));
});

test('a sensor that stops sending, or a permission taken back mid-recording, stops the reading in one line', async () => {
  for (const [change, problem] of [
    [(/** @type {any} */ scope) => scope, /stopped sending readings for 1\.5 s/],
    [(/** @type {any} */ scope) => Object.assign(scope, { state: 'denied' }), /does not let this page read/],
  ]) {
    const scope = fakeScope();
    /** @type {string[]} */
    const heard = [];
    /** @type {DeviceError[]} */
    const stopped = [];
    const listener = {
      reading: (/** @type {string} */ s) => heard.push(s),
      stopped: (/** @type {any} */ e) => stopped.push(e),
    };
    const started = await startMotion(listener, ['acc', 'gyro'], { scope });
    assert.equal(started.api, 'event');
    await scope.advance(500);
    assert.ok(heard.length >= 60 && stopped.length === 0);
    change(scope);
    await scope.advance(SILENT_MS + 600, false);
    assert.equal(stopped.length, 1);
    assert.match(stopped[0].problem, problem);
    assert.equal(scope.listeners.length, 0, 'the page stopped listening');
  }
  // a phone whose sensor never sends: said so, as its own line
  const silent = fakeScope();
  /** @type {DeviceError[]} */
  const stopped = [];
  await startMotion({ reading: () => {}, stopped: (e) => stopped.push(e) }, ['gyro'], { scope: silent });
  await silent.advance(SILENT_MS + 100, true, false); // its events carry no rotation: the gyroscope is silent
  assert.match(stopped[0].problem, /no readings came from the phone's gyroscope/);
});

test('Save my data writes windows as the CSV both readers read back to the same float32 readings', () => {
  const manifest = /** @type {any} */ ({
    num_classes: 2,
    class_names: ['still', 'shake, hard'],
    input: { shape: [2, 3], mean: [], std: [] },
    sample: { kind: 'sensor', channels: ['acc-x', 'gyro-z'], window: 3, rate_hz: 50 },
  });
  const windows = [
    { x: Float32Array.of(1 / 3, -0, 1e-7, 9.8 / STANDARD_GRAVITY, -123456.789, 3.4e38), label: 1 },
    { x: Float32Array.of(0, 1, 2, 3, 4, 5), label: 0 },
  ];
  const text = writeSensorCsv(windows, manifest);
  assert.equal(text.split('\n')[0], 'window,label,acc-x,gyro-z');
  assert.ok(text.split('\n')[1].startsWith('w1,"shake, hard",0.3333333432674408,'), text);
  const read = readSensorCsv(text, manifest, 'my-recordings.csv');
  assert.deepEqual(Array.from(read.y), [1, 0]);
  assert.deepEqual(
    Array.from(read.x),
    windows.flatMap((w) => Array.from(w.x)),
  );
});
