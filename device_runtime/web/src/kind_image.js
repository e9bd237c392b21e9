// @ts-check
// Photos, the image kind of sample (a bundle whose manifest names no other kind): the person's labelled photos
// (examples.js draws their section; data.js and photos.js read them as the Python loader does), split by the
// seeded split and normalised as edgepfl/data.py does, and Try it on a photo: the model's three likeliest classes.

import { classNames, emptyExamples, readPhotoInput, splitExamples } from './data.js';
import { topClasses } from './engine.js';
import { DeviceError } from './errors.js';
import { setUpExamples } from './examples.js';
import { normalizePixels } from './preprocess.js';
import { pct } from './results.js';
import { $, showProblem } from './ui.js';

/** @typedef {import('./data.js').Examples} Examples */
/** @typedef {import('./engine.js').InputSpec} InputSpec */
/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./kinds.js').ExampleSource} ExampleSource */
/** @typedef {import('./kinds.js').KindWords} KindWords */
/** @typedef {import('./kinds.js').SampleKind} SampleKind */
/** @typedef {import('./kinds.js').TryParts} TryParts */

const TOP = 3; // classes shown for a photo

/** @type {KindWords} */
const WORDS = { one: 'example', right: 'recognised', more: '', rate: 'images' };

/** @type {SampleKind} */
export const imageKind = {
  name: 'image',
  words: WORDS,
  freeThread: false,
  async open({ manifest, store, contract }) {
    const saved = /** @type {unknown} */ ((await store.get('examples')).examples);
    const held = saved && typeof saved === 'object' && 'pixels' in saved ? /** @type {Examples} */ (saved) : null;
    const examples = setUpExamples({
      store,
      manifest,
      contract,
      examples: held || emptyExamples(manifest.input.shape),
      words: WORDS,
    });
    return {
      examples: photoSource(examples.current, examples.added, manifest.input),
      tryIt: (parts) => tryPhotos(parts, classNames(manifest)),
    };
  },
};

/**
 * The round loop's source of photos: `current` gives the examples held now, `added` a promise of more.
 * @param {() => Examples} current
 * @param {() => Promise<void>} added
 * @param {InputSpec} inputSpec
 * @returns {ExampleSource}
 */
export function photoSource(current, added, inputSpec) {
  return {
    words: WORDS,
    count: () => current().count,
    added,
    split: (valFraction, seed) => splitExamples(current(), inputSpec, valFraction, seed),
    probe: (count) => {
      const examples = current();
      const size = examples.shape.reduce((a, b) => a * b, 1);
      const n = Math.min(count, examples.count);
      if (!n) return null;
      const x = new Float32Array(n * size);
      for (let i = 0; i < n; i++)
        x.set(normalizePixels(examples.pixels.subarray(i * size, (i + 1) * size), inputSpec), i * size);
      return { x, count: n };
    },
  };
}

/** Try it on a photo (taken or picked): the model's likeliest classes, pre-processed as an example is. */
function tryPhotos(/** @type {TryParts} */ { engine, held, queue }, /** @type {string[]} */ names) {
  let photoUrl = '';
  const tryPhoto = async (/** @type {File} */ file) => {
    const started = performance.now();
    let input;
    try {
      input = await readPhotoInput(file, engine.manifest.input);
    } catch (err) {
      if (!(err instanceof DeviceError)) throw err;
      showProblem(err);
      return;
    }
    const predicting = performance.now();
    const probabilities = await engine.predict(input, 1, await held());
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
  for (const id of ['try-camera', 'try-photo']) {
    const input = $(id, HTMLInputElement);
    input.addEventListener('change', () => {
      const file = input.files && input.files[0];
      if (file) queue(() => tryPhoto(file).finally(() => (input.value = '')));
    });
  }
  $('try-photos').hidden = false;
  return { modelChanged: () => {} };
}
