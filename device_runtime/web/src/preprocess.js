// @ts-check
// Pre-processing of the browser device: decoded RGBA pixels -> the model's float32 input, computing exactly
// what the Python device does (edgepfl/kinds/pictures.py resize_image, then the image kind's normalize).

import { DeviceError } from './errors.js';

/** @typedef {import('./engine.js').InputSpec} InputSpec */

/** Pixels the model cannot take. */
export class PreprocessError extends DeviceError {}

/**
 * uint8 pixels (C*H*W, channels first) of the model's input size from RGBA pixels of any size: grey as
 * Pillow's 'L' conversion when C is 1, then resize_image's filter (rows first, then columns).
 * @param {Uint8Array | Uint8ClampedArray} rgba
 * @param {number} width
 * @param {number} height
 * @param {InputSpec} inputSpec
 */
export function toModelPixels(rgba, width, height, inputSpec) {
  const [channels, outHeight, outWidth] = inputSpec.shape;
  if (channels !== 1 && channels !== 3)
    throw new PreprocessError(`the model takes ${channels}-channel images`, 'use an .npz for this model');
  if (
    !Number.isInteger(width) ||
    !Number.isInteger(height) ||
    width < 1 ||
    height < 1 ||
    rgba.length !== width * height * 4
  ) {
    throw new PreprocessError(
      `an image of ${width}x${height} has ${rgba.length} RGBA values`,
      'pass width*height*4 RGBA bytes',
    );
  }
  const out = new Uint8Array(channels * outHeight * outWidth);
  const plane = new Float64Array(width * height);
  for (let c = 0; c < channels; c++) {
    for (let p = 0; p < width * height; p++) {
      const r = rgba[4 * p],
        g = rgba[4 * p + 1],
        b = rgba[4 * p + 2];
      // Pillow's RGB -> L: 16-bit fixed point of 0.299, 0.587, 0.114 with rounding
      plane[p] = channels === 1 ? (r * 19595 + g * 38470 + b * 7471 + 0x8000) >>> 16 : rgba[4 * p + c];
    }
    const resized = resizePlane(plane, height, width, outHeight, outWidth);
    const base = c * outHeight * outWidth;
    for (let i = 0; i < resized.length; i++) out[base + i] = Math.min(255, Math.max(0, Math.floor(resized[i] + 0.5)));
  }
  return out;
}

/** float32 model input (C*H*W) from uint8 pixels (C*H*W): /255 then (v - mean) / std in float32, like normalize(). */
export function normalizePixels(/** @type {Uint8Array} */ pixels, /** @type {InputSpec} */ inputSpec) {
  const [channels, height, width] = inputSpec.shape;
  const plane = height * width;
  if (pixels.length !== channels * plane)
    throw new PreprocessError(
      `${pixels.length} pixels for an input of [${inputSpec.shape}]`,
      'pre-process with toModelPixels first',
    );
  const out = new Float32Array(pixels.length);
  const scale = Math.fround(1 / 255);
  const mean = inputSpec.mean && inputSpec.mean.length ? inputSpec.mean : null;
  for (let c = 0; c < channels; c++) {
    const m = mean ? Math.fround(mean[c]) : 0;
    const s = mean ? Math.fround(inputSpec.std[c]) : 1;
    for (let i = c * plane; i < (c + 1) * plane; i++) {
      // each operation rounded to float32, as numpy computes it on float32 arrays
      const v = Math.fround(pixels[i] * scale);
      out[i] = mean ? Math.fround(Math.fround(v - m) / s) : v;
    }
  }
  return out;
}

/** The model's float32 input (C*H*W) from RGBA pixels (w*h*4) of any size: toModelPixels then normalizePixels. */
export function toModelInput(
  /** @type {Uint8Array | Uint8ClampedArray} */ rgba,
  /** @type {number} */ width,
  /** @type {number} */ height,
  /** @type {InputSpec} */ inputSpec,
) {
  return normalizePixels(toModelPixels(rgba, width, height, inputSpec), inputSpec);
}

/** Source indices and normalised weights of resize_taps (edgepfl/kinds/pictures.py) for one output index. */
export function resizeTaps(/** @type {number} */ inSize, /** @type {number} */ outSize) {
  const scale = inSize / outSize;
  const support = Math.max(scale, 1.0);
  const rows = [];
  for (let i = 0; i < outSize; i++) {
    const centre = (i + 0.5) * scale;
    const first = Math.max(Math.trunc(centre - support + 0.5), 0);
    const last = Math.min(Math.trunc(centre + support + 0.5), inSize);
    const weights = [];
    let total = 0;
    for (let j = first; j < last; j++) {
      const w = Math.max(0.0, 1.0 - Math.abs((j - centre + 0.5) / support));
      weights.push(w);
      total += w;
    }
    rows.push({ first, weights: weights.map((w) => w / total) });
  }
  return rows;
}

/**
 * @param {Float64Array} plane
 * @param {number} height
 * @param {number} width
 * @param {number} outHeight
 * @param {number} outWidth
 */
function resizePlane(plane, height, width, outHeight, outWidth) {
  if (height === outHeight && width === outWidth) return plane;
  // rows first (axis 0), then columns, each output a sum of its taps in ascending order
  const rowTaps = resizeTaps(height, outHeight);
  const tall = new Float64Array(outHeight * width);
  for (let i = 0; i < outHeight; i++) {
    const { first, weights } = rowTaps[i];
    for (let x = 0; x < width; x++) {
      let acc = 0;
      for (let k = 0; k < weights.length; k++) acc += weights[k] * plane[(first + k) * width + x];
      tall[i * width + x] = acc;
    }
  }
  const colTaps = resizeTaps(width, outWidth);
  const out = new Float64Array(outHeight * outWidth);
  for (let i = 0; i < outHeight; i++) {
    for (let x = 0; x < outWidth; x++) {
      const { first, weights } = colTaps[x];
      let acc = 0;
      for (let k = 0; k < weights.length; k++) acc += weights[k] * tall[i * width + first + k];
      out[i * outWidth + x] = acc;
    }
  }
  return out;
}
