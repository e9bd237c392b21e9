// @ts-check
// A person's photos as examples (as edgepfl/kinds/image.py reads images): photos picked or taken, a folder with
// one sub-folder per class, decoded by the browser and resized to the model's input (preprocess.js).

import { DataError, describe } from './errors.js';
import { normalizePixels, toModelPixels } from './preprocess.js';

/** @typedef {import('./engine.js').InputSpec} InputSpec */
/** @typedef {import('./data.js').NewExamples} NewExamples */
/** An image file with the webkitRelativePath of a folder pick. @typedef {File & {webkitRelativePath?: string}} PickedFile */
/** A decoded image: RGBA pixels at its size. @typedef {{rgba: Uint8ClampedArray | Uint8Array, width: number, height: number}} Decoded */
/** An image to read: its file, its label and the name shown in errors. @typedef {[File, number, string?]} Labelled */
const IMAGE_NAME = /\.(png|jpe?g|bmp|gif|webp|tiff?)$/i; // edgepfl/kinds/pictures.py IMAGE_SUFFIXES
const LARGEST_DECODED_SIDE = 2048; // bigger photos are scaled down by the browser first (memory on phones)

/** Photos (camera or library) that all show `label`: decoded at their natural size, then pre-processed. */
export async function readPhotos(
  /** @type {Iterable<File>} */ files,
  /** @type {number} */ label,
  /** @type {InputSpec} */ inputSpec,
) {
  const list = Array.from(files).filter((file) => IMAGE_NAME.test(file.name) || (file.type || '').startsWith('image/'));
  if (!list.length) throw new DataError('none of the chosen files is an image', 'choose photos (PNG, JPEG, WebP, ...)');
  return collect(
    list.map((file) => /** @type {[File, number]} */ ([file, label])),
    inputSpec,
  );
}

/**
 * A folder with one sub-folder per class (`<input webkitdirectory>`), labelled by `labelFolderFiles`. `names` are the
 * class folders' names, classNames(manifest) (a class count stands for "0".."n-1"); `decode` turns a file into
 * {rgba, width, height} (the browser's decoder unless a test gives another).
 * @param {Iterable<PickedFile>} files
 * @param {InputSpec} inputSpec
 * @param {string[] | number} names
 * @param {(file: File) => Promise<Decoded>} [decode]
 * @returns {Promise<NewExamples>}
 */
export async function readFolder(files, inputSpec, names, decode = decodeImage) {
  const labels = typeof names === 'number' ? Array.from({ length: names }, (_, i) => String(i)) : names;
  const list = Array.from(files);
  const paths = list.map((file) => (file.webkitRelativePath || file.name).split('/'));
  const root = paths.length ? paths[0][0] : '';
  const byPath = new Map(list.map((file, i) => [paths[i].slice(1).join('/'), file]));
  const labelled = labelFolderFiles(
    root,
    paths.map((parts) => parts.slice(1)),
    labels,
    inputSpec,
  );
  /** @type {Labelled[]} */
  const entries = labelled.map(([parts, label]) => [
    /** @type {File} */ (byPath.get(parts.join('/'))),
    label,
    `${root}/${parts.join('/')}`,
  ]);
  return collect(entries, inputSpec, decode);
}

/**
 * The images of a folder `root` and their labels: edgepfl/kinds/pictures.py label_folder_files, line for line.
 * `files` are paths inside the folder as arrays of parts; hidden entries and files that are not images are ignored;
 * every image sits directly in a class folder named as its class (`labels`); anything else is one DataError.
 * @param {string} root
 * @param {string[][]} files
 * @param {string[]} labels
 * @param {InputSpec} inputSpec
 * @returns {[string[], number][]}
 */
export function labelFolderFiles(root, files, labels, inputSpec) {
  imageChannels(inputSpec);
  const visible = files.filter((parts) => !parts.some((part) => part.startsWith('.'))).sort(comparePaths);
  const images = visible.filter((parts) => IMAGE_NAME.test(parts[parts.length - 1]));
  for (const parts of images) {
    if (parts.length === 1)
      throw new DataError(
        `${root}/${parts[0]} is outside the class folders`,
        `move it into the folder of its class: ${root}/<class>/${parts[0]}`,
      );
    if (parts.length > 2)
      throw new DataError(
        `${root}/${parts.join('/')} is in a folder inside class folder ${parts[0]}`,
        "put each class's images directly in its class folder",
      );
  }
  const index = new Map(labels.map((name, label) => [name.normalize('NFC'), label]));
  const folders = [...new Set(visible.filter((parts) => parts.length > 1).map((parts) => parts[0]))].sort(compareText);
  for (const folder of folders) {
    if (!index.has(folder.normalize('NFC')))
      throw new DataError(`folder ${root}/${folder} is not named as a class of this model`, namingFix(labels));
    if (!images.some((parts) => parts[0] === folder))
      throw new DataError(`class folder ${root}/${folder} holds no images`, 'add images (.png, .jpg, …) or remove it');
  }
  if (!images.length) throw new DataError(`${root} has no class folders with images`, namingFix(labels));
  return images.map((parts) => /** @type {[string[], number]} */ ([parts, index.get(parts[0].normalize('NFC'))]));
}

/** The channel count of a model that takes image files (1 grey, 3 colour); others are refused as Python does. */
function imageChannels(/** @type {InputSpec} */ inputSpec) {
  const channels = inputSpec.shape[0];
  if (channels !== 1 && channels !== 3)
    throw new DataError(`the model takes ${channels}-channel images`, 'use an .npz for this model');
  return channels;
}

/** How to name class folders (data.py _naming_fix); `labels` are names unless they are "0".."n-1". */
function namingFix(/** @type {string[]} */ labels) {
  if (!labels.every((name, i) => name === String(i))) {
    return `name each class folder exactly as its class: ${labels.slice(0, 12).join(', ')}${labels.length > 12 ? ', …' : ''}`;
  }
  return `name each class folder by its class index, 0 to ${labels.length - 1} (the bundle has no class names: \`edgepfl export --class-names\` adds them)`;
}

/** Python's str order: by Unicode code points (JavaScript's < compares UTF-16 units). */
function compareText(/** @type {string} */ a, /** @type {string} */ b) {
  const x = Array.from(a, (c) => /** @type {number} */ (c.codePointAt(0)));
  const y = Array.from(b, (c) => /** @type {number} */ (c.codePointAt(0)));
  for (let i = 0; i < Math.min(x.length, y.length); i++) if (x[i] !== y[i]) return x[i] - y[i];
  return x.length - y.length;
}

/** Python's tuple order of two paths given as parts. */
function comparePaths(/** @type {string[]} */ a, /** @type {string[]} */ b) {
  for (let i = 0; i < Math.min(a.length, b.length); i++) {
    const order = compareText(a[i], b[i]);
    if (order) return order;
  }
  return a.length - b.length;
}

/**
 * Examples of [file, label, shown name] entries: each decoded, then pre-processed as the Python loader does.
 * @param {Labelled[]} labelled
 * @param {InputSpec} inputSpec
 * @param {(file: File) => Promise<Decoded>} [decode]
 * @returns {Promise<NewExamples>}
 */
async function collect(labelled, inputSpec, decode = decodeImage) {
  const size = inputSpec.shape.reduce((a, b) => a * b, 1);
  const pixels = new Uint8Array(labelled.length * size);
  const labels = new Int32Array(labelled.length);
  for (let i = 0; i < labelled.length; i++) {
    const [file, label, shown] = labelled[i];
    let decoded;
    try {
      decoded = await decode(file);
    } catch (err) {
      throw new DataError(
        `${shown || file.name} is not a readable image (${describe(err)})`,
        'remove or replace the file',
      );
    }
    const { rgba, width, height } = decoded;
    pixels.set(toModelPixels(rgba, width, height, inputSpec), i * size);
    labels[i] = label;
  }
  return { pixels, labels, count: labelled.length };
}

/** One photo as the model's float32 input (C*H*W), pre-processed exactly as an example is ("Try it"). */
export async function readPhotoInput(/** @type {File} */ file, /** @type {InputSpec} */ inputSpec) {
  let decoded;
  try {
    decoded = await decodeImage(file);
  } catch (err) {
    throw new DataError(
      `${file.name} is not a photo this browser can read (${describe(err)})`,
      'choose a PNG or JPEG photo',
    );
  }
  return normalizePixels(toModelPixels(decoded.rgba, decoded.width, decoded.height, inputSpec), inputSpec);
}

/** RGBA pixels of an image file at its natural size (scaled down first only beyond LARGEST_DECODED_SIDE). */
async function decodeImage(/** @type {File} */ file) {
  let bitmap = await createImageBitmap(file, { colorSpaceConversion: 'none', premultiplyAlpha: 'none' });
  const scale = Math.min(1, LARGEST_DECODED_SIDE / Math.max(bitmap.width, bitmap.height));
  if (scale < 1) {
    const resized = await createImageBitmap(bitmap, {
      resizeWidth: Math.round(bitmap.width * scale),
      resizeHeight: Math.round(bitmap.height * scale),
      resizeQuality: 'high',
    });
    bitmap.close();
    bitmap = resized;
  }
  const { width, height } = bitmap;
  const canvas =
    typeof OffscreenCanvas === 'function'
      ? new OffscreenCanvas(width, height)
      : Object.assign(document.createElement('canvas'), { width, height });
  const context = /** @type {OffscreenCanvasRenderingContext2D | CanvasRenderingContext2D | null} */ (
    canvas.getContext('2d', { willReadFrequently: true })
  );
  if (!context) throw new DataError('this browser draws no images for the page', 'use a current Chrome or Safari');
  context.drawImage(bitmap, 0, 0);
  bitmap.close();
  return { rgba: context.getImageData(0, 0, width, height).data, width, height };
}
