// @ts-check
// From the phone's motion readings to a sensor bundle's windows, free of the DOM: each of the bundle's channels
// read from its sensor and axis (acc-x: the accelerometer with gravity, gyro-z: the gyroscope...) and converted to
// the unit the manifest names for it (UCI HAPT's: acceleration in g, rotation in rad/s; the readings come in m/s²
// and rad/s); the jittery ~60 Hz stream resampled at the bundle's rate by linear interpolation on the readings'
// own timestamps; windows of the bundle's length cut every `step` samples (its overlap); a gap in the readings (the
// page stalled, a sensor paused) ends a window unfinished rather than bridging it.

import { DataError } from './errors.js';

/** One reading of one sensor: when (ms), and x, y, z in SI units (m/s², rad/s) on the device's axes. @typedef {{t: number, x: number, y: number, z: number}} Reading */
/** The phone's sensors a channel can come from. @typedef {'acc' | 'gyro'} Stream */
/** Where one channel comes from: a sensor, an axis, and the factor from SI to the bundle's unit. @typedef {{stream: Stream, axis: 'x' | 'y' | 'z', scale: number}} ChannelSource */

export const STANDARD_GRAVITY = 9.80665; // m/s² per g
/** @type {Record<Stream, Record<string, number>>} a unit's value of one SI unit of each sensor */
const UNITS = {
  acc: { g: 1 / STANDARD_GRAVITY, 'm/s^2': 1, 'm/s2': 1, 'm/s²': 1 },
  gyro: { 'rad/s': 1, 'deg/s': 180 / Math.PI },
};
/** @type {Record<Stream, string>} the unit of a channel whose manifest names none (bundles before `units`: HAPT's) */
const HAPT_UNITS = { acc: 'g', gyro: 'rad/s' };
const CHANNEL = /^(acc|accel|accelerometer|gyro|gyroscope)[-_. ]?([xyz])$/i;
export const MAX_GAP_MS = 200; // readings further apart than this leave a gap (about 11 missed at 60 Hz)
const STALLED = 64; // readings of one sensor held while another sends none (a second at 60 Hz): a gap

/**
 * Where each of the bundle's channels comes from and how it converts; a channel the phone has no sensor for, or a
 * unit the page does not know, is refused in one line (the CSV import stays the way in).
 * @param {string[]} channels the manifest's, in order
 * @param {string[] | undefined} units the manifest's, one a channel (absent: HAPT's)
 * @returns {ChannelSource[]}
 */
export function channelSources(channels, units) {
  return channels.map((name, i) => {
    const match = CHANNEL.exec(name.trim());
    if (!match) {
      throw new DataError(
        `this model reads the channel "${name}", which the page cannot record from a phone's motion sensors`,
        'add recordings as a .csv file instead',
      );
    }
    const stream = /** @type {Stream} */ (match[1].toLowerCase().startsWith('acc') ? 'acc' : 'gyro');
    const unit = units ? String(units[i]) : HAPT_UNITS[stream];
    const scale = UNITS[stream][unit];
    if (scale === undefined) {
      throw new DataError(
        `this model reads "${name}" in ${unit}, a unit the page cannot convert to`,
        `add recordings as a .csv file instead (the page records in ${Object.keys(UNITS[stream]).join(', ')})`,
      );
    }
    return { stream, axis: /** @type {'x' | 'y' | 'z'} */ (match[2].toLowerCase()), scale };
  });
}

/**
 * Readings of the phone's sensors resampled at `rateHz` into the bundle's channels: `push` a reading of a stream,
 * and every sample due by then comes out (its time and one value a channel, in the bundle's units), or `gap` once
 * where readings stopped for longer than MAX_GAP_MS.
 */
export class Resampler {
  /**
   * @param {ChannelSource[]} sources
   * @param {number} rateHz
   * @param {{sample: (t: number, values: Float32Array) => void, gap: (ms: number) => void}} out
   */
  constructor(sources, rateHz, out) {
    this.sources = sources;
    this.period = 1000 / rateHz;
    this.out = out;
    /** @type {Map<Stream, Reading[]>} each stream's latest readings (the two around the next sample, and on) */
    this.streams = new Map(sources.map((source) => [source.stream, []]));
    this.next = NaN; // when the next sample is due
  }

  /** A reading of one stream; readings of a stream come in time order (an older one is ignored). */
  push(/** @type {Stream} */ stream, /** @type {Reading} */ reading) {
    const readings = this.streams.get(stream);
    if (!readings) return; // a sensor no channel reads
    const last = readings.at(-1);
    if (last && reading.t <= last.t) return;
    if (last && reading.t - last.t > MAX_GAP_MS) {
      this.restart(reading.t - last.t);
      this.streams.get(stream)?.push(reading);
      return;
    }
    readings.push(reading);
    const all = [...this.streams.values()];
    if (readings.length > STALLED) {
      // another sensor sends nothing while this one goes on: a gap since that one's last reading
      this.restart(reading.t - Math.min(...all.map((r) => (r.length ? r[r.length - 1].t : readings[0].t))));
      return;
    }
    if (all.some((r) => !r.length)) return;
    if (Number.isNaN(this.next)) this.next = Math.max(...all.map((r) => r[0].t)); // every stream has begun
    while (all.every((r) => r[r.length - 1].t >= this.next)) {
      const t = this.next;
      const values = Float32Array.from(this.sources, ({ stream: s, axis, scale }) => {
        return at(/** @type {Reading[]} */ (this.streams.get(s)), t, axis) * scale;
      });
      this.out.sample(t, values);
      this.next += this.period;
      for (const r of all) while (r.length > 2 && r[1].t <= this.next) r.shift(); // keep the two around the next
    }
  }

  /** Readings stopped for `ms`: what came before is not joined to what comes after. */
  restart(/** @type {number} */ ms) {
    for (const readings of this.streams.values()) readings.length = 0;
    this.next = NaN;
    this.out.gap(ms);
  }
}

/** A stream's value of `axis` at `t`, interpolated linearly between the readings around it. */
function at(/** @type {Reading[]} */ readings, /** @type {number} */ t, /** @type {'x' | 'y' | 'z'} */ axis) {
  let i = 0;
  while (i + 1 < readings.length && readings[i + 1].t <= t) i += 1;
  const a = readings[i];
  const b = readings[Math.min(i + 1, readings.length - 1)];
  if (b.t === a.t || t <= a.t) return a[axis];
  return a[axis] + ((b[axis] - a[axis]) * (t - a.t)) / (b.t - a.t);
}

/**
 * Windows of `steps` samples cut from a stream of samples every `step` samples (overlapping by steps - step), each
 * as the model reads it: channels first (C*T float32).
 */
export class Windower {
  /**
   * @param {number} channels
   * @param {number} steps samples a window holds
   * @param {number} step samples from one window's start to the next's
   * @param {(window: Float32Array) => void} cut
   */
  constructor(channels, steps, step, cut) {
    this.channels = channels;
    this.steps = steps;
    this.step = Math.max(1, Math.min(step, steps));
    this.cut = cut;
    /** @type {Float32Array[]} the samples since the current window's start */
    this.samples = [];
  }

  /** One sample (a value a channel). */
  push(/** @type {Float32Array} */ values) {
    this.samples.push(values);
    if (this.samples.length < this.steps) return;
    const window = new Float32Array(this.channels * this.steps);
    this.samples.forEach((sample, t) => {
      for (let c = 0; c < this.channels; c++) window[c * this.steps + t] = sample[c];
    });
    this.samples = this.samples.slice(this.step);
    this.cut(window);
  }

  /** Drop the window begun (a gap, or the recording ended); returns how many samples it held. */
  reset() {
    const held = this.samples.length;
    this.samples = [];
    return held;
  }
}
