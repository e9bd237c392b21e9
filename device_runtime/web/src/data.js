// @ts-check
// A person's labelled examples as the model sees them: photos (camera or library), a folder with one sub-folder
// per class, or an .npz with `x`/`y` (as edgepfl/kinds/image.py reads them). Examples are kept as uint8 pixels at
// the model's input size (C*H*W each, 1 byte per value); the seeded train/held-out split and the normalisation
// happen when a round trains, exactly as the Python device does them (edgepfl/data.py). photos.js reads the photos.

import { heldOutCount, splitTrainVal } from './algorithms.js';
import { DataError, describe } from './errors.js';
import { normalizePixels } from './preprocess.js';
import { plural } from './results.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./engine.js').InputSpec} InputSpec */
/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./algorithms.js').Samples} Samples */
/** @typedef {import('./kinds.js').KindWords} KindWords */
/**
 * The person's examples: uint8 pixels (C*H*W each) at the model's input size and their labels; `lastAdded`: how
 * many of the last ones came in the last addition (0 once any was removed), for "remove the last added".
 * @typedef {{pixels: Uint8Array, labels: Int32Array, count: number, shape: number[], lastAdded?: number}} Examples
 */
/** Examples read from files, before they join the kept ones. @typedef {{pixels: Uint8Array, labels: Int32Array, count: number}} NewExamples */

// reading photos and folders of them is photos.js's; the page's modules import them from here
export { DataError } from './errors.js';
export { readFolder, readPhotoInput, readPhotos } from './photos.js';

/** The class names to show: manifest.class_names when the bundle has them, else "0".."n-1" (Manifest.class_labels). */
export function classNames(/** @type {Manifest} */ manifest) {
  const names = manifest.class_names;
  if (Array.isArray(names) && names.length === manifest.num_classes && names.every((n) => typeof n === 'string'))
    return /** @type {string[]} */ (names);
  return Array.from({ length: manifest.num_classes }, (_, i) => String(i));
}

/** No examples yet, for a model input of `shape` [C, H, W]. */
export function emptyExamples(/** @type {number[]} */ shape) {
  /** @type {Examples} */
  const examples = { pixels: new Uint8Array(0), labels: new Int32Array(0), count: 0, shape: [...shape] };
  return examples;
}

/** Examples with `more` ({pixels, labels, count}) appended. */
export function appendExamples(/** @type {Examples} */ examples, /** @type {NewExamples} */ more) {
  const pixels = new Uint8Array(examples.pixels.length + more.pixels.length);
  pixels.set(examples.pixels);
  pixels.set(more.pixels, examples.pixels.length);
  const labels = new Int32Array(examples.count + more.count);
  labels.set(examples.labels);
  labels.set(more.labels, examples.count);
  /** @type {Examples} */
  const all = { pixels, labels, count: examples.count + more.count, shape: examples.shape, lastAdded: more.count };
  return all;
}

/** The examples without those at the positions `drop` says (a removal: nothing says what was last added then). */
export function keepExamples(
  /** @type {Examples} */ examples,
  /** @type {(label: number, index: number) => boolean} */ drop,
) {
  const size = examples.shape.reduce((a, b) => a * b, 1);
  const kept = Array.from(examples.labels.keys()).filter((i) => !drop(examples.labels[i], i));
  const pixels = new Uint8Array(kept.length * size);
  kept.forEach((at, i) => {
    pixels.set(examples.pixels.subarray(at * size, (at + 1) * size), i * size);
  });
  /** @type {Examples} */
  const left = {
    pixels,
    labels: Int32Array.from(kept, (i) => examples.labels[i]),
    count: kept.length,
    shape: examples.shape,
    lastAdded: 0,
  };
  return left;
}

/** The examples without those of one class. */
export function withoutClass(/** @type {Examples} */ examples, /** @type {number} */ label) {
  return keepExamples(examples, (l) => l === label);
}

/** The examples without the last addition (a photo pick, a folder, an .npz). */
export function withoutLastAdded(/** @type {Examples} */ examples) {
  const from = examples.count - (examples.lastAdded || 0);
  return keepExamples(examples, (_, i) => i >= from);
}

/** How many examples of each class. */
export function classCounts(/** @type {Examples} */ examples, /** @type {number} */ numClasses) {
  const counts = new Array(numClasses).fill(0);
  for (const label of examples.labels) counts[label] += 1;
  return counts;
}

/**
 * Seeded train/held-out split (split_train_val) and normalised inputs: {train: {x, y, count}, val: {...}}.
 * valFraction and seed: the device contract's `device.val_fraction` and `device.split_seed`.
 * @param {Examples} examples
 * @param {InputSpec} inputSpec
 * @param {number} valFraction
 * @param {number} seed
 * @returns {{train: Samples, val: Samples}}
 */
export function splitExamples(examples, inputSpec, valFraction, seed) {
  const { train, val } = splitTrainVal(examples.count, valFraction, seed);
  const size = examples.shape.reduce((a, b) => a * b, 1);
  const part = (/** @type {Int32Array} */ index) => {
    const x = new Float32Array(index.length * size);
    const y = new Int32Array(index.length);
    index.forEach((at, i) => {
      x.set(normalizePixels(examples.pixels.subarray(at * size, (at + 1) * size), inputSpec), i * size);
      y[i] = examples.labels[at];
    });
    return { x, y, count: index.length };
  };
  return { train: part(train), val: part(val) };
}

/** How many of `count` examples train and how many are held out (valFraction, seed: as for splitExamples). */
export function splitSizes(/** @type {number} */ count, /** @type {number} */ valFraction, /** @type {number} */ seed) {
  const { train, val } = splitTrainVal(count, valFraction, seed);
  return { train: train.length, val: val.length };
}

/**
 * How many more examples the page needs before it asks for rounds (0: enough): with the contract's split, at
 * least `min_train_examples` to learn from and `min_held_out` held out to measure the model (device_runtime/
 * contract.py says why). Removing examples can bring a device below it again.
 * @param {number} count the examples held
 * @param {{val_fraction: number, min_train_examples: number, min_held_out: number}} device the contract's `device`
 */
export function examplesShortfall(count, device) {
  const heldOut = device.val_fraction > 0 ? device.min_held_out : 0; // nothing is ever held out otherwise
  for (let n = Math.max(count, 1); n <= count + 100000; n++) {
    const held = heldOutCount(n, device.val_fraction);
    if (n - held >= device.min_train_examples && held >= heldOut) return n - count;
  }
  throw new DataError(
    "no number of examples meets the server's minimum with its held-out fraction",
    'reload the page; if it persists, tell whoever runs the server',
  );
}

/** The headline that asks for more samples (named by the bundle's kind: `words`), or '' when there are enough. */
export function shortfallLine(
  /** @type {number} */ count,
  /** @type {Contract['device']} */ device,
  /** @type {KindWords} */ words,
) {
  const more = examplesShortfall(count, device);
  if (!more) return '';
  const one = words.sample ?? words.one;
  const noun = more === 1 ? one : `${one}s`;
  return `Add ${more} ${count ? 'more ' : ''}${noun}${words.more} to take part in the rounds.`;
}

/** Why: how many examples the model needs, to learn from and kept aside ('' when there are enough). */
export function shortfallReason(
  /** @type {number} */ count,
  /** @type {Contract['device']} */ device,
  /** @type {KindWords} */ words,
) {
  const more = examplesShortfall(count, device);
  if (!more) return '';
  const total = count + more;
  const held = heldOutCount(total, device.val_fraction);
  const needs = `The model needs ${plural(total, words.sample ?? words.one)}`;
  return `${needs}: ${total - held} to learn from and ${held} kept aside to check how well it does.`;
}

/** An .npz with uint8 images `x` (N,C,H,W | N,H,W,C | N,H,W) and class indices `y`, at the model's input size. */
/** @returns {Promise<NewExamples>} */
export async function readNpz(
  /** @type {Uint8Array} */ bytes,
  /** @type {InputSpec} */ inputSpec,
  /** @type {number} */ numClasses,
) {
  const { unzipSync } = await import('./vendor/fflate.mjs');
  let entries;
  try {
    entries = unzipSync(bytes);
  } catch (err) {
    throw new DataError(`the file is not a readable .npz (${describe(err)})`, 'choose an .npz written by numpy.savez');
  }
  for (const key of ['x', 'y']) {
    if (!entries[`${key}.npy`])
      throw new DataError(
        `the .npz has no array "${key}"`,
        'save the images as x and the labels as y: np.savez(path, x=images, y=labels)',
      );
  }
  const x = readNpy(entries['x.npy'], 'x');
  const y = readNpy(entries['y.npy'], 'y');
  if (!(x.data instanceof Uint8Array))
    throw new DataError(`x holds ${x.descr} values`, 'save x as uint8 pixels (0..255)');
  const count = x.shape[0];
  const pixels = toChannelsFirst(x, inputSpec);
  const labels = checkLabels(y, count, numClasses);
  return { pixels, labels, count };
}

/** @type {Record<string, import('./safetensors.js').TypedArrayConstructor>} */
const NPY_TYPES = {
  u1: Uint8Array,
  i1: Int8Array,
  u2: Uint16Array,
  i2: Int16Array,
  u4: Uint32Array,
  i4: Int32Array,
  u8: BigUint64Array,
  i8: BigInt64Array,
  f4: Float32Array,
  f8: Float64Array,
  b1: Uint8Array,
};

/** One .npy array: {descr, shape, data}; refuses big-endian, Fortran order and pickled objects. */
function readNpy(/** @type {Uint8Array} */ bytes, /** @type {string} */ name) {
  const bad = (/** @type {string} */ problem) =>
    new DataError(`${name} in the .npz ${problem}`, 'save it with numpy.savez (little-endian, C order, no objects)');
  if (bytes.length < 10 || bytes[0] !== 0x93 || String.fromCharCode(...bytes.subarray(1, 6)) !== 'NUMPY')
    throw bad('is not an .npy array');
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const major = bytes[6];
  const headerLength = major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const start = major === 1 ? 10 : 12;
  const header = new TextDecoder('latin1').decode(bytes.subarray(start, start + headerLength));
  const descr = (header.match(/'descr':\s*'([^']+)'/) || [])[1];
  const fortran = /'fortran_order':\s*True/.test(header);
  const shapeText = (header.match(/'shape':\s*\(([^)]*)\)/) || [])[1];
  if (!descr || shapeText === undefined) throw bad('has an unreadable header');
  if (fortran) throw bad('is stored in Fortran order');
  const type = NPY_TYPES[descr.slice(1)];
  if (!type || descr[0] === '>' || (descr[0] === '|' && type.BYTES_PER_ELEMENT > 1)) throw bad(`has dtype ${descr}`);
  const shape = shapeText
    .split(',')
    .map((s) => s.trim())
    .filter(Boolean)
    .map(Number);
  const count = shape.reduce((a, b) => a * b, 1);
  const dataStart = start + headerLength;
  if (bytes.length - dataStart < count * type.BYTES_PER_ELEMENT) throw bad('is shorter than its shape');
  const data = new type(bytes.slice(dataStart, dataStart + count * type.BYTES_PER_ELEMENT).buffer);
  return { descr, shape, data };
}

/** x as N*C*H*W uint8 at the model's shape, reading the layouts the image kind reads (edgepfl/kinds/image.py). */
/** @returns {Uint8Array} */
function toChannelsFirst(
  /** @type {{shape: number[], data: import('./safetensors.js').TypedArray}} */ x,
  /** @type {InputSpec} */ inputSpec,
) {
  const [channels, height, width] = inputSpec.shape;
  const [n, ...rest] = x.shape;
  const same = (/** @type {number[]} */ a, /** @type {number[]} */ b) =>
    a.length === b.length && a.every((v, i) => v === b[i]);
  const pixels = /** @type {Uint8Array} */ (x.data);
  if (rest.length === 2 && channels === 1 && same(rest, [height, width])) return pixels;
  if (rest.length === 3) {
    const nchw = same(rest, [channels, height, width]);
    const nhwc = same(rest, [height, width, channels]);
    if (nchw) return pixels; // an image both ways is taken as the model's NCHW
    if (nhwc) {
      const out = new Uint8Array(pixels.length);
      const plane = height * width;
      for (let i = 0; i < n; i++) {
        for (let p = 0; p < plane; p++)
          for (let c = 0; c < channels; c++)
            out[(i * channels + c) * plane + p] = pixels[(i * plane + p) * channels + c];
      }
      return out;
    }
  }
  throw new DataError(
    `x has shape (${x.shape.join(', ')}), the model takes images of (${channels}, ${height}, ${width}) (NCHW) or (${height}, ${width}, ${channels}) (NHWC)`,
    "save x at the model's input size, or add the photos one by one (they are resized)",
  );
}

/** y as class indices 0..numClasses-1, one per image (check_labels). */
function checkLabels(
  /** @type {{shape: number[], data: import('./safetensors.js').TypedArray}} */ y,
  /** @type {number} */ count,
  /** @type {number} */ numClasses,
) {
  if (y.shape.length !== 1 || y.shape[0] !== count)
    throw new DataError(`y has shape (${y.shape.join(', ')}), expected (${count},)`, 'store one class index per image');
  const labels = new Int32Array(count);
  for (let i = 0; i < count; i++) {
    const value = Number(y.data[i]);
    if (!Number.isInteger(value) || value < 0 || value >= numClasses) {
      throw new DataError(`y[${i}] = ${value} is not a class of this model (0..${numClasses - 1})`, 'relabel the data');
    }
    labels[i] = value;
  }
  return labels;
}
