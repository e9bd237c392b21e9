// @ts-check
// The phone's motion sensors as the page reads them: the accelerometer with gravity and the gyroscope, through
// DeviceMotionEvent where the browser has it (every phone browser: Chrome, Safari, Firefox), asking
// DeviceMotionEvent.requestPermission() on the person's tap where it exists (iOS), and through the Generic Sensor
// API (Accelerometer, Gyroscope) where only that exists. DeviceMotionEvent comes at a steady rate whether the motion
// changed or not; the Generic Sensor API tells only changes (seen in Chromium 156), so a phone lying still would look
// like one whose sensors stopped. Readings go on in SI units on the device's axes, timestamped: m/s², and rad/s
// (DeviceMotionEvent gives deg/s under alpha, beta, gamma, whose axes engines have given differently: ROTATION_AXES).
// Why the sensors cannot be read (an insecure page, no sensors, a refused permission, a sensor that stops sending) is
// one DeviceError with what to do.

import { DeviceError } from './errors.js';

/** @typedef {import('./resample.js').Reading} Reading */
/** @typedef {import('./resample.js').Stream} Stream */
/** What a motion source hands on: each reading of each sensor, and why it stopped. @typedef {{reading: (stream: Stream, reading: Reading) => void, stopped: (why: DeviceError) => void}} MotionListener */
/** @typedef {{alpha: number | null, beta: number | null, gamma: number | null}} RotationRate */

const FREQUENCY = 60; // Hz asked of the Generic Sensor API (what phones give DeviceMotionEvent)
export const SILENT_MS = 1500; // no reading for this long: the sensors stopped sending
const DEG = Math.PI / 180;
/** @type {Record<Stream, string>} */
const SENSOR_NAMES = { acc: 'accelerometer', gyro: 'gyroscope' };
/**
 * Which of DeviceMotionEvent's rotationRate fields holds the rotation around the device's x, y and z axes, by
 * engine. Blink: measured in Chromium 156 through its sensor emulation (the gyroscope's x, y, z arrive as alpha,
 * beta, gamma; tests/test_web_browser.py pins it); others: the DeviceOrientation spec's prose (alpha around z, beta
 * around x, gamma around y), not seen on a device here.
 */
export const ROTATION_AXES = {
  blink: { x: 'alpha', y: 'beta', z: 'gamma' },
  spec: { x: 'beta', y: 'gamma', z: 'alpha' },
};

/** Why this page cannot read motion sensors at all ('' when it may try): not a secure page, or no sensor API. */
export function motionUnavailable(/** @type {any} */ scope = globalThis) {
  if (!scope.isSecureContext) {
    return 'the phone gives its motion sensors only to a secure page (https), and this one is not';
  }
  if (!scope.Accelerometer && !scope.DeviceMotionEvent) return 'this browser gives pages no motion sensors';
  return '';
}

/**
 * Start reading the sensors, on a person's tap (iOS asks its permission then). Resolves once the sensors were
 * started, to the way they are read and a stop; a failure to start rejects with one DeviceError.
 * @param {MotionListener} listener
 * @param {Stream[]} streams the sensors that must keep sending (the bundle's channels read them)
 * @param {{api?: 'generic' | 'event', scope?: any}} [options] `api`: the one to use (default: DeviceMotionEvent
 *   where the browser has it)
 * @returns {Promise<{api: 'generic' | 'event', stop: () => void}>}
 */
export async function startMotion(listener, streams, { api, scope = globalThis } = {}) {
  const why = motionUnavailable(scope);
  if (why) throw new DeviceError(why, 'add recordings as a .csv file instead');
  if (await permissionDenied(scope)) throw sensorError({ name: 'NotAllowedError' }, 'acc');
  const generic = api ? api === 'generic' : !scope.DeviceMotionEvent;
  const started = generic ? await startGeneric(listener, scope) : await startEvents(listener, scope);
  const now = () => scope.performance.now();
  /** @type {Map<Stream, number>} when each sensor last sent a reading (its start, before any) */
  const last = new Map(streams.map((stream) => [stream, now()]));
  const heard = new Set();
  const watch = scope.setInterval(async () => {
    const silent = streams.find((stream) => now() - /** @type {number} */ (last.get(stream)) >= SILENT_MS);
    if (!silent) return;
    stop();
    const seconds = `${(SILENT_MS / 1000).toFixed(1)} s`;
    const sensor = SENSOR_NAMES[silent];
    listener.stopped(
      (await permissionDenied(scope)) // the person took the permission back
        ? sensorError({ name: 'NotAllowedError' }, silent)
        : heard.has(silent)
          ? new DeviceError(
              `the phone's ${sensor} stopped sending readings for ${seconds}`,
              'keep the page open and in front while you record; the windows recorded so far are kept',
            )
          : new DeviceError(
              `no readings came from the phone's ${sensor} in ${seconds}`,
              'this phone may have no such sensor the browser reads: add recordings as a .csv file instead',
            ),
    );
  }, SILENT_MS / 3);
  const hand = listener.reading;
  listener.reading = (stream, reading) => {
    last.set(stream, now());
    heard.add(stream);
    hand(stream, reading);
  };
  const stop = () => {
    scope.clearInterval(watch);
    started.stop();
  };
  return { api: generic ? 'generic' : 'event', stop };
}

/** Whether the browser says the page may not read the accelerometer or gyroscope (a browser that cannot say: no). */
async function permissionDenied(/** @type {any} */ scope) {
  const permissions = scope.navigator && scope.navigator.permissions;
  if (!permissions) return false;
  try {
    const states = await Promise.all(['accelerometer', 'gyroscope'].map((name) => permissions.query({ name })));
    return states.some((status) => status.state === 'denied');
  } catch {
    return false; // a browser that does not know these permissions (Firefox, Safari) asks in its own way
  }
}

/** The Generic Sensor API: an Accelerometer and a Gyroscope at FREQUENCY, started once both may read. */
async function startGeneric(/** @type {MotionListener} */ listener, /** @type {any} */ scope) {
  /** @type {[Stream, any][]} */
  const sensors = [
    ['acc', new scope.Accelerometer({ frequency: FREQUENCY })],
    ['gyro', new scope.Gyroscope({ frequency: FREQUENCY })],
  ];
  let stopped = false;
  const stop = () => {
    stopped = true;
    for (const [, sensor] of sensors) sensor.stop();
  };
  await new Promise((resolve, reject) => {
    const waiting = new Set(sensors.map(([stream]) => stream));
    for (const [stream, sensor] of sensors) {
      sensor.addEventListener('reading', () => {
        if (stopped) return;
        listener.reading(stream, { t: sensor.timestamp, x: sensor.x, y: sensor.y, z: sensor.z });
      });
      sensor.addEventListener('activate', () => {
        waiting.delete(stream);
        if (!waiting.size) resolve(undefined);
      });
      sensor.addEventListener('error', (/** @type {any} */ event) => {
        const error = sensorError(event.error, stream);
        if (waiting.size) reject(error);
        else if (!stopped) listener.stopped(error);
        stop();
      });
      sensor.start();
    }
  });
  return { stop };
}

/** DeviceMotionEvent: the permission asked where the browser asks for it, then every event's two readings. */
async function startEvents(/** @type {MotionListener} */ listener, /** @type {any} */ scope) {
  const asks = scope.DeviceMotionEvent && typeof scope.DeviceMotionEvent.requestPermission === 'function';
  if (asks && (await scope.DeviceMotionEvent.requestPermission()) !== 'granted') {
    throw sensorError({ name: 'NotAllowedError' }, 'acc');
  }
  const axes = rotationAxes(scope.navigator);
  const heard = (/** @type {any} */ event) => {
    const reading = motionReadings(event, axes);
    if (reading.acc) listener.reading('acc', reading.acc);
    if (reading.gyro) listener.reading('gyro', reading.gyro);
  };
  scope.addEventListener('devicemotion', heard);
  return { stop: () => scope.removeEventListener('devicemotion', heard) };
}

/** The engine's ROTATION_AXES: Blink's where the browser is Chromium's (it alone has userAgentData), else the spec's. */
export function rotationAxes(/** @type {any} */ navigator) {
  return navigator && navigator.userAgentData ? ROTATION_AXES.blink : ROTATION_AXES.spec;
}

/**
 * A DeviceMotionEvent's readings in SI units on the device's axes: acceleration with gravity (m/s²) and rotation
 * (deg/s under `axes`' fields, made rad/s); a part the event lacks (null) is absent.
 * @param {{timeStamp: number, accelerationIncludingGravity: {x: number | null, y: number | null, z: number | null} | null, rotationRate: RotationRate | null}} event
 * @param {{x: string, y: string, z: string}} axes
 * @returns {{acc?: Reading, gyro?: Reading}}
 */
export function motionReadings(event, axes) {
  const t = event.timeStamp;
  const a = event.accelerationIncludingGravity;
  const r = /** @type {Record<string, number | null> | null} */ (/** @type {unknown} */ (event.rotationRate));
  /** @type {{acc?: Reading, gyro?: Reading}} */
  const readings = {};
  if (a && a.x != null && a.y != null && a.z != null) readings.acc = { t, x: a.x, y: a.y, z: a.z };
  const [x, y, z] = r ? [r[axes.x], r[axes.y], r[axes.z]] : [null, null, null];
  if (x != null && y != null && z != null) readings.gyro = { t, x: x * DEG, y: y * DEG, z: z * DEG };
  return readings;
}

/** A sensor's failure in a person's words: a refused permission, no such sensor, or another reason. */
function sensorError(/** @type {{name?: string, message?: string} | undefined} */ error, /** @type {Stream} */ stream) {
  const name = (error && error.name) || 'Error';
  const sensor = SENSOR_NAMES[stream];
  if (name === 'NotAllowedError' || name === 'SecurityError') {
    return new DeviceError(
      'the browser does not let this page read the motion sensors',
      "allow motion sensors for this site in the browser's settings, then tap Record again; " +
        'or add recordings as a .csv file',
      `${sensor}: ${name}`,
    );
  }
  if (name === 'NotReadableError') {
    return new DeviceError(
      `this phone has no ${sensor} the browser can read`,
      'add recordings as a .csv file instead',
      `${sensor}: ${name}`,
    );
  }
  return new DeviceError(
    `the phone's ${sensor} could not be read`,
    'tap Record again; or add recordings as a .csv file',
    `${sensor}: ${name}${error && error.message ? ` (${error.message})` : ''}`,
  );
}
