// @ts-check
// Everything the device page draws (index.html's elements): the stage and status line, a problem with its fix
// (any DeviceError the same way), the examples and their pickers, the round's progress and the history of
// rounds. `pageEvents` is the round loop's DeviceEvents (runner.js) drawn on the page.

import { appendExamples, classCounts, classNames, readFolder, readNpz, readPhotos, splitSizes } from './data.js';
import { DeviceError, describe } from './errors.js';
import { pct } from './runner.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./data.js').Examples} Examples */
/** @typedef {import('./data.js').NewExamples} NewExamples */
/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./runner.js').DeviceEvents} DeviceEvents */
/** @typedef {import('./runner.js').ExampleSource} ExampleSource */
/** @typedef {import('./runner.js').Stage} Stage */
/** @typedef {import('./store.js').DeviceStore} DeviceStore */
/** @typedef {import('./store.js').RoundRecord} RoundRecord */

/** The round loop's events, drawn on the page. @type {DeviceEvents} */
export const pageEvents = {
  message: (text) => status(text),
  stage: (name, text) => stage(name, text),
  problem: (error) => showProblem(error),
  problemCleared: () => clearProblem(),
  roundStarted: () => {},
  step: (roundId, phase, step, steps, loss) => showProgress(roundId, phase, step, steps, loss),
  roundFinished: () => {},
  historyChanged: (history) => renderHistory(history),
};

/** Show what the page does now (`body[data-stage]`, for people's tools and the browser test) and its status line. */
export function stage(/** @type {Stage} */ name, /** @type {string} */ text = '') {
  document.body.dataset.stage = name;
  if (text) status(text);
}

/** The one status line. */
export function status(/** @type {string} */ text) {
  $('status').textContent = text;
}

/** Show a problem and its fix (it stays until a round begins); returns the problem's line. */
export function showProblem(/** @type {{problem: string, fix: string}} */ error) {
  $('problem').hidden = false;
  $('problem-text').textContent = error.problem;
  $('problem-fix').textContent = error.fix ? `Fix: ${error.fix}` : '';
  return error.problem;
}

/** Hide the problem shown. */
export function clearProblem() {
  $('problem').hidden = true;
}

/** Anything that stops the page: its problem and fix (an unexpected error's message, and "reload the page"). */
export function fatal(/** @type {unknown} */ err) {
  const error = err instanceof DeviceError ? err : { problem: describe(err), fix: 'reload the page' };
  stage('problem', showProblem({ problem: error.problem, fix: error.fix || 'reload the page' }));
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

/**
 * The examples section: the model's classes with how many examples of each, and the pickers that add more
 * (each addition committed to the store). Returns the round loop's source of examples.
 * @param {{store: DeviceStore, manifest: Manifest, contract: Contract, examples: Examples}} parts
 * @returns {ExampleSource}
 */
export function setUpExamples({ store, manifest, contract, examples }) {
  const names = classNames(manifest);
  /** @type {(() => void)[]} */
  let waiting = [];
  const select = $('class-select', HTMLSelectElement);
  select.replaceChildren(...names.map((name, i) => new Option(name, String(i))));
  const add = async (/** @type {HTMLInputElement} */ input, /** @type {(files: FileList) => Promise<NewExamples>} */ read) => {
    const files = input.files;
    if (!files || !files.length) return;
    try {
      status('Reading the examples…');
      const more = await read(files);
      examples = appendExamples(examples, more);
      await store.commit({ examples });
      clearProblem();
      status(`Added ${more.count} example${more.count === 1 ? '' : 's'}.`);
      renderExamples(examples, names, contract);
      for (const resolve of waiting) resolve();
      waiting = [];
    } catch (err) {
      if (!(err instanceof DeviceError)) throw err;
      showProblem(err);
    } finally {
      input.value = '';
    }
  };
  /** @param {string} id @param {(files: FileList) => Promise<NewExamples>} read */
  const picker = (id, read) => {
    const input = $(id, HTMLInputElement);
    input.addEventListener('change', () => add(input, read).catch(fatal));
  };
  const photos = (/** @type {FileList} */ files) => readPhotos(files, Number(select.value), manifest.input);
  picker('camera', photos);
  picker('photos', photos);
  picker('folder', (files) => readFolder(files, manifest.input, classNames(manifest)));
  picker('npz', async (files) => readNpz(new Uint8Array(await files[0].arrayBuffer()), manifest.input, manifest.num_classes));
  $('examples').hidden = false;
  renderExamples(examples, names, contract);
  return {
    current: () => examples,
    added: () => new Promise((resolve) => waiting.push(resolve)),
  };
}

/** The classes with their counts, and how the examples split into train and held out. */
function renderExamples(/** @type {Examples} */ examples, /** @type {string[]} */ names, /** @type {Contract} */ contract) {
  const counts = classCounts(examples, names.length);
  $('needs').textContent = `This model learns ${names.length} classes. Add labelled photos of each class you have; the more, the better.`;
  $('classes').replaceChildren(
    ...names.map((name, i) => {
      const item = document.createElement('li');
      item.textContent = `${name}: ${counts[i]}`;
      item.classList.toggle('missing', counts[i] === 0);
      return item;
    }),
  );
  const { count } = examples;
  if (!count) {
    $('split').textContent = '';
    return;
  }
  const { train, val } = splitSizes(count, contract.device.val_fraction, contract.device.split_seed);
  $('split').textContent = `${count} examples: ${train} train on this device, ${val} are held out to measure it.`;
}

/** The table of rounds: held-out accuracy before and after, training loss, what became of the upload. */
export function renderHistory(/** @type {RoundRecord[]} */ history) {
  $('results').hidden = !history.length;
  $('history').replaceChildren(
    ...history.map((r) => {
      const row = document.createElement('tr');
      row.dataset.round = String(r.round);
      row.dataset.accuracy = String(r.accuracy ?? '');
      row.dataset.upload = r.upload;
      for (const text of [r.round, pct(r.beforeAccuracy), pct(r.accuracy), num(r.trainLoss), r.upload]) {
        const cell = document.createElement('td');
        cell.textContent = String(text);
        row.append(cell);
      }
      return row;
    }),
  );
}

/**
 * The round's progress bar and loss.
 * @param {number} roundId
 * @param {string} phase
 * @param {number} step
 * @param {number} steps
 * @param {number} loss
 */
function showProgress(roundId, phase, step, steps, loss) {
  Object.assign(document.body.dataset, { round: roundId, step }); // for people's tools and the browser test
  $('round').hidden = false;
  $('round-text').textContent = `Round ${roundId}: training (${phase}), step ${step} of ${steps}`;
  const progress = $('progress', HTMLProgressElement);
  progress.max = steps;
  progress.value = step;
  $('loss').textContent = `loss ${num(loss)}`;
}

function num(/** @type {number | null | undefined} */ value) {
  return value == null || Number.isNaN(value) ? '–' : value.toFixed(4);
}

/**
 * The page's element of that id (of that kind); a page without it is a bug of this page.
 * @template {HTMLElement} T
 * @param {string} id
 * @param {{new (): T, prototype: T}} [kind]
 * @returns {T}
 */
function $(id, kind) {
  const element = document.getElementById(id);
  if (!element || (kind && !(element instanceof kind))) throw new Error(`the page has no ${kind ? kind.name : 'element'} #${id}`);
  return /** @type {T} */ (element);
}
