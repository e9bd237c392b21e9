// @ts-check
// "Try it" and "Save the model": the device's own model at work, offline, and as a file to take elsewhere (the
// one `edgepfl device export-model` writes, fp32: modelfile.js). Both use the model the device keeps, a snapshot
// taken whenever a round is saved, never the tensors of a round being trained. An image bundle tries a photo,
// pre-processed exactly as an example is; a text bundle suggests the next words as the person types (as `device
// predict --text`); a sensor bundle names the activity of each window of a recording. The answers are
// engine.predict's (the softmax of the eval graph).

import { classNames, readPhotoInput } from './data.js';
import { topClasses } from './engine.js';
import { DeviceError } from './errors.js';
import { checkModelFile, deviceModelFile } from './modelfile.js';
import { normalizePixels } from './preprocess.js';
import { pct, SHARED_UNTRAINED } from './results.js';
import { normalizeReadings, readSensorCsv } from './sensors.js';
import { fileWords, recordingSamples } from './tasks.js';
import { readText, suggestWords } from './text.js';
import { $, fatal, sentence, showProblem, status } from './ui.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./engine.js').Engine} Engine */
/** @typedef {import('./modelfile.js').DeviceModelInfo} DeviceModelInfo */
/** @typedef {import('./runner.js').ExampleSource} ExampleSource */
/** @typedef {import('./tasks.js').RecordingTask} RecordingTask */
/** @typedef {import('./tasks.js').Recording} Recording */

const TOP = 3; // classes shown for a photo, words suggested for a phrase
const WINDOWS_SHOWN = 20; // windows of a recording whose activity is listed
const PROBES = 8; // inputs on which the written file must give the engine's answers

/**
 * The "Try it" section: take or pick a photo and see the model's most likely classes; save the model as a file.
 * `modelChanged` takes a new snapshot of the model the device keeps (after a round is saved); `describeModel`
 * says again which model it is.
 * @param {object} parts
 * @param {typeof import('onnxruntime-web')} parts.ort
 * @param {Engine} parts.engine
 * @param {Contract} parts.contract
 * @param {() => Promise<Uint8Array>} parts.inferenceGraph the bundle's model.onnx
 * @param {() => DeviceModelInfo} parts.info which model the device keeps
 * @param {ExampleSource} parts.examples the person's examples (the file is checked on some of them)
 * @param {RecordingTask | null} [parts.task] a text or sensor bundle's task (null: an image bundle)
 * @returns {{modelChanged: () => void, describeModel: () => void}}
 */
export function setUpTryIt({ ort, engine, contract, inferenceGraph, info, examples, task = null }) {
  const manifest = engine.manifest;
  const names = classNames(manifest);
  let held = engine.snapshot(); // a promise of the tensors held now (read back from the GPU, if there)
  let photoUrl = '';
  /** @type {Promise<unknown>} one prediction or file at a time */
  let busy = Promise.resolve();
  const queue = (/** @type {() => Promise<void>} */ work) => {
    busy = busy.then(work).catch(fatal);
  };

  const describeModel = () => {
    const { trained, lastCompletedRound } = info();
    $('try-model').textContent = !trained
      ? "The model has not learned from your examples yet (no round so far): these are the untrained model's answers."
      : lastCompletedRound == null // saved, yet no round here: the run's final model, taken after it ended
        ? `${sentence(SHARED_UNTRAINED)}. It works offline.`
        : `Your model after round ${lastCompletedRound}. It works offline.`;
  };

  const tryPhoto = async (/** @type {File} */ file) => {
    const started = performance.now();
    let input;
    try {
      input = await readPhotoInput(file, manifest.input);
    } catch (err) {
      if (!(err instanceof DeviceError)) throw err;
      showProblem(err);
      return;
    }
    const predicting = performance.now();
    const probabilities = await engine.predict(input, 1, await held);
    const done = performance.now();
    if (photoUrl) URL.revokeObjectURL(photoUrl);
    photoUrl = URL.createObjectURL(file);
    $('try-image', HTMLImageElement).src = photoUrl;
    $('try-top').replaceChildren(
      ...topClasses(probabilities, names, TOP).map(({ name, probability }) => {
        const item = document.createElement('li');
        const meter = document.createElement('meter');
        Object.assign(meter, { min: 0, max: 1, value: probability });
        item.append(`${name}: ${pct(probability)}`, meter);
        return item;
      }),
    );
    const result = $('try-result');
    // for people's tools, the browser test and bench/web.py: the numbers and how long they took
    Object.assign(result.dataset, {
      probabilities: JSON.stringify(Array.from(probabilities)),
      ms: String(done - started),
      predictMs: String(done - predicting),
    });
    result.hidden = false;
  };

  const saveModel = async () => {
    const button = $('save-model', HTMLButtonElement);
    const before = $('status').textContent || '';
    button.disabled = true;
    try {
      status('Writing the model file…');
      const device = info();
      const tensors = await engine.getTensors(engine.stateNames, await held);
      const file = deviceModelFile(await inferenceGraph(), tensors, manifest, contract.model_file, device);
      const probe = probeInputs(examples, engine, task);
      await checkModelFile(ort, file, engine, probe.x, probe.count, contract.model_file, await held);
      const link = $('model-link', HTMLAnchorElement);
      if (link.href.startsWith('blob:')) URL.revokeObjectURL(link.href);
      link.href = URL.createObjectURL(
        new Blob([/** @type {Uint8Array<ArrayBuffer>} */ (file)], { type: 'application/octet-stream' }),
      );
      link.download = `edgepfl-model-${device.lastCompletedRound == null ? (device.trained ? 'trained' : 'untrained') : `round-${device.lastCompletedRound}`}.onnx`;
      link.textContent = `${link.download} (${(file.length / 1e6).toFixed(1)} MB)`;
      link.hidden = false;
      link.click();
      status(before);
    } catch (err) {
      if (!(err instanceof DeviceError)) throw err;
      showProblem(err);
      status(before);
    } finally {
      button.disabled = false;
    }
  };

  /** The words the model suggests after what is typed now (the latest text only, once the one before is done). */
  let typed = '';
  const suggest = async () => {
    const phrase = typed;
    const vocabulary = /** @type {NonNullable<RecordingTask['vocabulary']>} */ (task && task.vocabulary);
    const started = performance.now();
    const words = await suggestWords(engine, phrase, vocabulary, TOP, await held);
    const list = $('try-words');
    list.replaceChildren(
      ...words.map(({ word, probability }) => {
        const item = document.createElement('li');
        const button = document.createElement('button');
        button.type = 'button';
        button.textContent = word;
        button.title = pct(probability);
        button.addEventListener('click', () => {
          const box = $('try-phrase', HTMLInputElement);
          box.value = `${box.value}${/\s$|^$/.test(box.value) ? '' : ' '}${word} `;
          box.dispatchEvent(new Event('input'));
          box.focus();
        });
        item.append(button);
        return item;
      }),
    );
    // for people's tools and the browser test: the words, their probabilities, and how long it took
    const ms = String(performance.now() - started);
    Object.assign(list.dataset, { phrase, words: JSON.stringify(words.map((w) => w.word)), ms });
  };

  /** The activity of each window of a recording (the first WINDOWS_SHOWN). */
  const tryWindows = async (/** @type {File} */ file) => {
    let windows;
    try {
      const source = fileWords(file.name);
      windows = readSensorCsv(readText(new Uint8Array(await file.arrayBuffer()), source), manifest, source);
    } catch (err) {
      if (!(err instanceof DeviceError)) throw err;
      showProblem(err);
      return;
    }
    const count = Math.min(windows.count, WINDOWS_SHOWN);
    const x = normalizeReadings(windows.x, manifest.input).subarray(0, count * engine.sampleSize);
    const probabilities = await engine.predict(x, count, await held);
    const classes = names.length;
    const rows = Array.from({ length: count }, (_, i) => probabilities.subarray(i * classes, (i + 1) * classes));
    const list = $('try-activities');
    list.replaceChildren(
      ...rows.map((row, i) => {
        const [best] = topClasses(row, names, 1);
        const item = document.createElement('li');
        item.textContent = `window ${i + 1}: ${best.name} (${pct(best.probability)})`;
        item.dataset.label = String(best.index);
        return item;
      }),
    );
    list.dataset.probabilities = JSON.stringify(Array.from(probabilities));
  };

  if (task && task.kind === 'next-word') {
    const box = $('try-phrase', HTMLInputElement);
    box.addEventListener('input', () => {
      typed = box.value;
      queue(suggest);
    });
    $('try-typing').hidden = false;
    $('try-photos').hidden = true;
    queue(suggest); // the words a line starts with
  } else if (task && task.kind === 'sensor') {
    const input = $('try-window', HTMLInputElement);
    input.addEventListener('change', () => {
      const file = input.files && input.files[0];
      if (file) queue(() => tryWindows(file).finally(() => (input.value = '')));
    });
    $('try-windows').hidden = false;
    $('try-photos').hidden = true;
  }
  for (const id of ['try-camera', 'try-photo']) {
    const input = $(id, HTMLInputElement);
    input.addEventListener('change', () => {
      const file = input.files && input.files[0];
      if (file) queue(() => tryPhoto(file).finally(() => (input.value = '')));
    });
  }
  $('save-model').addEventListener('click', () => queue(saveModel));
  describeModel();
  $('try').hidden = false;
  // the first photo's answer then does not wait for its session to open (a failure here shows at that answer)
  queue(() => engine.preparePredict().catch(() => {}));
  return {
    modelChanged: () => {
      held = engine.snapshot();
      describeModel();
      if (task && task.kind === 'next-word') queue(suggest); // the words of the line typed, by the new model
    },
    describeModel,
  };
}

/**
 * Up to PROBES model inputs to check a written file on: the person's first examples, else seeded noise (token ids
 * for a text bundle).
 * @param {ExampleSource} examples
 * @param {Engine} engine
 * @param {RecordingTask | null} task
 * @returns {{x: import('./engine.js').ModelInput, count: number}}
 */
function probeInputs(examples, engine, task) {
  const held = examples.current();
  const size = engine.sampleSize;
  const count = Math.min(PROBES, held.count) || PROBES;
  if (task && held.count) {
    return { x: recordingSamples(/** @type {Recording} */ (held), task).x.subarray(0, count * size), count };
  }
  if (engine.inputType.dtype === 'int64') {
    const classes = engine.manifest.num_classes;
    return { x: BigInt64Array.from({ length: count * size }, (_, i) => BigInt((i * 7919) % classes)), count };
  }
  const x = new Float32Array(count * size);
  if (held.count && 'pixels' in held) {
    for (let i = 0; i < count; i++)
      x.set(normalizePixels(held.pixels.subarray(i * size, (i + 1) * size), engine.manifest.input), i * size);
  } else {
    let state = 12345;
    for (let i = 0; i < x.length; i++) {
      state = (Math.imul(state, 1103515245) + 12345) >>> 0;
      x[i] = state / 2147483648 - 1; // in [-1, 1)
    }
  }
  return { x, count };
}
