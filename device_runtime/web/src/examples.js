// @ts-check
// The examples section of an image bundle: the model's classes with how many photos of each (each with a
// remover), the pickers that add more (camera, photos, a folder with one sub-folder per class, an .npz), "remove
// the last added" and "remove all", and how the examples split: the section of the image kind (kind_image.js).

import {
  appendExamples,
  classCounts,
  classNames,
  keepExamples,
  readFolder,
  readNpz,
  readPhotos,
  shortfallLine,
  shortfallReason,
  splitSizes,
  withoutClass,
  withoutLastAdded,
} from './data.js';
import { plural } from './results.js';
import { $, fatal, keeper, readPicked, showHeld } from './ui.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./data.js').Examples} Examples */
/** @typedef {import('./data.js').NewExamples} NewExamples */
/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./kinds.js').KindWords} KindWords */
/** @typedef {import('./store.js').DeviceStore} DeviceStore */

/**
 * The examples section: the model's classes with how many examples of each (each with a remover), the pickers
 * that add more and the removers (each change committed to the store). Returns the examples held now, and a
 * promise of more.
 * @param {{store: DeviceStore, manifest: Manifest, contract: Contract, examples: Examples, words: KindWords}} parts
 * @returns {{current: () => Examples, added: () => Promise<void>}}
 */
export function setUpExamples({ store, manifest, contract, examples, words }) {
  const names = classNames(manifest);
  const select = $('class-select', HTMLSelectElement);
  select.replaceChildren(...names.map((name, i) => new Option(name, String(i))));
  const kept = keeper(store, (/** @type {Examples} */ changed) => {
    examples = changed;
    render();
  });
  const keep = kept.keep;
  const render = () => renderExamples(examples, names, contract, words, remove);
  const remove = async (/** @type {number} */ label) => {
    const count = classCounts(examples, names.length)[label];
    if (
      !confirm(
        `Remove the ${plural(count, 'example')} of "${names[label]}"? They are deleted from this phone; what the model already learned from them stays.`,
      )
    )
      return;
    await keep(withoutClass(examples, label), `Removed the ${plural(count, 'example')} of "${names[label]}".`);
  };
  const add = (/** @type {HTMLInputElement} */ input, /** @type {(files: FileList) => Promise<NewExamples>} */ read) =>
    readPicked(input, 'Reading the examples…', async (files) => {
      const more = await read(files);
      await keep(appendExamples(examples, more), `Added ${plural(more.count, 'example')}.`);
    });
  /** @param {string} id @param {(files: FileList) => Promise<NewExamples>} read */
  const picker = (id, read) => {
    const input = $(id, HTMLInputElement);
    input.addEventListener('change', () => add(input, read).catch(fatal));
  };
  const photos = (/** @type {FileList} */ files) => readPhotos(files, Number(select.value), manifest.input);
  picker('camera', photos);
  picker('photos', photos);
  picker('folder', (files) => readFolder(files, manifest.input, classNames(manifest)));
  picker('npz', async (files) =>
    readNpz(new Uint8Array(await files[0].arrayBuffer()), manifest.input, manifest.num_classes),
  );
  $('remove-last').addEventListener('click', () => {
    const count = examples.lastAdded || 0;
    if (
      !confirm(
        `Remove the last ${plural(count, 'example')} you added? They are deleted from this phone; what the model already learned from them stays.`,
      )
    )
      return;
    keep(withoutLastAdded(examples), `Removed the last ${plural(count, 'example')} added.`).catch(fatal);
  });
  $('remove-all').addEventListener('click', () => {
    const { count } = examples;
    if (
      !confirm(
        `Remove all ${plural(count, 'example')}? They are deleted from this phone; what the model already learned from them stays. The phone takes part in rounds again once it has enough examples.`,
      )
    )
      return;
    keep(
      keepExamples(examples, () => true),
      `Removed all ${plural(count, 'example')}.`,
    ).catch(fatal);
  });
  $('examples').hidden = false;
  render();
  return { current: () => examples, added: kept.added };
}

/**
 * The classes with their counts and removers, what is missing, how the examples split, and the removers.
 * @param {Examples} examples
 * @param {string[]} names
 * @param {Contract} contract
 * @param {KindWords} words
 * @param {(label: number) => void} remove
 */
function renderExamples(examples, names, contract, words, remove) {
  const counts = classCounts(examples, names.length);
  $('needs').textContent =
    `The model knows ${plural(names.length, 'class', 'classes')}: add labelled photos of each one you have.`;
  $('classes').replaceChildren(
    ...names.map((name, i) => {
      const item = document.createElement('li');
      item.append(`${name}: ${counts[i]}`);
      Object.assign(item.dataset, { label: String(i), count: String(counts[i]) });
      item.classList.toggle('missing', counts[i] === 0);
      if (counts[i]) {
        const button = document.createElement('button'); // its "×" is drawn by style.css: the chip's text stays "name: count"
        button.type = 'button';
        button.className = 'remove';
        button.setAttribute('aria-label', `remove the examples of ${name}`);
        button.dataset.label = String(i);
        button.addEventListener('click', () => remove(i));
        item.append(button);
      }
      return item;
    }),
  );
  const { count } = examples;
  const last = $('remove-last');
  last.hidden = !examples.lastAdded || examples.lastAdded === count;
  last.textContent = `Remove the last ${plural(examples.lastAdded || 0, 'example')} added`;
  $('remove-all').hidden = !count;
  const short = [shortfallLine(count, contract.device, words), shortfallReason(count, contract.device, words)]
    .join(' ')
    .trim();
  const { train, val } = count
    ? splitSizes(count, contract.device.val_fraction, contract.device.split_seed)
    : { train: 0, val: 0 };
  $('split').textContent =
    short || `${plural(count, 'example')}: ${train} to learn from, ${val} kept aside to check how well the model does.`;
  showHeld(words, counts.filter((n) => n > 0).length);
}
