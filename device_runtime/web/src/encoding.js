// @ts-check
// The browser device's compressed uploads, as edgepfl/encoding.py writes and the server decodes them: a base
// delta as fp32, fp16 or int8 (one float32 scale per tensor or per block, optionally stochastic rounding), the
// encoding named in the header metadata (`encoding`), clipped to the round's DP norm, with error feedback:
// what the encoding lost is returned as the residual the next round adds to its delta.

import { DeviceError } from './errors.js';
import { PCG64 } from './random.js';
import { decodeSafetensors } from './safetensors.js';

/** @typedef {import('./safetensors.js').Tensor} Tensor */
/** @typedef {import('./safetensors.js').Tensors} Tensors */
/** Float deltas (or residuals) by tensor name. @typedef {Record<string, {shape: number[], data: Float32Array}>} Delta */
/** A parsed encoding label. @typedef {{name: string, blockSize: number, stochastic: boolean, label: string}} Encoding */
/** The tensors and header metadata of an encoded payload. @typedef {{tensors: Tensors, metadata: Record<string, string>}} Encoded */

export const SCALE_SUFFIX = '.__scale__';
const LABEL = /^(fp32|fp16|int8)(?:-block([1-9][0-9]*))?(-sr)?$/;
const FP16_MAX = 65504;

/** An encoding the page cannot write or read, or a payload that does not match its encoding. */
export class EncodingError extends DeviceError {}

/** {name, blockSize, stochastic, label} of an encoding label (fp32, fp16, int8, int8-block256, int8-block256-sr). */
export function parseEncoding(/** @type {unknown} */ label) {
  const match = LABEL.exec(String(label));
  if (!match || (match[1] !== 'int8' && (match[2] || match[3]))) {
    throw new EncodingError(
      `the round asks for the unknown encoding ${JSON.stringify(label)}`,
      'ask the operator to use fp32, fp16, int8, int8-block<N> or int8[-block<N>]-sr',
    );
  }
  return {
    name: match[1],
    blockSize: match[2] ? Number(match[2]) : 0,
    stochastic: Boolean(match[3]),
    label: String(label),
  };
}

/** Whether a round's settings make the device upload its base delta instead of its base (encoding.py uploads_delta). */
export function uploadsDelta(/** @type {{upload_encoding?: string, clip_norm?: number | null}} */ settings) {
  return (settings.upload_encoding || 'fp32') !== 'fp32' || settings.clip_norm != null;
}

/** trained - received, per tensor, as float32 deltas {name: {shape, data: Float32Array}} (float64 difference first). */
export function baseDelta(/** @type {Tensors} */ trained, /** @type {Tensors} */ received) {
  /** @type {Delta} */
  const delta = {};
  for (const [name, t] of Object.entries(trained)) {
    const data = new Float32Array(t.data.length);
    for (let i = 0; i < data.length; i++) data[i] = Number(t.data[i]) - Number(received[name].data[i]);
    delta[name] = { shape: t.shape.slice(), data };
  }
  return delta;
}

/** Global L2 norm over every tensor of {name: {data}}, summed in float64 in name order (privacy.delta_norm). */
export function deltaNorm(/** @type {Delta} */ delta) {
  let total = 0;
  for (const name of Object.keys(delta).sort()) {
    let sum = 0;
    for (const value of delta[name].data) sum += value * value;
    total += sum;
  }
  return Math.sqrt(total);
}

/** The delta scaled to L2 norm <= clipNorm (unchanged when already inside), float32 (privacy.clip_delta). */
export function clipDelta(/** @type {Delta} */ delta, /** @type {number} */ clipNorm) {
  const norm = deltaNorm(delta);
  const factor = norm <= clipNorm ? 1 : (clipNorm / norm) * (1 - 2 ** -20); // the margin absorbs float32 rounding
  return mapValues(delta, (value) => value * factor);
}

/**
 * Encode delta + residual as `encoding` (a parseEncoding result), clipped to `clipNorm` when given (DP: the decoded
 * payload is then within it); returns {tensors, metadata, residual}: what safetensors writes, and the residual.
 * @param {Delta} delta
 * @param {Delta | null | undefined} residual
 * @param {Encoding} encoding
 * @param {{rng?: (() => number) | null, clipNorm?: number | null}} [options]
 */
export function encodeWithFeedback(delta, residual, encoding, { rng = null, clipNorm = null } = {}) {
  let total = delta;
  if (residual) {
    const held = residual;
    const same =
      Object.keys(residual).length === Object.keys(delta).length &&
      Object.keys(delta).every((n) => residual[n] && residual[n].data.length === delta[n].data.length);
    if (!same) throw new EncodingError("the saved residual does not match this round's tensors", 'start over');
    total = mapValues(delta, (value, name, i) => value + held[name].data[i]);
  }
  if (clipNorm != null) total = clipDelta(total, clipNorm);
  let encoded = encodeDelta(total, encoding, rng);
  let decoded = decodeDelta(encoded.tensors, encoded.metadata, encoding);
  for (let attempt = 0; clipNorm != null && deltaNorm(decoded) > clipNorm; attempt++) {
    if (attempt === 4)
      throw new EncodingError(
        `the encoded delta stays above the clip norm ${clipNorm}`,
        'ask the operator for the fp32 encoding',
      );
    encoded = shrink(encoded, encoding, clipNorm / deltaNorm(decoded));
    decoded = decodeDelta(encoded.tensors, encoded.metadata, encoding);
  }
  return { ...encoded, residual: mapValues(total, (value, name, i) => value - decoded[name].data[i]) };
}

/**
 * Float deltas -> the tensors of an `encoding` payload and its metadata ({encoding: label}); int8-sr draws from rng.
 * @param {Delta} delta
 * @param {Encoding} encoding
 * @param {(() => number) | null} [rng]
 * @returns {Encoded}
 */
export function encodeDelta(delta, encoding, rng = null) {
  if (encoding.stochastic && !rng) throw new EncodingError('stochastic rounding needs a random generator', 'pass one');
  /** @type {Tensors} */
  const tensors = {};
  for (const name of Object.keys(delta).sort()) {
    const { shape, data } = delta[name];
    if (encoding.name === 'fp32') tensors[name] = { dtype: 'float32', shape, data: Float32Array.from(data) };
    else if (encoding.name === 'fp16') tensors[name] = { dtype: 'float16', shape, data: toHalf(name, data) };
    else Object.assign(tensors, quantize(name, shape, data, encoding, rng));
  }
  return { tensors, metadata: { encoding: encoding.label } };
}

/**
 * An encoded payload's tensors back to float32 {name: {shape, data}}, refusing any encoding but `encoding`.
 * @param {Tensors} tensors
 * @param {Record<string, string> | null} metadata
 * @param {Encoding} encoding
 * @returns {Delta}
 */
export function decodeDelta(tensors, metadata, encoding, what = 'the payload') {
  const sent = metadata && metadata.encoding;
  if (sent !== encoding.label) {
    throw new EncodingError(
      `${what} is encoded as ${JSON.stringify(sent ?? 'nothing')}, not ${encoding.label} as this round asked`,
      'ask the operator to check the server',
    );
  }
  const wire = /** @type {Record<string, string>} */ ({ fp32: 'float32', fp16: 'float16', int8: 'int8' })[
    encoding.name
  ];
  /** @type {Delta} */
  const decoded = {};
  for (const [name, t] of Object.entries(tensors)) {
    if (name.endsWith(SCALE_SUFFIX)) continue;
    if (t.dtype !== wire)
      throw new EncodingError(
        `${what} tensor ${JSON.stringify(name)} is ${t.dtype}, not ${wire}`,
        'ask the operator to check the server',
      );
    let data;
    if (encoding.name === 'fp32') data = Float32Array.from(/** @type {Float32Array} */ (t.data));
    else if (encoding.name === 'fp16') data = Float32Array.from(/** @type {Uint16Array} */ (t.data), halfToNumber);
    else data = dequantize(name, /** @type {Int8Array} */ (t.data), tensors[name + SCALE_SUFFIX], encoding, what);
    decoded[name] = { shape: t.shape.slice(), data };
  }
  return decoded;
}

/**
 * A round's base bytes decoded as its settings' download_encoding: plain safetensors for fp32, else fp16 only.
 * @param {Uint8Array} bytes
 * @param {string | undefined} label
 * @param {string} what
 * @returns {Tensors}
 */
export function decodeDownload(bytes, label, what) {
  const { tensors, metadata } = decodeSafetensors(bytes, what);
  if ((label || 'fp32') === 'fp32') return tensors;
  const decoded = decodeDelta(tensors, metadata, parseEncoding(label), what);
  return Object.fromEntries(
    Object.entries(decoded).map(([name, t]) => [name, { dtype: 'float32', shape: t.shape, data: t.data }]),
  );
}

/** The float16 bits (round to nearest even, as numpy's astype) of float32 values; beyond ±65504 is an error. */
export function toHalf(/** @type {string} */ name, /** @type {Float32Array} */ data) {
  const bits = new Uint16Array(data.length);
  for (let i = 0; i < data.length; i++) {
    if (Math.abs(data[i]) > FP16_MAX)
      throw new EncodingError(
        `tensor ${JSON.stringify(name)} has a value beyond fp16's range (±${FP16_MAX})`,
        'lower the learning rate, or ask for the fp32 or int8 encoding',
      );
    bits[i] = halfBits(data[i]);
  }
  return bits;
}

const F32 = new Float32Array(1);
const U32 = new Uint32Array(F32.buffer);

/** IEEE half bits of a number, rounded to nearest even through float32 (numpy's float32 -> float16 cast). */
export function halfBits(/** @type {number} */ value) {
  F32[0] = value;
  const x = U32[0];
  const sign = (x >>> 16) & 0x8000;
  const exponent = (x >>> 23) & 0xff;
  const mantissa = x & 0x7fffff;
  if (exponent === 0xff) return sign | 0x7c00 | (mantissa ? 0x200 : 0);
  const e = exponent - 112; // rebias 127 -> 15
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    // a half subnormal (or zero): the 24-bit significand shifted right by 14 - e
    if (e < -10) return sign;
    const full = mantissa | 0x800000;
    const shift = 14 - e;
    return sign | roundShift(full, shift);
  }
  return sign | ((e << 10) + roundShift(mantissa, 13)); // a carry into the exponent is the right rounding
}

function roundShift(/** @type {number} */ value, /** @type {number} */ shift) {
  const kept = Math.floor(value / 2 ** shift);
  const rest = value - kept * 2 ** shift;
  const half = 2 ** (shift - 1);
  return rest > half || (rest === half && kept % 2 === 1) ? kept + 1 : kept;
}

/** The number a half's bits stand for. */
export function halfToNumber(/** @type {number} */ bits) {
  const exponent = (bits >> 10) & 0x1f;
  const fraction = bits & 0x3ff;
  const sign = bits & 0x8000 ? -1 : 1;
  if (exponent === 0) return sign * fraction * 2 ** -24;
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
}

/** A generator of uniform doubles in [0, 1) seeded like numpy.random.default_rng(entropy) (Generator.random). */
export function uniformRandom(/** @type {number | number[]} */ entropy) {
  const rng = new PCG64(entropy);
  return () => Number(rng.next64() >> 11n) * 2 ** -53;
}

/**
 * @param {string} name
 * @param {number[]} shape
 * @param {Float32Array} data
 * @param {Encoding} encoding
 * @param {(() => number) | null} rng
 * @returns {Tensors}
 */
function quantize(name, shape, data, encoding, rng) {
  const n = data.length;
  const block = encoding.blockSize || Math.max(n, 1);
  const blocks = Math.max(Math.ceil(n / block), 1);
  const scale = new Float32Array(blocks);
  for (let b = 0; b < blocks; b++) {
    let peak = 0;
    for (let i = b * block; i < Math.min(n, (b + 1) * block); i++) peak = Math.max(peak, Math.abs(data[i]));
    scale[b] = peak / 127; // quantized with the float32 scale the server reads, so the bound holds for what it decodes
  }
  const values = new Int8Array(n);
  for (let i = 0; i < n; i++) {
    const s = scale[Math.floor(i / block)];
    const ratio = s > 0 ? data[i] / s : 0;
    const rounded = rng && encoding.stochastic ? Math.floor(ratio + rng()) : roundHalfEven(ratio);
    values[i] = Math.max(-127, Math.min(127, rounded));
  }
  return {
    [name]: { dtype: 'int8', shape, data: values },
    [name + SCALE_SUFFIX]: { dtype: 'float32', shape: [blocks], data: scale },
  };
}

/**
 * @param {string} name
 * @param {Int8Array} values
 * @param {Tensor | undefined} scale
 * @param {Encoding} encoding
 * @param {string} what
 */
function dequantize(name, values, scale, encoding, what) {
  const block = encoding.blockSize || Math.max(values.length, 1);
  const blocks = Math.max(Math.ceil(values.length / block), 1);
  if (!scale || scale.dtype !== 'float32' || scale.data.length !== blocks) {
    throw new EncodingError(
      `${what} lacks a float32[${blocks}] scale for ${JSON.stringify(name)}`,
      'ask the operator to check the server',
    );
  }
  const scales = /** @type {Float32Array} */ (scale.data);
  const out = new Float32Array(values.length);
  for (let i = 0; i < values.length; i++) out[i] = values[i] * scales[Math.floor(i / block)];
  return out;
}

/** @returns {Encoded} */
function shrink(/** @type {Encoded} */ encoded, /** @type {Encoding} */ encoding, /** @type {number} */ factor) {
  // margins cover one rounding of each decoded value: fp16 2**-11, float32 2**-24 (twice for int8)
  const f = factor * (encoding.name === 'fp16' ? 1 - 2 ** -9 : 1 - 2 ** -20);
  /** @type {Tensors} */
  const tensors = {};
  for (const [name, t] of Object.entries(encoded.tensors)) {
    let data = t.data;
    const floats = /** @type {Float32Array} */ (t.data);
    if (encoding.name === 'int8' && name.endsWith(SCALE_SUFFIX)) data = floats.map((s) => s * f);
    else if (encoding.name === 'fp16')
      data = /** @type {Uint16Array} */ (t.data).map((bits) => halfBits(halfToNumber(bits) * f));
    else if (encoding.name === 'fp32') data = floats.map((value) => value * f);
    tensors[name] = { ...t, data };
  }
  return { tensors, metadata: encoded.metadata };
}

function roundHalfEven(/** @type {number} */ x) {
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 ? 2 * Math.round(x / 2) : r;
}

/**
 * Each value of each tensor through `f(value, name, index)`, as float32 deltas.
 * @param {Delta} tensors
 * @param {(value: number, name: string, index: number) => number} f
 * @returns {Delta}
 */
function mapValues(tensors, f) {
  /** @type {Delta} */
  const out = {};
  for (const [name, t] of Object.entries(tensors)) {
    const data = new Float32Array(t.data.length);
    for (let i = 0; i < data.length; i++) data[i] = f(t.data[i], name, i);
    out[name] = { shape: t.shape.slice(), data };
  }
  return out;
}
