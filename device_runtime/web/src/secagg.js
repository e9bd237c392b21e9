// @ts-check
// The browser device's side of secure aggregation (SecAgg+ / SecAgg with double masking), as edgepfl/secagg
// specifies it: X25519 key pairs, HKDF-SHA256 with round-bound info strings, AES-GCM for the shares in transit,
// AES-256-CTR masks bit for bit those of edgepfl/secagg/ring.py, Shamir shares over GF(2^256 + 297) that the
// Python server reconstructs, the quantizer of edgepfl/secagg/quantize.py (same integers for the same seeds),
// and the client state machine with JSON state that Python's ClientSession reads as well.
// Only WebCrypto (crypto.subtle: https pages and localhost) and BigInt; no other dependency.

import { clipDelta, uniformRandom } from './encoding.js';

export { uniformRandom };

const VERSION = 'edgepfl-secagg-v1';
export const PRIME = (1n << 256n) + 297n;
const SECRET_BYTES = 32;
const SHARE_BYTES = 33;
const NONCE_BYTES = 12;
const TAG_BYTES = 16;
export const SEALED_BYTES = NONCE_BYTES + 2 * SHARE_BYTES + TAG_BYTES;
const MIN_BITS = 8;
const INT8_LEVELS = 127;
const ROTATION_BLOCK = 1024;
const PARALLEL_MASKS = 8; // partner masks expanded at once: 8 vectors of 4 bytes per value in memory
const NAME = /^[!-~]{1,200}$/;
const PKCS8_X25519 = Uint8Array.from([0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x6e, 0x04, 0x22, 0x04, 0x20]);
const LITTLE_ENDIAN = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;
const encoder = new TextEncoder();

/**
 * @typedef {{device: string, cipher_key: Uint8Array, mask_key: Uint8Array}} KeyAdvert
 * @typedef {{devices: number, neighbours: number, threshold: number, min_survivors: number, bits: number}} Plan
 * @typedef {{clip_norm: number, threshold: number, neighbours: number|string, dropout: number|null,
 *   collusion: number|null, bits: number|null, max_weight: number, coordinate_sigmas: number,
 *   weight_scale?: number|null}} SecAggConfig
 * @typedef {{context: string, config: SecAggConfig, randomness: Uint8Array, adverts: KeyAdvert[], plan: Plan,
 *   base_size: number}} KeyBook
 * @typedef {{device: string, sealed: Record<string, Uint8Array>}} ShareBundle  also a ShareInbox
 * @typedef {{device: string, masked: Uint8Array}} MaskedInput
 * @typedef {{survivors: string[], dropped: string[]}} UnmaskRequest
 * @typedef {{device: string, seed_shares: Record<string, Uint8Array>, key_shares: Record<string, Uint8Array>}} UnmaskShares
 * @typedef {(count: number) => Uint8Array} RandomBytes
 * @typedef {{shape: number[], data: Float32Array}} Tensor
 */

/** A message or state that breaks the protocol; `fix` says what to do. Nothing held is lost. */
export class SecAggError extends Error {
  /** @param {string} problem @param {string} fix */
  constructor(problem, fix) {
    super(`${problem} (${fix})`);
    this.name = 'SecAggError';
    this.problem = problem;
    this.fix = fix;
  }
}

/** @returns {SubtleCrypto} */
function subtle() {
  if (!globalThis.crypto?.subtle) throw new SecAggError('secure aggregation needs WebCrypto, which browsers offer only on https pages (and localhost)', 'open the page over https');
  return globalThis.crypto.subtle;
}

/** @type {RandomBytes} */
export function systemRandomBytes(count) {
  return globalThis.crypto.getRandomValues(new Uint8Array(count));
}

// ---- bytes, base64, hashing -------------------------------------------------------------------------------

/** @param {Uint8Array} bytes */
export function b64(bytes) {
  let text = '';
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

/** @param {unknown} text @param {string} what @param {number|null} [length] */
export function unb64(text, what, length = null) {
  let bytes;
  try {
    if (typeof text !== 'string' || !/^[A-Za-z0-9+/]*={0,2}$/.test(text) || text.length % 4) throw new Error('bad');
    bytes = Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
  } catch {
    throw new SecAggError(`${what} is not base64 text`, 'send bytes as standard base64');
  }
  if (length !== null && bytes.length !== length) throw new SecAggError(`${what} has ${bytes.length} bytes, not ${length}`, `send ${length} bytes`);
  return bytes;
}

/** @param {...Uint8Array} parts */
function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let offset = 0;
  for (const part of parts) {
    out.set(part, offset);
    offset += part.length;
  }
  return out;
}

/** @param {Uint8Array} a @param {Uint8Array} b */
function equalBytes(a, b) {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}

/** Each part as 2-byte big-endian length + bytes (strings as UTF-8). @param {(string|Uint8Array)[]} parts */
function lengthPrefixed(parts) {
  return concat(...parts.flatMap((part) => {
    const bytes = typeof part === 'string' ? encoder.encode(part) : part;
    return [Uint8Array.from([bytes.length >> 8, bytes.length & 0xff]), bytes];
  }));
}

/**
 * Bytes as WebCrypto's BufferSource: TypeScript's DOM types take only views of an ArrayBuffer, never a
 * SharedArrayBuffer, and every array here is made over an ArrayBuffer.
 * @param {Uint8Array} bytes @returns {Uint8Array<ArrayBuffer>}
 */
function buffer(bytes) {
  return /** @type {Uint8Array<ArrayBuffer>} */ (bytes);
}

/** @param {Uint8Array} bytes */
async function sha256(bytes) {
  return new Uint8Array(await subtle().digest('SHA-256', buffer(bytes)));
}

/** @param {Uint8Array} bytes */
function hex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}

// ---- keys: X25519, HKDF, AES-GCM (keys.py) ----------------------------------------------------------------

/** The HKDF info and AES-GCM associated data of a purpose, round and devices. @param {string} purpose @param {string} context @param {...string} parties */
export function info(purpose, context, ...parties) {
  return lengthPrefixed([VERSION, purpose, context, ...parties]);
}

/** HKDF-SHA256 of a secret to 32 bytes bound to purpose, context and devices. @param {Uint8Array} secret @param {string} purpose @param {string} context @param {...string} parties */
export async function derive(secret, purpose, context, ...parties) {
  const key = await subtle().importKey('raw', buffer(secret), 'HKDF', false, ['deriveBits']);
  const salt = await sha256(encoder.encode(VERSION));
  return new Uint8Array(await subtle().deriveBits({ name: 'HKDF', hash: 'SHA-256', salt, info: info(purpose, context, ...parties) }, key, 256));
}

/** @param {Uint8Array} privateKey */
async function importPrivate(privateKey, extractable = false) {
  return subtle().importKey('pkcs8', buffer(concat(PKCS8_X25519, privateKey)), { name: 'X25519' }, extractable, ['deriveBits']);
}

/** The raw X25519 public key of 32 raw private-key bytes. @param {Uint8Array} privateKey */
export async function publicKey(privateKey) {
  const jwk = await subtle().exportKey('jwk', await importPrivate(privateKey, true));
  return unb64(String(jwk.x).replace(/-/g, '+').replace(/_/g, '/').padEnd(44, '='), 'public key', 32);
}

/** X25519 shared secret; a malformed or low-order peer key is one SecAggError. @param {Uint8Array} privateKey @param {Uint8Array} peerKey @param {string} peer */
export async function agree(privateKey, peerKey, peer) {
  try {
    const publicKey = await subtle().importKey('raw', buffer(peerKey), { name: 'X25519' }, false, []);
    return new Uint8Array(await subtle().deriveBits({ name: 'X25519', public: publicKey }, await importPrivate(privateKey), 256));
  } catch {
    throw new SecAggError(`device ${JSON.stringify(peer)} advertised a malformed or low-order X25519 public key`, 'advertise a key made by X25519 key generation');
  }
}

/** AES-256-GCM: random nonce || ciphertext || tag. @param {Uint8Array} key @param {Uint8Array} plaintext @param {Uint8Array} associated @param {RandomBytes} randomBytes */
export async function encrypt(key, plaintext, associated, randomBytes) {
  const nonce = randomBytes(NONCE_BYTES);
  const aes = await subtle().importKey('raw', buffer(key), 'AES-GCM', false, ['encrypt']);
  return concat(nonce, new Uint8Array(await subtle().encrypt({ name: 'AES-GCM', iv: buffer(nonce), additionalData: buffer(associated) }, aes, buffer(plaintext))));
}

/** @param {Uint8Array} key @param {Uint8Array} sealed @param {Uint8Array} associated @param {string} what */
export async function decrypt(key, sealed, associated, what) {
  try {
    const aes = await subtle().importKey('raw', buffer(key), 'AES-GCM', false, ['decrypt']);
    return new Uint8Array(await subtle().decrypt({ name: 'AES-GCM', iv: buffer(sealed.subarray(0, NONCE_BYTES)), additionalData: buffer(associated) }, aes, buffer(sealed.subarray(NONCE_BYTES))));
  } catch {
    throw new SecAggError(`${what} does not decrypt (wrong key, sender, recipient or round, or altered in transit)`, 'the server must route each device\'s shares unchanged');
  }
}

// ---- the ring and its masks (ring.py) ---------------------------------------------------------------------

/** `length` ring elements < 2^bits: AES-256-CTR keystream of the seed from a zero 128-bit counter, little-endian words. @param {Uint8Array} seed @param {number} length */
export async function maskVector(seed, length, bits = 32) {
  if (seed.length !== 32) throw new SecAggError(`a mask seed has ${seed.length} bytes, not 32`, 'derive seeds with HKDF-SHA256');
  const key = await subtle().importKey('raw', buffer(seed), 'AES-CTR', false, ['encrypt']);
  const stream = await subtle().encrypt({ name: 'AES-CTR', counter: new Uint8Array(16), length: 128 }, key, new Uint8Array(4 * length));
  let words;
  if (LITTLE_ENDIAN) words = new Uint32Array(stream);
  else {
    const view = new DataView(stream);
    words = Uint32Array.from({ length }, (_, i) => view.getUint32(4 * i, true));
  }
  if (bits < 32) {
    const mask = 2 ** bits - 1;
    for (let i = 0; i < length; i++) words[i] &= mask;
  }
  return words;
}

/** Ring elements packed at `bits` bits each, least significant bit first (ring.py pack). @param {Uint32Array} values @param {number} bits */
export function pack(values, bits) {
  const out = new Uint8Array(Math.ceil((values.length * bits) / 8));
  let acc = 0, held = 0, pos = 0;
  for (let i = 0; i < values.length; i++) {
    acc += values[i] * 2 ** held;
    held += bits;
    while (held >= 8) {
      out[pos++] = acc % 256;
      acc = Math.floor(acc / 256);
      held -= 8;
    }
  }
  if (held > 0) out[pos] = acc;
  return out;
}

/** The inverse of `pack`. @param {Uint8Array} payload @param {number} length @param {number} bits */
export function unpack(payload, length, bits) {
  const out = new Uint32Array(length);
  let acc = 0, held = 0, pos = 0;
  for (let i = 0; i < length; i++) {
    while (held < bits) {
      acc += payload[pos++] * 2 ** held;
      held += 8;
    }
    out[i] = acc % 2 ** bits;
    acc = Math.floor(acc / 2 ** bits);
    held -= bits;
  }
  return out;
}

// ---- Shamir (shamir.py) -----------------------------------------------------------------------------------

/** @param {Uint8Array} bytes */
function toBigInt(bytes) {
  return bytes.length ? BigInt(`0x${hex(bytes)}`) : 0n;
}

/** @param {bigint} value @param {number} length */
function fromBigInt(value, length) {
  const text = value.toString(16).padStart(2 * length, '0');
  return Uint8Array.from({ length }, (_, i) => parseInt(text.slice(2 * i, 2 * i + 2), 16));
}

/** Shares {holder index: 33 bytes} of a 32-byte secret; any `threshold` of them give it back. @param {Uint8Array} secret @param {number[]} holders @param {number} threshold @param {RandomBytes} randomBytes */
export function shamirSplit(secret, holders, threshold, randomBytes) {
  if (secret.length !== SECRET_BYTES) throw new SecAggError(`a shared secret has ${secret.length} bytes, not 32`, 'share 32-byte secrets');
  if (!(threshold >= 1 && threshold <= holders.length) || new Set(holders).size !== holders.length || Math.min(...holders) < 1) {
    throw new SecAggError(`cannot share among ${holders.length} holders with threshold ${threshold}`, 'use distinct indices from 1');
  }
  const coefficients = [toBigInt(secret)];
  for (let j = 1; j < threshold; j++) coefficients.push(toBigInt(randomBytes(SECRET_BYTES)));
  /** @type {Record<number, Uint8Array>} */
  const shares = {};
  for (const x of holders) {
    let value = 0n;
    for (let j = coefficients.length - 1; j >= 0; j--) value = (value * BigInt(x) + coefficients[j]) % PRIME;
    shares[x] = fromBigInt(value, SHARE_BYTES);
  }
  return shares;
}

// ---- the plan and the graph (config.py, graph.py) ---------------------------------------------------------

/** @param {number} n */
function bitLength(n) {
  return n > 0 ? Math.floor(Math.log2(n)) + 1 : 0;
}

/** q: each value quantizes to [-q, q]. @param {number} devices @param {number} bits */
export function levels(devices, bits) {
  const q = Math.floor((2 ** (bits - 1) - 1) / devices);
  if (q < 1) throw new SecAggError(`a ring of ${bits} bits cannot sum ${devices} devices`, 'ask the operator for more bits');
  return q;
}

/** [base, count] of the weight's digits. @param {number} devices @param {number} bits @param {number} maxWeight */
export function weightDigits(devices, bits, maxWeight) {
  const base = Math.floor((2 ** bits - 1) / devices) + 1;
  let count = 1;
  while (base ** count <= maxWeight) count++;
  return [base, count];
}

/** @param {number} size */
export function rotationBlock(size) {
  return Math.min(ROTATION_BLOCK, 2 ** bitLength(Math.max(size - 1, 0)));
}

/** @param {number} size */
export function paddedSize(size) {
  return Math.ceil(size / rotationBlock(size)) * rotationBlock(size);
}

/** Ring elements of a masked vector. @param {KeyBook} book */
export function vectorLength(book) {
  return paddedSize(book.base_size) + weightDigits(book.plan.devices, book.plan.bits, book.config.max_weight)[1];
}

/** A device's check that the server's plan follows from its settings (config.py check_plan). @param {KeyBook} book */
export function checkPlan(book) {
  const { plan, config } = book;
  const n = plan.devices, k = plan.neighbours;
  let ok = k === n - 1 || (k % 2 === 0 && k >= 2 && k < n - 2);
  if (config.neighbours === 'all' && k !== n - 1) ok = false;
  const t = Math.max(2, Math.ceil(config.threshold * (k + 1)));
  const bits = config.bits ?? Math.max(MIN_BITS, 1 + bitLength(INT8_LEVELS * n));
  if (!ok || plan.threshold !== t || plan.min_survivors !== Math.max(t, Math.ceil(config.threshold * n)) || plan.bits !== bits || n !== book.adverts.length) {
    throw new SecAggError(`the server's plan ${JSON.stringify(plan)} does not follow from its settings`, 'the server must send a consistent key book');
  }
  levels(n, bits);
}

/** The public seed of the graph and the rotation (graph.py graph_seed). @param {KeyBook} book */
export async function graphSeed(book) {
  const parts = book.adverts.map((a) => concat(lengthPrefixed([a.device]), a.cipher_key, a.mask_key));
  return derive(await sha256(concat(book.randomness, ...parts)), 'graph', book.context);
}

/** Each device's neighbours (sorted): k/2 either side on the seeded ring; k >= n - 1 joins every pair. @param {string[]} devices @param {Uint8Array} seed @param {number} k */
export async function neighbourMap(devices, seed, k) {
  const n = devices.length;
  /** @type {Record<string, string[]>} */
  const graph = {};
  if (k >= n - 1) {
    for (const d of devices) graph[d] = devices.filter((o) => o !== d).sort(compareIds);
    return graph;
  }
  const keyed = await Promise.all(devices.map(async (d) => ({ d, key: await sha256(concat(seed, encoder.encode(d))) })));
  keyed.sort((a, b) => compareBytes(a.key, b.key) || compareIds(a.d, b.d));
  const order = keyed.map((e) => e.d);
  const half = k / 2;
  order.forEach((d, position) => {
    const near = [];
    for (let step = -half; step <= half; step++) if (step) near.push(order[(((position + step) % n) + n) % n]);
    graph[d] = near.sort(compareIds);
  });
  return graph;
}

/** @param {string} a @param {string} b */
function compareIds(a, b) {
  return a < b ? -1 : a > b ? 1 : 0;
}

/** @param {Uint8Array} a @param {Uint8Array} b */
function compareBytes(a, b) {
  for (let i = 0; i < Math.min(a.length, b.length); i++) if (a[i] !== b[i]) return a[i] - b[i];
  return a.length - b.length;
}

// ---- the quantizer (quantize.py) --------------------------------------------------------------------------

/** Walsh-Hadamard per block, orthonormal, butterflies (a + b, a - b) in quantize.py's order. @param {Float64Array} values @param {number} block */
function hadamard(values, block) {
  for (let start = 0; start < values.length; start += block) {
    for (let half = 1; half < block; half *= 2) {
      for (let i = start; i < start + block; i += 2 * half) {
        for (let j = i; j < i + half; j++) {
          const a = values[j], b = values[j + half];
          values[j] = a + b;
          values[j + half] = a - b;
        }
      }
    }
  }
  const root = Math.sqrt(block);
  for (let i = 0; i < values.length; i++) values[i] /= root;
}

/** The seeded rotation of the slots: permute, flip signs, Hadamard per block. @param {Float64Array} slots @param {number} block @param {Uint8Array} seed */
export async function rotate(slots, block, seed) {
  const length = slots.length;
  const indexBits = Math.max(1, bitLength(length - 1));
  const keyBits = Math.min(32, 53 - indexBits); // key * 2^indexBits + index stays exact in a float64
  const words = await maskVector(await derive(seed, 'rotation-permutation', ''), length);
  const composite = new Float64Array(length);
  for (let i = 0; i < length; i++) composite[i] = Math.floor(words[i] / 2 ** (32 - keyBits)) * 2 ** indexBits + i;
  composite.sort();
  const signs = await maskVector(await derive(seed, 'rotation-signs', ''), length);
  const out = new Float64Array(length);
  for (let i = 0; i < length; i++) out[i] = slots[composite[i] % 2 ** indexBits] * (1 - 2 * (signs[i] & 1));
  hadamard(out, block);
  return out;
}

/**
 * A device's ring vector of its base delta ({name: {shape, data}}) and sample count: clip to C, scale by w / W,
 * rotate, round to [-q, q] (stochastically with `rng`, numpy's Generator.random stream via uniformRandom; to
 * nearest without), then the weight's digits. The same integers as quantize.py's quantize_delta.
 * @param {Record<string, Tensor>} delta @param {number} weight @param {KeyBook} book @param {(() => number)|null} rng
 */
export async function quantizeDelta(delta, weight, book, rng = null) {
  const { config, plan } = book;
  const names = Object.keys(delta).sort(compareIds);
  const size = names.reduce((n, name) => n + delta[name].data.length, 0);
  if (size !== book.base_size) throw new SecAggError(`the delta has ${size} values, the round sums ${book.base_size}`, 'send every shared tensor of the round\'s base');
  if (!Number.isInteger(weight) || weight < 0) throw new SecAggError(`weight ${weight} is not a non-negative integer`, 'pass the device\'s sample count');
  if (names.some((name) => delta[name].data.some((v) => !Number.isFinite(v)))) throw new SecAggError('the delta has NaN or Inf values', 'lower the learning rate; the device sits this round out');
  const w = Math.min(weight, config.max_weight);
  // the contribution (w / W) delta must fit the ring: clip it to C (quantize.py, the same float64 expressions)
  const scale = w / (config.weight_scale ?? config.max_weight);
  const clipped = clipDelta(delta, scale > 0 ? config.clip_norm / scale : config.clip_norm);
  const padded = paddedSize(size);
  const slots = new Float64Array(padded);
  let offset = 0;
  for (const name of names) {
    slots.set(clipped[name].data, offset);
    offset += clipped[name].data.length;
  }
  for (let i = 0; i < size; i++) slots[i] *= scale;
  const rotated = await rotate(slots, rotationBlock(size), await graphSeed(book));
  const q = levels(plan.devices, plan.bits);
  const step = (config.coordinate_sigmas * config.clip_norm) / Math.sqrt(padded) / q;
  const [base, count] = weightDigits(plan.devices, plan.bits, config.max_weight);
  const out = new Uint32Array(padded + count);
  const modulus = 2 ** plan.bits;
  for (let i = 0; i < padded; i++) {
    const ratio = rotated[i] / step;
    const rounded = rng ? Math.floor(ratio + rng()) : roundHalfEven(ratio);
    const z = Math.max(-q, Math.min(q, rounded));
    out[i] = z < 0 ? z + modulus : z;
  }
  for (let i = 0; i < count; i++) out[padded + i] = Math.floor(w / base ** i) % base;
  return out;
}

/** @param {number} x */
function roundHalfEven(x) {
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 ? 2 * Math.round(x / 2) : r;
}

// ---- messages (messages.py JSON) --------------------------------------------------------------------------

/** @param {Record<string, Uint8Array>} items */
function b64Map(items) {
  return Object.fromEntries(Object.keys(items).sort(compareIds).map((d) => [d, b64(items[d])]));
}

/** @param {unknown} data @param {string} what */
function unb64Map(data, what) {
  if (!data || typeof data !== 'object' || Array.isArray(data)) throw new SecAggError(`${what} is not an object of device -> base64`, 'send {device: base64}');
  return Object.fromEntries(Object.entries(data).map(([d, text]) => [checkName(d, 'device id'), unb64(text, `${what} for ${d}`)]));
}

/** @param {unknown} name @param {string} what */
function checkName(name, what) {
  if (typeof name !== 'string' || !NAME.test(name)) throw new SecAggError(`${what} ${JSON.stringify(name)} is not 1-200 printable ASCII characters`, `use a plain ${what}`);
  return name;
}

/** @param {any} data @param {string} what @param {string[]} names */
function fields(data, what, names) {
  if (!data || typeof data !== 'object' || Object.keys(data).length !== names.length || !names.every((n) => n in data)) {
    throw new SecAggError(`a ${what} does not have exactly the fields ${names.join(', ')}`, `send a ${what} as edgepfl.secagg.messages writes it`);
  }
  return data;
}

/** The wire JSON of a message the device sends: KeyAdvert, ShareBundle, MaskedInput or UnmaskShares. @param {'KeyAdvert'|'ShareBundle'|'MaskedInput'|'UnmaskShares'} type @param {any} message */
export function messageToJson(type, message) {
  const body = {
    KeyAdvert: () => ({ device: message.device, cipher_key: b64(message.cipher_key), mask_key: b64(message.mask_key) }),
    ShareBundle: () => ({ device: message.device, sealed: b64Map(message.sealed) }),
    MaskedInput: () => ({ device: message.device, masked: b64(message.masked) }),
    UnmaskShares: () => ({ device: message.device, seed_shares: b64Map(message.seed_shares), key_shares: b64Map(message.key_shares) }),
  }[type]();
  return JSON.stringify({ type, ...body });
}

/** A MaskedInput as the binary frame of messages.py (b"EPSA1", header length, JSON header, packed vector). @param {MaskedInput} message */
export function maskedInputBytes(message) {
  const header = encoder.encode(JSON.stringify({ device: message.device }));
  const size = Uint8Array.from([header.length >>> 24, (header.length >>> 16) & 0xff, (header.length >>> 8) & 0xff, header.length & 0xff]);
  return concat(encoder.encode('EPSA1'), size, header, message.masked);
}

/** A message the device receives (KeyBook, ShareInbox, UnmaskRequest) from its wire JSON. @param {string} text @param {'KeyBook'|'ShareInbox'|'UnmaskRequest'} type */
export function messageFromJson(text, type) {
  let data;
  try {
    data = JSON.parse(text);
  } catch {
    throw new SecAggError('a message is not JSON', 'send what to_json writes');
  }
  if (!data || data.type !== type) throw new SecAggError(`a message is not ${type}`, 'send the message the protocol step asks for');
  delete data.type;
  if (type === 'KeyBook') return keyBookFromDict(data);
  if (type === 'ShareInbox') {
    fields(data, 'share inbox', ['device', 'sealed']);
    return { device: checkName(data.device, 'device id'), sealed: unb64Map(data.sealed, 'share inbox') };
  }
  fields(data, 'unmask request', ['survivors', 'dropped']);
  if (!Array.isArray(data.survivors) || !Array.isArray(data.dropped)) throw new SecAggError('the unmask request\'s lists are malformed', 'send survivors and dropped as lists');
  return { survivors: data.survivors.map((/** @type {unknown} */ d) => checkName(d, 'device id')), dropped: data.dropped.map((/** @type {unknown} */ d) => checkName(d, 'device id')) };
}

/** @param {any} data @returns {KeyBook} */
function keyBookFromDict(data) {
  fields(data, 'key book', ['context', 'config', 'randomness', 'adverts', 'plan', 'base_size']);
  if (!Array.isArray(data.adverts) || !data.plan || typeof data.config !== 'object') throw new SecAggError('the key book is malformed', 'send adverts as a list and the plan as an object');
  const adverts = data.adverts.map((/** @type {any} */ a) => {
    fields(a, 'key advert', ['device', 'cipher_key', 'mask_key']);
    const device = checkName(a.device, 'device id');
    return { device, cipher_key: unb64(a.cipher_key, `${device}'s cipher key`, 32), mask_key: unb64(a.mask_key, `${device}'s mask key`, 32) };
  });
  const book = { context: checkName(data.context, 'round context'), config: data.config, randomness: unb64(data.randomness, 'the key book\'s randomness', 32), adverts, plan: data.plan, base_size: data.base_size };
  const devices = adverts.map((/** @type {KeyAdvert} */ a) => a.device);
  const sorted = [...new Set(devices)].sort(compareIds);
  const keys = new Set(adverts.flatMap((/** @type {KeyAdvert} */ a) => [b64(a.cipher_key), b64(a.mask_key)]));
  if (devices.join('\n') !== sorted.join('\n') || keys.size !== 2 * adverts.length || !Number.isInteger(book.base_size) || book.base_size < 1) {
    throw new SecAggError('the key book\'s devices are not sorted and unique, its keys not distinct, or its size malformed', 'the server must send one fresh advert per device, sorted by device id');
  }
  return book;
}

/** @param {KeyBook} book */
function keyBookToDict(book) {
  return { context: book.context, config: book.config, randomness: b64(book.randomness), adverts: book.adverts.map((a) => ({ device: a.device, cipher_key: b64(a.cipher_key), mask_key: b64(a.mask_key) })), plan: book.plan, base_size: book.base_size };
}

/** @param {unknown} a @param {unknown} b */
function sameJson(a, b) {
  /** @param {any} v @returns {any} */
  const canonical = (v) => (v && typeof v === 'object' && !Array.isArray(v) ? Object.fromEntries(Object.keys(v).sort().map((k) => [k, canonical(v[k])])) : Array.isArray(v) ? v.map(canonical) : v);
  return JSON.stringify(canonical(a)) === JSON.stringify(canonical(b));
}

// ---- the client state machine (client.py) -----------------------------------------------------------------

const PHASES = ['advertised', 'shared', 'masked', 'revealed'];

/**
 * One device in one round. Save `toJSON()` (private keys inside: keep it private) before sending what a step
 * returns; a step repeated with the same message answers the same, a different message for an answered step is
 * refused, so the device never reveals both shares of one peer nor masks two inputs. The state is the JSON of
 * Python's ClientSession: either side resumes the other's.
 */
export class ClientSession {
  /** @param {Record<string, any>} state @param {{cipherPublic: Uint8Array, maskPublic: Uint8Array}} keys */
  constructor(state, keys) {
    this.state = state;
    this.keys = keys;
    /** @type {KeyBook|null} parsed once: the graph and indices are derived from it */
    this.parsedBook = null;
    /** @type {Promise<{indices: Record<string, number>, neighbours: Record<string, string[]>}>|null} */
    this.graph = null;
  }

  /** Fresh key pairs for `device` in round `context`. @param {string} device @param {string} context @param {RandomBytes} [randomBytes] */
  static async start(device, context, randomBytes = systemRandomBytes) {
    checkName(device, 'device id');
    checkName(context, 'round context');
    const state = { device, context, phase: 'advertised', cipher_private: b64(randomBytes(32)), mask_private: b64(randomBytes(32)) };
    return ClientSession.#withKeys(state);
  }

  /** @param {Record<string, any>} state */
  static async #withKeys(state) {
    const keys = { cipherPublic: await publicKey(unb64(state.cipher_private, 'key', 32)), maskPublic: await publicKey(unb64(state.mask_private, 'key', 32)) };
    return new ClientSession(state, keys);
  }

  get device() { return this.state.device; }

  get phase() { return this.state.phase; }

  /** @returns {KeyAdvert} */
  advert() {
    return { device: this.device, cipher_key: this.keys.cipherPublic, mask_key: this.keys.maskPublic };
  }

  /** The round's key book (after receiveBook). */
  get book() {
    this.#need('shared', 'masked', 'revealed');
    if (!this.parsedBook) this.parsedBook = keyBookFromDict(structuredClone(this.state.book));
    return this.parsedBook;
  }

  /** Partners: the neighbours whose shares arrived (after receiveInbox). */
  get partners() {
    this.#need('masked', 'revealed');
    return Object.keys(this.state.received).sort(compareIds);
  }

  /** Check the key book, draw the self-mask seed, share it and the mask key with the group. @param {KeyBook} book @param {RandomBytes} [randomBytes] @returns {Promise<ShareBundle>} */
  async receiveBook(book, randomBytes = systemRandomBytes) {
    const me = this.device;
    if (this.phase !== 'advertised') {
      if (!sameJson(this.state.book, keyBookToDict(book))) throw new SecAggError(`device ${JSON.stringify(me)} already has another key book this round`, 'the server must send one key book per round');
      return { device: me, sealed: Object.fromEntries(Object.entries(this.state.bundle).map(([d, s]) => [d, unb64(s, 'sealed share')])) };
    }
    if (book.context !== this.state.context) throw new SecAggError(`the key book is for round ${JSON.stringify(book.context)}, device ${JSON.stringify(me)} is in ${JSON.stringify(this.state.context)}`, 'send the key book of this round');
    checkPlan(book);
    const mine = book.adverts.find((a) => a.device === me);
    if (!mine || !equalBytes(mine.cipher_key, this.keys.cipherPublic) || !equalBytes(mine.mask_key, this.keys.maskPublic)) {
      throw new SecAggError(`the key book does not carry device ${JSON.stringify(me)}'s advertised keys`, 'the server must send every advert unchanged');
    }
    const { indices, neighbours } = await this.#graph(book);
    const group = [me, ...neighbours[me]];
    const holders = group.map((d) => indices[d]);
    const selfSeed = randomBytes(SECRET_BYTES);
    const seedShares = shamirSplit(selfSeed, holders, book.plan.threshold, randomBytes);
    const keyShares = shamirSplit(unb64(this.state.mask_private, 'key', 32), holders, book.plan.threshold, randomBytes);
    const nonces = neighbours[me].map(() => randomBytes(NONCE_BYTES)); // drawn in neighbour order, as Python does
    const sealedList = await Promise.all(neighbours[me].map(async (peer, j) => {
      const key = await this.#shareKey(book, peer, me, peer);
      return encrypt(key, concat(seedShares[indices[peer]], keyShares[indices[peer]]), info('share', book.context, me, peer), () => nonces[j]);
    }));
    /** @type {Record<string, Uint8Array>} */
    const sealed = Object.fromEntries(neighbours[me].map((peer, j) => [peer, sealedList[j]]));
    const own = indices[me];
    Object.assign(this.state, { phase: 'shared', book: keyBookToDict(book), self_seed: b64(selfSeed), own_shares: { seed: b64(seedShares[own]), key: b64(keyShares[own]) }, bundle: b64Map(sealed) });
    return { device: me, sealed };
  }

  /** Open the partners' shares and mask `vector` (ring elements of the key book's length). @param {ShareBundle} inbox @param {Uint32Array} vector @returns {Promise<MaskedInput>} */
  async receiveInbox(inbox, vector) {
    this.#need('shared', 'masked', 'revealed');
    const book = this.book, me = this.device;
    const digest = await inboxDigest(inbox);
    if (this.phase !== 'shared' && this.state.inbox_digest !== digest) throw new SecAggError(`device ${JSON.stringify(me)} already masked with other partners this round`, 'the server must send one share inbox per device per round');
    const received = await this.#openInbox(book, inbox);
    const masked = { device: me, masked: pack(await this.#mask(book, received, vector), book.plan.bits) };
    const maskedDigest = hex(await sha256(masked.masked));
    if (this.phase !== 'shared') {
      if (maskedDigest !== this.state.masked_digest) throw new SecAggError(`device ${JSON.stringify(me)} already uploaded a different masked vector this round`, 'upload the same quantized delta again (seed the rounding by the round)');
      return masked;
    }
    Object.assign(this.state, { phase: 'masked', inbox_digest: digest, masked_digest: maskedDigest, received: Object.fromEntries(Object.entries(received).map(([d, [s, k]]) => [d, { seed: b64(s), key: b64(k) }])) });
    return masked;
  }

  /** Reveal each partner's seed share if it survived, its mask-key share if it dropped; never both. @param {UnmaskRequest} request @returns {UnmaskShares} */
  receiveUnmask(request) {
    this.#need('masked', 'revealed');
    const me = this.device, book = this.book;
    const fromState = (/** @type {Record<string, string>} */ items) => Object.fromEntries(Object.entries(items).map(([d, s]) => [d, unb64(s, 'share')]));
    if (this.phase === 'revealed') {
      if (!sameJson(this.state.request, request)) throw new SecAggError(`the server asked device ${JSON.stringify(me)} again with other survivors; it would learn both shares of a device`, 'the server must send one unmask request per round');
      return { device: me, seed_shares: fromState(this.state.reveal.seed), key_shares: fromState(this.state.reveal.key) };
    }
    const survivors = new Set(request.survivors), dropped = new Set(request.dropped);
    const both = request.survivors.filter((d) => dropped.has(d)).sort(compareIds);
    const known = new Set(book.adverts.map((a) => a.device));
    const problems = [
      [survivors.size !== request.survivors.length || dropped.size !== request.dropped.length, 'names a device twice'],
      [both.length > 0, `asks for both shares of device ${JSON.stringify(both[0])}`],
      [[...survivors, ...dropped].some((d) => !known.has(d)), 'names devices outside the key book'],
      [!survivors.has(me), `does not list device ${JSON.stringify(me)} among the survivors`],
      [survivors.size < book.plan.min_survivors, `lists ${survivors.size} survivors, fewer than the ${book.plan.min_survivors} the round needs`],
      [this.partners.some((d) => !survivors.has(d) && !dropped.has(d)), 'leaves out a partner that sent its shares'],
    ];
    for (const [bad, problem] of problems) {
      if (bad) throw new SecAggError(`the unmask request to device ${JSON.stringify(me)} ${problem}`, 'the server must list each device that sent shares once: survivor or dropped');
    }
    const received = this.state.received;
    /** @type {Record<string, string>} */
    const seed = {};
    /** @type {Record<string, string>} */
    const key = {};
    for (const peer of this.partners) {
      if (survivors.has(peer)) seed[peer] = received[peer].seed;
      else key[peer] = received[peer].key;
    }
    seed[me] = this.state.own_shares.seed;
    Object.assign(this.state, { phase: 'revealed', request: { survivors: [...request.survivors], dropped: [...request.dropped] }, reveal: { seed, key } });
    return { device: me, seed_shares: fromState(seed), key_shares: fromState(key) };
  }

  /** The whole state as JSON (Python's ClientSession.to_json format). */
  toJSON() {
    return JSON.stringify({ type: 'ClientSession', version: 1, ...this.state });
  }

  /** Resume from toJSON (or Python's to_json) text. @param {string} text */
  static async fromJSON(text) {
    try {
      const state = JSON.parse(text);
      if (state.type !== 'ClientSession' || state.version !== 1 || !PHASES.includes(state.phase)) throw new Error('not a client session');
      delete state.type;
      delete state.version;
      checkName(state.device, 'device id');
      const session = await ClientSession.#withKeys(state);
      if (session.phase !== 'advertised') checkPlan(session.book);
      return session;
    } catch {
      throw new SecAggError('the saved secure-aggregation state of this device cannot be read', 'drop this round\'s state; the device rejoins the next round');
    }
  }

  /** Indices and neighbours of the session's key book (computed once). @param {KeyBook} book */
  async #graph(book) {
    if (this.graph && book === this.parsedBook) return this.graph;
    const devices = book.adverts.map((a) => a.device);
    /** @type {Record<string, number>} */
    const indices = Object.fromEntries(devices.map((d, i) => [d, i + 1]));
    const graph = graphSeed(book).then(async (seed) => ({ indices, neighbours: await neighbourMap(devices, seed, book.plan.neighbours) }));
    if (book === this.parsedBook) this.graph = graph;
    return graph;
  }

  /** @param {KeyBook} book @param {string} peer @param {string} sender @param {string} recipient */
  async #shareKey(book, peer, sender, recipient) {
    const advert = /** @type {KeyAdvert} */ (book.adverts.find((a) => a.device === peer));
    const secret = await agree(unb64(this.state.cipher_private, 'key', 32), advert.cipher_key, peer);
    return derive(secret, 'share', book.context, sender, recipient);
  }

  /** @param {KeyBook} book @param {ShareBundle} inbox */
  async #openInbox(book, inbox) {
    const me = this.device;
    if (inbox.device !== me) throw new SecAggError(`device ${JSON.stringify(me)} got the share inbox of ${JSON.stringify(inbox.device)}`, 'route each inbox to its device');
    const { neighbours } = await this.#graph(book);
    const strangers = Object.keys(inbox.sealed).filter((d) => !neighbours[me].includes(d)).sort(compareIds);
    if (strangers.length) throw new SecAggError(`device ${JSON.stringify(me)} got shares from ${JSON.stringify(strangers[0])}, which is not its neighbour`, 'route only shares between neighbours');
    if (Object.keys(inbox.sealed).length + 1 < book.plan.threshold) throw new SecAggError(`only ${Object.keys(inbox.sealed).length} neighbours of device ${JSON.stringify(me)} sent shares; its group cannot reach the threshold ${book.plan.threshold}`, 'this device sits this round out');
    /** @type {Record<string, [Uint8Array, Uint8Array]>} */
    const received = {};
    for (const peer of Object.keys(inbox.sealed).sort(compareIds)) {
      const what = `the shares from ${JSON.stringify(peer)} to ${JSON.stringify(me)}`;
      const plain = await decrypt(await this.#shareKey(book, peer, peer, me), inbox.sealed[peer], info('share', book.context, peer, me), what);
      if (plain.length !== 2 * SHARE_BYTES || toBigInt(plain.subarray(0, SHARE_BYTES)) >= PRIME || toBigInt(plain.subarray(SHARE_BYTES)) >= PRIME) {
        throw new SecAggError(`${what} are not two shares in the field`, 'seal two 33-byte shares');
      }
      received[peer] = [plain.slice(0, SHARE_BYTES), plain.slice(SHARE_BYTES)];
    }
    return received;
  }

  /** @param {KeyBook} book @param {Record<string, unknown>} partners @param {Uint32Array} vector */
  async #mask(book, partners, vector) {
    const bits = book.plan.bits, length = vectorLength(book), me = this.device;
    const modulus = 2 ** bits;
    if (!(vector instanceof Uint32Array) || vector.length !== length || vector.some((v) => v >= modulus)) {
      throw new SecAggError(`device ${JSON.stringify(me)}'s ring vector is not ${length} integers in [0, 2^${bits})`, 'quantize with quantizeDelta for this key book');
    }
    const { indices } = await this.#graph(book);
    const masked = Uint32Array.from(vector);
    const own = await maskVector(unb64(this.state.self_seed, 'seed', 32), length, bits);
    for (let i = 0; i < length; i++) masked[i] += own[i];
    const maskPrivate = unb64(this.state.mask_private, 'key', 32);
    const peers = Object.keys(partners).sort(compareIds);
    for (let first = 0; first < peers.length; first += PARALLEL_MASKS) { // WebCrypto works on other threads
      const batch = peers.slice(first, first + PARALLEL_MASKS);
      const masks = await Promise.all(batch.map(async (peer) => {
        const advert = /** @type {KeyAdvert} */ (book.adverts.find((a) => a.device === peer));
        const [low, high] = indices[me] < indices[peer] ? [me, peer] : [peer, me];
        const seed = await derive(await agree(maskPrivate, advert.mask_key, peer), 'mask', book.context, low, high);
        return maskVector(seed, length, bits);
      }));
      batch.forEach((peer, j) => {
        const mask = masks[j];
        if (indices[me] < indices[peer]) for (let i = 0; i < length; i++) masked[i] += mask[i];
        else for (let i = 0; i < length; i++) masked[i] -= mask[i];
      });
    }
    if (bits < 32) for (let i = 0; i < length; i++) masked[i] %= modulus;
    return masked;
  }

  /** @param {...string} phases */
  #need(...phases) {
    if (!phases.includes(this.phase)) throw new SecAggError(`device ${JSON.stringify(this.device)} is at step ${JSON.stringify(this.phase)} of secure aggregation, this message belongs to step ${phases.join(' or ')}`, 'send the messages in protocol order');
  }
}

/** Hex SHA-256 of the inbox's device and (sender, sealed) pairs, as client.py inbox_digest_of. @param {ShareBundle} inbox */
export async function inboxDigest(inbox) {
  const parts = [inbox.device];
  /** @type {(string|Uint8Array)[]} */
  const all = [...parts];
  for (const peer of Object.keys(inbox.sealed).sort(compareIds)) all.push(peer, inbox.sealed[peer]);
  return hex(await sha256(lengthPrefixed(all)));
}

/**
 * How a device's secure steps reach the server and keep their state (runner.js gives the page's).
 * @typedef {object} SecureIO
 * @property {(kind: string, body: string | Uint8Array) => Promise<unknown>} send POST advert, shares, masked, reveal
 * @property {(what: string) => Promise<string>} fetch the book, inbox or unmask request (JSON) once the server has it
 * @property {(state: string) => Promise<void>} save keep the session's state (private keys and shares) durably
 */

/**
 * A device's secure round once its clipped delta is saved (device_runtime/secure_round.py's `deliver`): advertise
 * its keys, then answer the key book, the share inbox and the unmask request, the session saved before each answer
 * is sent. Taken again from `state` after a reload, the same server messages get the same answers (the rounding is
 * seeded by `seed`, e.g. [device seed, round]), and the server acknowledges what it holds as a duplicate.
 * @param {SecureIO} io @param {string} state the session's JSON @param {Record<string, Tensor>} delta
 * @param {number} weight the sample count @param {number[]} seed
 */
export async function takeSecureSteps(io, state, delta, weight, seed) {
  const session = await ClientSession.fromJSON(state);
  await io.send('advert', messageToJson('KeyAdvert', session.advert()));
  const bundle = await session.receiveBook(/** @type {KeyBook} */ (messageFromJson(await io.fetch('book'), 'KeyBook')));
  await io.save(session.toJSON());
  await io.send('shares', messageToJson('ShareBundle', bundle));
  const inbox = /** @type {ShareBundle} */ (messageFromJson(await io.fetch('inbox'), 'ShareInbox'));
  const masked = await session.receiveInbox(inbox, await quantizeDelta(delta, weight, session.book, uniformRandom(seed)));
  await io.save(session.toJSON());
  await io.send('masked', maskedInputBytes(masked));
  const reveal = session.receiveUnmask(/** @type {UnmaskRequest} */ (messageFromJson(await io.fetch('unmask'), 'UnmaskRequest')));
  await io.save(session.toJSON());
  await io.send('reveal', messageToJson('UnmaskShares', reveal));
}
