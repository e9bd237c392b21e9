// @ts-check
// "Try it" and "Save the model": the device's own model at work, offline, and as a file to take elsewhere (the
// one `edgepfl device export-model` writes, fp32: modelfile.js). Both use the model the device keeps, a snapshot
// taken whenever a round is saved, never the tensors of a round being trained. What is tried is the kind's (a photo,
// pre-processed exactly as an example is: kind_image.js; the keyboard's words: keyboard.js; the activity the phone's
// motion shows: recorder.js, kind_sensor.js); the answers are engine.predict's (the softmax of the eval graph).

import { DeviceError } from './errors.js';
import { checkModelFile, deviceModelFile } from './modelfile.js';
import { SHARED_UNTRAINED } from './results.js';
import { $, fatal, sentence, showProblem, status } from './ui.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./engine.js').Engine} Engine */
/** @typedef {import('./modelfile.js').DeviceModelInfo} DeviceModelInfo */
/** @typedef {import('./kinds.js').ExampleSource} ExampleSource */
/** @typedef {import('./kinds.js').KindPage} KindPage */

const PROBES = 8; // inputs on which the written file must give the engine's answers

/**
 * The "Try it" section: which model answers, the kind's own Try it (a photo's classes, the keyboard's words, the
 * live activity), and "Save the model as a file". `modelChanged` takes a new snapshot of the model the device keeps
 * (after a round is saved); `describeModel` says again which model it is.
 * @param {object} parts
 * @param {Engine} parts.engine the engine, whose runtime checks the model file too
 * @param {Contract} parts.contract
 * @param {() => Promise<Uint8Array>} parts.inferenceGraph the bundle's model.onnx
 * @param {() => DeviceModelInfo} parts.info which model the device keeps
 * @param {KindPage} parts.kind the bundle's kind of sample on the page (its examples check the file)
 * @returns {{modelChanged: () => void, describeModel: () => void}}
 */
export function setUpTryIt({ engine, contract, inferenceGraph, info, kind }) {
  const manifest = engine.manifest;
  let held = engine.snapshot(); // a promise of the tensors held now (read back from the GPU, if there)
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

  const saveModel = async () => {
    const button = $('save-model', HTMLButtonElement);
    const before = $('status').textContent || '';
    button.disabled = true;
    try {
      status('Writing the model file…');
      const device = info();
      const tensors = await engine.getTensors(engine.stateNames, await held);
      const file = deviceModelFile(await inferenceGraph(), tensors, manifest, contract.model_file, device);
      const probe = kind.examples.probe(PROBES) || noise(engine);
      await checkModelFile(engine.ort, file, engine, probe.x, probe.count, contract.model_file, await held);
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

  const shown = kind.tryIt({ engine, held: () => held, queue });
  $('save-model').addEventListener('click', () => queue(saveModel));
  describeModel();
  $('try').hidden = false;
  // the first answer then does not wait for its session to open (a failure here shows at that answer)
  queue(() => engine.preparePredict().catch(() => {}));
  return {
    modelChanged: () => {
      held = engine.snapshot();
      describeModel();
      shown.modelChanged(); // the kind's answers, by the new model
    },
    describeModel,
  };
}

/** PROBES seeded inputs to check a written file on when the person holds none: token ids, or values in [-1, 1). */
function noise(/** @type {Engine} */ engine) {
  const count = PROBES;
  const size = engine.sampleSize;
  if (engine.inputType.dtype === 'int64') {
    const classes = engine.manifest.num_classes;
    return { x: BigInt64Array.from({ length: count * size }, (_, i) => BigInt((i * 7919) % classes)), count };
  }
  const x = new Float32Array(count * size);
  let state = 12345;
  for (let i = 0; i < x.length; i++) {
    state = (Math.imul(state, 1103515245) + 12345) >>> 0;
    x[i] = state / 2147483648 - 1; // in [-1, 1)
  }
  return { x, count };
}
