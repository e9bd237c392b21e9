// @ts-check
// The data section of a text or sensor bundle: what file to pick and why, the file kept (its name and how many
// samples it makes, how many of them train and how many are kept aside), picking another one in its place and
// removing it. The round loop reads it as its ExampleSource (runner.js), split as the Python device splits it.

import { shortfallLine, shortfallReason } from './data.js';
import { plural, SAMPLE_WORDS } from './results.js';
import { RECORDING_WORDS, readRecording, splitRecording } from './tasks.js';
import { $, fatal, keeper, readPicked, showHeld } from './ui.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./store.js').DeviceStore} DeviceStore */
/** @typedef {import('./runner.js').ExampleSource} ExampleSource */
/** @typedef {import('./tasks.js').Recording} Recording */
/** @typedef {import('./tasks.js').RecordingTask} RecordingTask */

/**
 * The section that takes a person's text or recording (one file; another one replaces it).
 * @param {{store: DeviceStore, contract: Contract, task: RecordingTask, recording: Recording | null}} parts
 * @returns {ExampleSource}
 */
export function setUpRecording({ store, contract, task, recording }) {
  const words = RECORDING_WORDS[task.kind];
  const unit = SAMPLE_WORDS[task.kind].one;
  const { keep, added } = keeper(store, (/** @type {Recording | null} */ changed) => {
    recording = changed;
    render();
  });
  const render = () => {
    const count = recording ? recording.count : 0;
    const short = [shortfallLine(count, contract.device, task.kind), shortfallReason(count, contract.device, task.kind)]
      .join(' ')
      .trim();
    const { train, val } = recording ? split() : { train: { count: 0 }, val: { count: 0 } };
    $('recording-held').textContent = recording
      ? `${recording.name}: ${plural(count, unit)}, ${train.count} to learn from and ${val.count} kept aside to ` +
        `check how well the model does.${short ? ` ${short}` : ''}`
      : short;
    $('recording-remove').hidden = !recording;
    showHeld(task.kind, recording ? recording.classesHeld : 0);
  };
  const split = () => {
    const { val_fraction: valFraction, split_seed: seed } = contract.device;
    return splitRecording(/** @type {Recording} */ (recording), task, valFraction, seed);
  };
  $('recording-title').textContent = words.title;
  $('recording-needs').textContent = words.needs;
  $('recording-pick').textContent = words.pick;
  const input = $('recording-file', HTMLInputElement);
  input.accept = words.accept;
  input.addEventListener('change', () => {
    const reading = `Reading ${input.files && input.files[0] ? input.files[0].name : 'the file'}…`;
    readPicked(input, reading, async (files) => {
      const read = readRecording(new Uint8Array(await files[0].arrayBuffer()), files[0].name, task);
      const replaced = recording ? ` in place of ${recording.name}` : '';
      await keep(read, `Kept ${read.name}${replaced}: ${plural(read.count, unit)} to learn from.`);
    }).catch(fatal);
  });
  $('recording-remove').addEventListener('click', () => {
    if (!recording) return;
    if (!confirm(`Remove ${recording.name} from this phone? What the model already learned from it stays.`)) return;
    keep(null, `Removed ${recording.name}.`).catch(fatal);
  });
  $('recording').hidden = false;
  render();
  return {
    current: () => recording || { count: 0 },
    added,
    split: (valFraction, seed) => splitRecording(/** @type {Recording} */ (recording), task, valFraction, seed),
  };
}
