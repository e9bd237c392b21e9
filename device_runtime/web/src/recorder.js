// @ts-check
// A sensor bundle's motion recorder and its live Try it: the person picks one of the bundle's activities (its class
// names) and taps Record; the phone's motion (motion.js) is resampled to the bundle's rate, channels and units and
// cut into its windows (resample.js), each kept labelled as it is cut (collection.js); the section shows the windows
// held per activity and warns of one with too few. Live, the activity the model sees in the last window, refreshed
// refreshed as often as the model answers (every 250 ms at most) while the phone moves. Why the sensors cannot be read is one line, and the CSV import stays.

import { classNames } from './data.js';
import { topClasses } from './engine.js';
import { DeviceError } from './errors.js';
import { startMotion, motionUnavailable } from './motion.js';
import { Resampler, Windower, channelSources } from './resample.js';
import { pct, plural } from './results.js';
import { normalizeReadings, windowSteps } from './sensors.js';
import { $, fatal, showProblem, status } from './ui.js';

/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./sensors.js').SensorEntry} SensorEntry */
/** @typedef {import('./kinds.js').TryParts} TryParts */
/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./kind_sensor.js').Window} Window */
/** @typedef {import('./collection.js').Collection<Window>} Windows */

const LIVE_MS = 250; // the live activity is asked for this often, one answer at a time: at least twice a second

/**
 * The recorder section; `live` sets up Try it's live activity once the engine is there.
 * @param {{manifest: Manifest, entry: SensorEntry, collection: Windows, contract: Contract}} parts
 */
export function setUpRecorder({ manifest, entry, collection, contract }) {
  const names = classNames(manifest);
  const steps = windowSteps(manifest);
  const step = Number(entry.step || Math.floor(steps / 2)); // bundles before `step`: HAPT's half-window overlap
  const rate = Number(entry.rate_hz);
  const channels = (entry.channels || []).map(String);
  const select = $('activity', HTMLSelectElement);
  select.replaceChildren(...names.map((name, i) => new Option(name, String(i))));
  const record = $('record', HTMLButtonElement);
  const line = $('recorder-line');
  // too few windows of an activity: with fewer than one over the held-out share, none may be kept aside to check it
  const fewest = Math.ceil(1 / Math.max(contract.device.val_fraction, 1e-9));
  const renderHeld = () => renderActivities(collection.items(), names, fewest);
  collection.onChange(renderHeld);
  $('recorder').hidden = false;
  renderHeld();

  let why = motionUnavailable();
  /** @type {import('./resample.js').ChannelSource[]} */
  let sources = [];
  try {
    sources = channelSources(channels, entry.units);
    if (!(rate > 0)) throw new DeviceError("this model does not say its sensors' sampling rate", 'add a .csv file');
  } catch (err) {
    if (!(err instanceof DeviceError)) throw err;
    why = why || err.problem;
  }
  if (why) {
    line.textContent = `Recording is not possible here: ${why}. Add recordings as a .csv file below.`;
    record.disabled = true;
    return { live: () => ({ modelChanged: () => {} }) };
  }

  /** @type {Float32Array[]} the last window's samples, for the live activity */
  let latest = [];
  /** @type {{label: number, windows: number, samples: number} | null} */
  let recording = null;
  let keeping = Promise.resolve();
  const windower = new Windower(channels.length, steps, step, (x) => {
    if (!recording) return;
    const now = recording;
    now.windows += 1;
    keeping = keeping
      .then(() =>
        collection.add(
          [{ x, label: now.label }],
          `Recording ${names[now.label]}: ${plural(now.windows, 'window')} so far.`,
        ),
      )
      .then((kept) => (kept ? undefined : stopRecording()))
      .catch(fatal);
  });
  const resampler = new Resampler(sources, rate, {
    sample: (_, values) => {
      latest.push(values);
      if (latest.length > steps) latest.shift();
      if (recording) {
        recording.samples += 1;
        windower.push(values);
      }
    },
    gap: (ms) => {
      latest = [];
      if (recording && windower.reset())
        status(`The readings paused for ${(ms / 1000).toFixed(1)} s; the window under way is left out.`);
    },
  });
  /** @type {{api: string, stop: () => void} | null} */
  let motion = null;
  const users = new Set();
  const listen = async (/** @type {string} */ user) => {
    if (!motion) {
      const streams = [...new Set(sources.map((source) => source.stream))];
      motion = await startMotion({ reading: (stream, reading) => resampler.push(stream, reading), stopped }, streams);
      document.body.dataset.motion = motion.api; // for people's tools and the browser test: how the sensors are read
    }
    users.add(user);
  };
  const unlisten = (/** @type {string} */ user) => {
    users.delete(user);
    if (users.size || !motion) return;
    motion.stop();
    motion = null;
    resampler.restart(0);
  };
  const stopped = (/** @type {DeviceError} */ error) => {
    motion = null;
    users.clear();
    resampler.restart(0);
    stopRecording();
    stopLive();
    showProblem(error);
  };

  const stopRecording = () => {
    if (!recording) return;
    const { label, windows, samples } = recording;
    recording = null;
    windower.reset();
    record.textContent = 'Record';
    select.disabled = false;
    unlisten('record');
    const seconds = (/** @type {number} */ n) => `${(n / rate).toFixed(1)} s`;
    line.textContent = windows
      ? `Kept ${plural(windows, 'window')} of ${names[label]}.`
      : `The recording lasted ${seconds(samples)}, shorter than one window (${seconds(steps)}): nothing was kept. Record for longer.`;
  };
  record.addEventListener('click', () => {
    if (recording) {
      stopRecording();
      return;
    }
    const label = Number(select.value);
    listen('record')
      .then(() => {
        windower.reset();
        recording = { label, windows: 0, samples: 0 };
        record.textContent = 'Stop';
        select.disabled = true;
        line.textContent = `Recording ${names[label]}… move as you do when ${names[label]}, then tap Stop.`;
      })
      .catch((err) => {
        if (!(err instanceof DeviceError)) throw err;
        showProblem(err);
        line.textContent = `Recording is not possible now: ${err.problem}.`;
      })
      .catch(fatal);
  });

  /** @type {() => void} */
  let stopLive = () => {};
  return {
    /** Try it, live: the activity of the last window, every LIVE_MS while it is on (one answer at a time). */
    live: (/** @type {TryParts} */ { engine, held, queue }) => {
      const watch = $('watch', HTMLButtonElement);
      const shown = $('live-activity');
      /** @type {ReturnType<typeof setInterval> | undefined} */
      let timer;
      let refreshed = 0;
      let predicting = false;
      const refresh = () => {
        if (predicting || latest.length < steps) return;
        const window = new Float32Array(channels.length * steps);
        latest.forEach((sample, t) => {
          for (let c = 0; c < channels.length; c++) window[c * steps + t] = sample[c];
        });
        predicting = true;
        const started = performance.now();
        queue(async () => {
          const probabilities = await engine.predict(normalizeReadings(window, manifest.input), 1, await held());
          const [best] = topClasses(probabilities, names, 1);
          shown.textContent = `${best.name} (${pct(best.probability)})`;
          refreshed += 1;
          // for people's tools, the browser test and bench/web_capture.py: what, how often, how fast
          Object.assign(shown.dataset, {
            label: String(best.index),
            refreshed: String(refreshed),
            at: String(performance.now()),
            ms: String(performance.now() - started),
            probabilities: JSON.stringify(Array.from(probabilities)),
          });
        });
        queue(async () => {
          predicting = false;
        });
      };
      stopLive = () => {
        if (timer === undefined) return;
        clearInterval(timer);
        timer = undefined;
        watch.textContent = 'Watch live';
        unlisten('live');
      };
      watch.addEventListener('click', () => {
        if (timer !== undefined) {
          stopLive();
          return;
        }
        listen('live')
          .then(() => {
            timer = setInterval(refresh, LIVE_MS);
            watch.textContent = 'Stop watching';
            shown.textContent = 'Move…';
          })
          .catch((err) => {
            if (!(err instanceof DeviceError)) throw err;
            showProblem(err);
          })
          .catch(fatal);
      });
      $('try-live').hidden = false;
      return { modelChanged: () => {} };
    },
  };
}

/** The windows held per activity, an activity with too few (or none, beside others) flagged with what to do. */
function renderActivities(/** @type {Window[]} */ items, /** @type {string[]} */ names, /** @type {number} */ fewest) {
  const counts = names.map(() => 0);
  for (const { label } of items) counts[label] += 1;
  const any = items.length > 0;
  $('activities').replaceChildren(
    ...names.map((name, i) => {
      const item = document.createElement('li');
      const n = counts[i];
      const warning =
        n && n < fewest
          ? ` — too few: record more (with under ${fewest}, the windows kept aside may hold none of it)`
          : !n && any
            ? ' — none yet: the model cannot learn it'
            : '';
      item.textContent = `${name}: ${plural(n, 'window')}${warning}`;
      Object.assign(item.dataset, { label: String(i), count: String(n) });
      item.classList.toggle('missing', Boolean(warning));
      return item;
    }),
  );
}
