// @ts-check
// Everything the device page draws (index.html's elements) but "Try it" (tryit.js): the headline and its stage,
// a problem with its fix (any DeviceError the same way, the technical detail folded away), the round's progress
// with its speed, the results (one number, chance for reference, a chart, the rounds), keeping and reading what a
// person gives (the kinds' modules draw their sections), and "reset this device". `pageEvents` is the
// round loop's DeviceEvents (runner.js) drawn on the page. Words are for the person holding the phone: no HTTP, no
// flags.

import { drawChart } from './chart.js';
import { DeviceError, describe } from './errors.js';
import { chanceWords, pct, plural, scoreWhat } from './results.js';

/** @typedef {import('./engine.js').EvalResult} EvalResult */
/** @typedef {import('./runner.js').DeviceEvents} DeviceEvents */
/** @typedef {import('./runner.js').Stage} Stage */
/** @typedef {import('./store.js').DeviceStore} DeviceStore */
/** @typedef {import('./store.js').RoundRecord} RoundRecord */

/** What the results show: the rounds, the evaluation at the run's end, the classes the examples hold. */
const shown = {
  /** @type {RoundRecord[]} */
  history: [],
  /** @type {{round: number | null, result: EvalResult} | null} */
  final: null,
  classesHeld: 0,
  /** @type {import('./kinds.js').KindWords | null} how the bundle's kind names its samples (none until it says) */
  words: null,
};
/** The round being trained: when its first step ended and how many images a step takes, for the speed. */
const speed = { round: -1, batch: 1, firstStep: 0, firstAt: 0 };

/**
 * The round loop's events, drawn on the page; `modelChanged` runs whenever the model the device keeps changed (a
 * round saved, or the run's final model taken).
 * @param {() => unknown} [modelChanged]
 * @returns {DeviceEvents}
 */
export function pageEvents(modelChanged = () => {}) {
  return {
    message: (text) => status(text),
    stage: (name, text) => stage(name, text),
    problem: (error) => showProblem(error),
    problemCleared: () => clearProblem(),
    roundStarted: (roundId, settings, totalSteps) => startProgress(roundId, settings.batch_size, totalSteps),
    step: (roundId, phase, step, steps, loss) => showProgress(roundId, phase, step, steps, loss),
    roundFinished: () => modelChanged(),
    historyChanged: (history) => {
      renderHistory(history);
      modelChanged(); // sent after the round's tensors are saved
    },
    runFinished: (roundId, result) => {
      shown.final = { round: roundId, result };
      renderScore();
      modelChanged();
    },
  };
}

/** Show what the page does now (`body[data-stage]`, for people's tools and the browser test) and its headline. */
export function stage(/** @type {Stage} */ name, /** @type {string} */ text = '') {
  const training = name === 'training';
  if (training && $('round').hidden) {
    // a round begins: its bar says "working" until its first step
    $('progress', HTMLProgressElement).removeAttribute('value');
    $('round-text').textContent = '';
    $('speed').textContent = '';
  }
  $('round').hidden = !training;
  document.body.dataset.stage = name;
  if (text) status(text);
}

/** The headline: what the page does now, one line. */
export function status(/** @type {string} */ text) {
  $('status').textContent = sentence(text);
}

/** Show a problem and its fix (it stays until a round begins), the technical detail folded; returns the problem's line. */
export function showProblem(/** @type {{problem: string, fix: string, detail?: string}} */ error) {
  $('problem').hidden = false;
  $('problem-text').textContent = sentence(error.problem);
  $('problem-fix').textContent = error.fix ? `What to do: ${error.fix}.`.replace(/\.\.$/, '.') : '';
  $('problem-more').hidden = !error.detail;
  $('problem-detail').textContent = error.detail || '';
  return error.problem;
}

/** Hide the problem shown. */
export function clearProblem() {
  $('problem').hidden = true;
}

/** Anything that stops the page: its problem and fix (an unexpected error's message, and "reload the page"). */
export function fatal(/** @type {unknown} */ err) {
  const error =
    err instanceof DeviceError
      ? err
      : { problem: 'something went wrong on this page', fix: 'reload the page', detail: describe(err) };
  stage('problem', showProblem({ problem: error.problem, fix: error.fix || 'reload the page', detail: error.detail }));
}

/** Offer the "start over" button: it forgets everything this page holds and reloads. */
export function offerStartOver(/** @type {{clear: () => Promise<void>}} */ store) {
  const button = $('start-over');
  button.hidden = false;
  button.addEventListener('click', async () => {
    await store.clear();
    location.reload();
  });
}

/** The footer line naming the device and its threads. */
export function showDevice(/** @type {string} */ text) {
  $('device').textContent = text;
}

/** Where the page trains: the processor or the GPU (backend.js backendLine), for people and the browser test. */
export function showBackend(/** @type {string} */ name, /** @type {string} */ line) {
  document.body.dataset.backend = name;
  $('backend').textContent = line;
}

/** The footer line on whether the browser keeps the page's data (navigator.storage.persist()). */
export function showStorage(/** @type {boolean} */ persisted) {
  $('storage').textContent = persisted
    ? "This browser keeps this page's data (your examples and model) until you reset the device."
    : "This browser may delete this page's data (your examples and model) when the phone runs low on space. To keep it, add the page to your home screen.";
}

/**
 * "Reset this device": after a confirmation that says what is lost, forget everything and reload.
 * @param {{clear: () => Promise<void>}} store
 * @param {() => {examples: number, one: string, rounds: number}} held what the page holds now (`one`: a sample's name)
 */
export function setUpReset(store, held) {
  const button = $('reset');
  button.hidden = false;
  button.addEventListener('click', async () => {
    const { examples, one, rounds } = held();
    const lost = [
      `your ${plural(examples, one)}`,
      rounds ? `the model it trained in ${plural(rounds, 'round')}` : 'its model',
      'its place on the server',
    ];
    if (
      !confirm(
        `Reset this device? This deletes everything this page keeps: ${lost.join(', ')}. To take part again you need the join link.`,
      )
    )
      return;
    await store.clear();
    location.replace(location.pathname);
  });
}

/**
 * The person's data as the page keeps it (photos, or a text or sensor bundle's file): `keep` saves a change (none:
 * null), shows it (`shown` draws it) and wakes the round loop where it waits for more (`added`).
 * @template T
 * @param {DeviceStore} store
 * @param {(changed: T) => void} shown
 * @returns {{keep: (changed: T, said: string) => Promise<void>, added: () => Promise<void>}}
 */
export function keeper(store, shown) {
  /** @type {(() => void)[]} */
  let waiting = [];
  const keep = async (/** @type {T} */ changed, /** @type {string} */ said) => {
    await store.commit({ examples: /** @type {any} */ (changed ?? undefined) });
    clearProblem();
    status(said);
    shown(changed);
    for (const resolve of waiting) resolve();
    waiting = [];
  };
  return { keep, added: () => new Promise((resolve) => waiting.push(resolve)) };
}

/**
 * Read what a picker picked (`read` keeps it): the headline says `reading` meanwhile; a DeviceError shows with its
 * fix and the headline goes back to what the page does. The picker is emptied, so the same file can be picked again.
 * @param {HTMLInputElement} input
 * @param {string} reading
 * @param {(files: FileList) => Promise<void>} read
 */
export async function readPicked(input, reading, read) {
  const files = input.files;
  if (!files || !files.length) return;
  const before = $('status').textContent || '';
  try {
    status(reading);
    await read(files);
  } catch (err) {
    if (!(err instanceof DeviceError)) throw err;
    showProblem(err);
    status(before);
  } finally {
    input.value = '';
  }
}

/** What the person's data holds: how its kind names its samples, and the classes they show. */
export function showHeld(/** @type {import('./kinds.js').KindWords} */ words, /** @type {number} */ classesHeld) {
  Object.assign(shown, { words, classesHeld });
  renderScore();
}

/** The rounds: the table (held-out accuracy before and after training, whether the update was sent), the score and chart. */
export function renderHistory(/** @type {RoundRecord[]} */ history) {
  shown.history = history;
  $('results').hidden = !history.length;
  const sent = { pending: 'not yet', none: '–', delivered: 'yes', dropped: 'too late' };
  $('history').replaceChildren(
    ...history.map((r) => {
      const row = document.createElement('tr');
      row.dataset.round = String(r.round);
      row.dataset.accuracy = String(r.accuracy ?? '');
      row.dataset.upload = r.upload;
      for (const text of [r.round, pct(r.beforeAccuracy), pct(r.accuracy), sent[r.upload]]) {
        const cell = document.createElement('td');
        cell.textContent = String(text);
        row.append(cell);
      }
      return row;
    }),
  );
  renderScore();
}

/** One number with its meaning: the latest measurement of the device's model (of which model, on what), guessing for
 * reference with a result below it flagged, and the chart. */
function renderScore() {
  const measured = shown.history.filter((r) => r.accuracy != null);
  const last = measured.at(-1);
  const final = shown.final && shown.final.result.count ? shown.final : null;
  const roundsHere = shown.history.length;
  const score = final
    ? {
        accuracy: final.result.correct / final.result.count,
        count: final.result.count,
        final: true,
        roundsHere,
        round: final.round,
      }
    : last
      ? {
          accuracy: /** @type {number} */ (last.accuracy),
          count: last.samples,
          final: false,
          roundsHere,
          round: last.round,
        }
      : null;
  $('score').textContent = score ? pct(score.accuracy) : '–';
  $('score').dataset.accuracy = String(score ? score.accuracy : '');
  const words = shown.words;
  $('score-what').textContent = score && words ? `${scoreWhat({ ...score, words })}.` : 'not measured yet';
  const classes = shown.classesHeld;
  const chance =
    words && words.measure
      ? { text: words.measure, below: false }
      : chanceWords(score && score.accuracy, score ? score.count : 0, classes);
  $('score-chance').textContent = chance.text;
  $('score-chance').dataset.below = String(chance.below);
  drawChart($('chart'), measured, classes > 1 ? 1 / classes : null);
}

/**
 * A round's training begins: its bar, and the speed measured from its first step on.
 * @param {number} roundId
 * @param {number} batch images per step
 * @param {number} steps
 */
function startProgress(roundId, batch, steps) {
  Object.assign(speed, { round: roundId, batch, firstStep: 0, firstAt: 0 });
  const progress = $('progress', HTMLProgressElement);
  progress.max = Math.max(steps, 1);
  progress.value = 0;
  $('round-text').textContent = `Step 0 of ${steps}`;
  $('speed').textContent = '';
  status(`Round ${roundId}: learning from your examples…`);
}

/**
 * One training step ended: the bar, the step and the speed in images per second.
 * @param {number} roundId
 * @param {string} phase
 * @param {number} step
 * @param {number} steps
 * @param {number} loss
 */
function showProgress(roundId, phase, step, steps, loss) {
  Object.assign(document.body.dataset, { round: roundId, step }); // for people's tools and the browser test
  Object.assign($('round').dataset, { phase, loss: String(loss) });
  const now = performance.now();
  if (speed.round !== roundId || !speed.firstAt)
    Object.assign(speed, { round: roundId, firstStep: step, firstAt: now });
  const progress = $('progress', HTMLProgressElement);
  progress.max = steps;
  progress.value = step;
  $('round-text').textContent = `Step ${step} of ${steps}`;
  const seconds = (now - speed.firstAt) / 1000;
  if (step > speed.firstStep && seconds > 0) {
    const rate = ((step - speed.firstStep) * speed.batch) / seconds;
    const unit = shown.words ? shown.words.rate : 'samples';
    $('speed').textContent = `${rate < 10 ? rate.toFixed(1) : Math.round(rate)} ${unit} per second`;
    $('speed').dataset.imagesPerSecond = String(rate);
  }
}

/** A line as a sentence: its first letter capitalised. */
export function sentence(/** @type {string} */ text) {
  return text ? text[0].toUpperCase() + text.slice(1) : text;
}

/**
 * The page's element of that id (of that kind); a page without it is a bug of this page.
 * @template {Element} [T=HTMLElement]
 * @param {string} id
 * @param {{new (): T, prototype: T}} [kind]
 * @returns {T}
 */
export function $(id, kind) {
  const element = document.getElementById(id);
  if (!element || (kind && !(element instanceof kind)))
    throw new Error(`the page has no ${kind ? kind.name : 'element'} #${id}`);
  return /** @type {T} */ (/** @type {unknown} */ (element));
}
