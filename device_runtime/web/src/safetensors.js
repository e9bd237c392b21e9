// @ts-check
// The safetensors codec of the browser device: the same files Python's `safetensors` reads and writes.
//
// A tensor is {dtype, shape, data}: dtype a numpy-style name ('float32', 'int64', ...), shape an array of
// non-negative integers, data a TypedArray of that dtype (float16/bfloat16 as raw Uint16Array bits).
// Decoding copies every tensor out of the payload, so results are aligned and own their memory.

import { DeviceError, describe } from './errors.js';

/** @typedef {Float64Array | Float32Array | Uint16Array | BigInt64Array | BigUint64Array | Int32Array | Uint32Array | Int16Array | Int8Array | Uint8Array} TypedArray */
/** @typedef {Float64ArrayConstructor | Float32ArrayConstructor | Uint16ArrayConstructor | BigInt64ArrayConstructor | BigUint64ArrayConstructor | Int32ArrayConstructor | Uint32ArrayConstructor | Int16ArrayConstructor | Int8ArrayConstructor | Uint8ArrayConstructor} TypedArrayConstructor */
/** A tensor: a numpy-style dtype name, its shape, its values. @typedef {{dtype: string, shape: number[], data: TypedArray}} Tensor */
/** @typedef {Record<string, Tensor>} Tensors */

/** @type {Record<string, [string, TypedArrayConstructor]>} */
const DTYPES = {
  F64: ['float64', Float64Array],
  F32: ['float32', Float32Array],
  F16: ['float16', Uint16Array],
  BF16: ['bfloat16', Uint16Array],
  I64: ['int64', BigInt64Array],
  U64: ['uint64', BigUint64Array],
  I32: ['int32', Int32Array],
  U32: ['uint32', Uint32Array],
  I16: ['int16', Int16Array],
  U16: ['uint16', Uint16Array],
  I8: ['int8', Int8Array],
  U8: ['uint8', Uint8Array],
  BOOL: ['bool', Uint8Array],
};
const CODE_OF = Object.fromEntries(Object.entries(DTYPES).map(([code, [name]]) => [name, code]));
const MAX_HEADER = 100 * 1024 * 1024; // Python's safetensors refuses larger headers too

if (new Uint8Array(new Uint16Array([1]).buffer)[0] !== 1) {
  throw new Error('safetensors: this platform is big-endian; the codec reads little-endian bytes in place');
}

/** A file that is not valid safetensors, or tensors that cannot be written as one. */
export class SafetensorsError extends DeviceError {}

/** The TypedArray constructor of a numpy-style dtype name ('float32', ...); throws for unknown names. */
export function typedArrayOf(/** @type {string} */ dtype) {
  const code = CODE_OF[dtype];
  if (!code)
    throw new SafetensorsError(
      `unknown dtype ${JSON.stringify(dtype)}`,
      `use one of ${Object.keys(CODE_OF).join(', ')}`,
    );
  return DTYPES[code][1];
}

/** Number of elements of a shape (1 for a scalar). */
export function numel(/** @type {readonly number[]} */ shape) {
  return shape.reduce((a, b) => a * b, 1);
}

/**
 * Encode {name: tensor} (+ optional string metadata) into safetensors bytes, laid out like Python writes them.
 * @param {Tensors} tensors
 * @param {Record<string, string> | null} [metadata]
 */
export function encodeSafetensors(tensors, metadata = null) {
  const entries = Object.entries(tensors).map(([name, t]) => {
    if (name === '__metadata__') throw new SafetensorsError('a tensor is named __metadata__', 'rename the tensor');
    const code = CODE_OF[t.dtype];
    if (!code)
      throw new SafetensorsError(
        `tensor ${JSON.stringify(name)} has unknown dtype ${JSON.stringify(t.dtype)}`,
        `use one of ${Object.keys(CODE_OF).join(', ')}`,
      );
    checkShape(t.shape, name);
    if (!(t.data instanceof DTYPES[code][1]) || t.data.length !== numel(t.shape)) {
      throw new SafetensorsError(
        `tensor ${JSON.stringify(name)} data is not a ${DTYPES[code][1].name} of ${numel(t.shape)} elements`,
        'pass data matching dtype and shape',
      );
    }
    return { name, code, tensor: t };
  });
  // Python's safetensors orders tensors by dtype alignment (largest first), then by name
  entries.sort(
    (a, b) =>
      DTYPES[b.code][1].BYTES_PER_ELEMENT - DTYPES[a.code][1].BYTES_PER_ELEMENT ||
      (a.name < b.name ? -1 : a.name > b.name ? 1 : 0),
  );
  /** @type {Record<string, unknown>} */
  const header = {};
  if (metadata) {
    for (const [k, v] of Object.entries(metadata)) {
      if (typeof v !== 'string')
        throw new SafetensorsError(
          `metadata ${JSON.stringify(k)} is not a string`,
          'convert metadata values with String()',
        );
    }
    header.__metadata__ = metadata;
  }
  let offset = 0;
  for (const { name, code, tensor } of entries) {
    const size = tensor.data.byteLength;
    header[name] = { dtype: code, shape: tensor.shape, data_offsets: [offset, offset + size] };
    offset += size;
  }
  const headerBytes = new TextEncoder().encode(JSON.stringify(header));
  const padded = Math.ceil(headerBytes.length / 8) * 8; // data starts 8-byte aligned, padded with spaces
  const out = new Uint8Array(8 + padded + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(padded), true);
  out.fill(0x20, 8, 8 + padded);
  out.set(headerBytes, 8);
  let at = 8 + padded;
  for (const { tensor } of entries) {
    out.set(new Uint8Array(tensor.data.buffer, tensor.data.byteOffset, tensor.data.byteLength), at);
    at += tensor.data.byteLength;
  }
  return out;
}

/**
 * Decode safetensors bytes into {tensors: {name: tensor}, metadata: {..}|null}; a malformed file throws SafetensorsError.
 * @param {Uint8Array | ArrayBuffer} input
 * @returns {{tensors: Tensors, metadata: Record<string, string> | null}}
 */
export function decodeSafetensors(input, what = 'safetensors file') {
  const bytes = input instanceof Uint8Array ? input : new Uint8Array(input);
  const bad = (/** @type {string} */ problem) =>
    new SafetensorsError(`${what}: ${problem}`, 'download the file again; it is not a valid safetensors file');
  if (bytes.length < 8) throw bad(`only ${bytes.length} bytes`);
  const headerLength = new DataView(bytes.buffer, bytes.byteOffset, 8).getBigUint64(0, true);
  if (headerLength > BigInt(Math.min(MAX_HEADER, bytes.length - 8)))
    throw bad(`header length ${headerLength} exceeds the file`);
  const headerText = new TextDecoder('utf-8', { fatal: false }).decode(bytes.subarray(8, 8 + Number(headerLength)));
  let header;
  try {
    header = JSON.parse(headerText);
  } catch (err) {
    throw bad(`header is not JSON (${describe(err)})`);
  }
  if (header === null || typeof header !== 'object' || Array.isArray(header)) throw bad('header is not a JSON object');
  const duplicate = firstDuplicateKey(headerText);
  if (duplicate !== null) throw bad(`tensor ${JSON.stringify(duplicate)} appears twice in the header`);
  const dataStart = 8 + Number(headerLength);
  const dataLength = bytes.length - dataStart;
  /** @type {Record<string, string> | null} */
  let metadata = null;
  const spans = [];
  for (const [name, entry] of Object.entries(header)) {
    if (name === '__metadata__') {
      if (
        entry === null ||
        typeof entry !== 'object' ||
        Array.isArray(entry) ||
        Object.values(entry).some((v) => typeof v !== 'string')
      ) {
        throw bad('__metadata__ is not a map of strings');
      }
      metadata = entry;
      continue;
    }
    if (entry === null || typeof entry !== 'object' || !DTYPES[entry.dtype])
      throw bad(`tensor ${JSON.stringify(name)} has an unknown dtype`);
    try {
      checkShape(entry.shape, name);
    } catch (err) {
      throw bad(describe(err));
    }
    const offsets = entry.data_offsets;
    if (
      !Array.isArray(offsets) ||
      offsets.length !== 2 ||
      !offsets.every((o) => Number.isSafeInteger(o) && o >= 0) ||
      offsets[0] > offsets[1]
    ) {
      throw bad(`tensor ${JSON.stringify(name)} has bad data_offsets`);
    }
    if (offsets[1] > dataLength) throw bad(`tensor ${JSON.stringify(name)} lies beyond the end of the file`);
    const Typed = DTYPES[entry.dtype][1];
    if (offsets[1] - offsets[0] !== numel(entry.shape) * Typed.BYTES_PER_ELEMENT) {
      throw bad(`tensor ${JSON.stringify(name)} has ${offsets[1] - offsets[0]} bytes for shape [${entry.shape}]`);
    }
    spans.push({ name, entry, start: offsets[0], end: offsets[1] });
  }
  spans.sort((a, b) => a.start - b.start || a.end - b.end);
  let expected = 0;
  for (const span of spans) {
    if (span.start < expected) throw bad(`tensor ${JSON.stringify(span.name)} overlaps another tensor`);
    if (span.start > expected) throw bad(`the file has unused bytes before tensor ${JSON.stringify(span.name)}`);
    expected = span.end;
  }
  if (expected !== dataLength) throw bad(`${dataLength - expected} trailing bytes after the last tensor`);
  /** @type {Tensors} */
  const tensors = {};
  for (const name of Object.keys(header)) {
    if (name === '__metadata__') continue;
    const entry = header[name];
    const [dtype, Typed] = DTYPES[entry.dtype];
    const raw = bytes.slice(dataStart + entry.data_offsets[0], dataStart + entry.data_offsets[1]);
    tensors[name] = { dtype, shape: entry.shape.slice(), data: new Typed(raw.buffer, 0, numel(entry.shape)) };
  }
  return { tensors, metadata };
}

function checkShape(/** @type {unknown} */ shape, /** @type {string} */ name) {
  if (!Array.isArray(shape) || !shape.every((d) => Number.isSafeInteger(d) && d >= 0)) {
    throw new SafetensorsError(
      `tensor ${JSON.stringify(name)} has a bad shape ${JSON.stringify(shape)}`,
      'use an array of non-negative integers',
    );
  }
}

/** The first key that appears twice at the top level of a JSON object text, or null (JSON.parse keeps the last). */
function firstDuplicateKey(/** @type {string} */ text) {
  const seen = new Set();
  let depth = 0;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (c === '{' || c === '[') depth++;
    else if (c === '}' || c === ']') depth--;
    else if (c === '"') {
      let j = i + 1;
      while (text[j] !== '"') j += text[j] === '\\' ? 2 : 1;
      if (depth === 1) {
        let k = j + 1;
        while (/\s/.test(text[k])) k++;
        if (text[k] === ':') {
          const key = JSON.parse(text.slice(i, j + 1));
          if (seen.has(key)) return key;
          seen.add(key);
        }
      }
      i = j;
    }
  }
  return null;
}
