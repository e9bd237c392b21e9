// @ts-check
// The secure-aggregation messages as edgepfl/secagg/messages.py writes them: their JSON (bytes as base64), the
// binary frame of a masked input, device ids, and the key book as a device keeps it.

import { concat } from './bytes.js';
import { SecAggError } from './errors.js';
import { checkSettings } from './secagg_config.js';

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
 */

const NAME = /^[!-~]{1,200}$/; // device ids and round contexts: printable ASCII
const encoder = new TextEncoder();

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
  if (length !== null && bytes.length !== length)
    throw new SecAggError(`${what} has ${bytes.length} bytes, not ${length}`, `send ${length} bytes`);
  return bytes;
}

/** @param {Record<string, Uint8Array>} items */
export function b64Map(items) {
  return Object.fromEntries(
    Object.keys(items)
      .sort(compareIds)
      .map((d) => [d, b64(items[d])]),
  );
}

/** @param {unknown} data @param {string} what */
function unb64Map(data, what) {
  if (!data || typeof data !== 'object' || Array.isArray(data))
    throw new SecAggError(`${what} is not an object of device -> base64`, 'send {device: base64}');
  return Object.fromEntries(
    Object.entries(data).map(([d, text]) => [checkName(d, 'device id'), unb64(text, `${what} for ${d}`)]),
  );
}

/** @param {unknown} name @param {string} what */
export function checkName(name, what) {
  if (typeof name !== 'string' || !NAME.test(name))
    throw new SecAggError(
      `${what} ${JSON.stringify(name)} is not 1-200 printable ASCII characters`,
      `use a plain ${what}`,
    );
  return name;
}

/** @param {string} a @param {string} b */
export function compareIds(a, b) {
  return a < b ? -1 : a > b ? 1 : 0;
}

/** @param {any} data @param {string} what @param {string[]} names */
function fields(data, what, names) {
  if (
    !data ||
    typeof data !== 'object' ||
    Object.keys(data).length !== names.length ||
    !names.every((n) => n in data)
  ) {
    throw new SecAggError(
      `a ${what} does not have exactly the fields ${names.join(', ')}`,
      `send a ${what} as edgepfl.secagg.messages writes it`,
    );
  }
  return data;
}

/** The wire JSON of a message the device sends: KeyAdvert, ShareBundle, MaskedInput or UnmaskShares. @param {'KeyAdvert'|'ShareBundle'|'MaskedInput'|'UnmaskShares'} type @param {any} message */
export function messageToJson(type, message) {
  const body = {
    KeyAdvert: () => ({ device: message.device, cipher_key: b64(message.cipher_key), mask_key: b64(message.mask_key) }),
    ShareBundle: () => ({ device: message.device, sealed: b64Map(message.sealed) }),
    MaskedInput: () => ({ device: message.device, masked: b64(message.masked) }),
    UnmaskShares: () => ({
      device: message.device,
      seed_shares: b64Map(message.seed_shares),
      key_shares: b64Map(message.key_shares),
    }),
  }[type]();
  return JSON.stringify({ type, ...body });
}

/** A MaskedInput as the binary frame of messages.py (b"EPSA1", header length, JSON header, packed vector). @param {MaskedInput} message */
export function maskedInputBytes(message) {
  const header = encoder.encode(JSON.stringify({ device: message.device }));
  const size = Uint8Array.from([
    header.length >>> 24,
    (header.length >>> 16) & 0xff,
    (header.length >>> 8) & 0xff,
    header.length & 0xff,
  ]);
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
  if (!data || data.type !== type)
    throw new SecAggError(`a message is not ${type}`, 'send the message the protocol step asks for');
  delete data.type;
  if (type === 'KeyBook') return keyBookFromDict(data);
  if (type === 'ShareInbox') {
    fields(data, 'share inbox', ['device', 'sealed']);
    return { device: checkName(data.device, 'device id'), sealed: unb64Map(data.sealed, 'share inbox') };
  }
  fields(data, 'unmask request', ['survivors', 'dropped']);
  if (!Array.isArray(data.survivors) || !Array.isArray(data.dropped))
    throw new SecAggError("the unmask request's lists are malformed", 'send survivors and dropped as lists');
  return {
    survivors: data.survivors.map((/** @type {unknown} */ d) => checkName(d, 'device id')),
    dropped: data.dropped.map((/** @type {unknown} */ d) => checkName(d, 'device id')),
  };
}

/** @param {any} data @returns {KeyBook} */
export function keyBookFromDict(data) {
  fields(data, 'key book', ['context', 'config', 'randomness', 'adverts', 'plan', 'base_size']);
  if (!Array.isArray(data.adverts) || !data.plan || typeof data.config !== 'object')
    throw new SecAggError('the key book is malformed', 'send adverts as a list and the plan as an object');
  checkSettings(data.config, data.plan);
  const adverts = data.adverts.map((/** @type {any} */ a) => {
    fields(a, 'key advert', ['device', 'cipher_key', 'mask_key']);
    const device = checkName(a.device, 'device id');
    return {
      device,
      cipher_key: unb64(a.cipher_key, `${device}'s cipher key`, 32),
      mask_key: unb64(a.mask_key, `${device}'s mask key`, 32),
    };
  });
  const book = {
    context: checkName(data.context, 'round context'),
    config: data.config,
    randomness: unb64(data.randomness, "the key book's randomness", 32),
    adverts,
    plan: data.plan,
    base_size: data.base_size,
  };
  const devices = adverts.map((/** @type {KeyAdvert} */ a) => a.device);
  const sorted = [...new Set(devices)].sort(compareIds);
  const keys = new Set(adverts.flatMap((/** @type {KeyAdvert} */ a) => [b64(a.cipher_key), b64(a.mask_key)]));
  if (
    devices.join('\n') !== sorted.join('\n') ||
    keys.size !== 2 * adverts.length ||
    !Number.isInteger(book.base_size) ||
    book.base_size < 1 ||
    book.base_size >= 2 ** 31 // no page holds a delta that large; bounds what the masked vector allocates
  ) {
    throw new SecAggError(
      "the key book's devices are not sorted and unique, its keys not distinct, or its size malformed",
      'the server must send one fresh advert per device, sorted by device id',
    );
  }
  return book;
}

/** @param {KeyBook} book */
export function keyBookToDict(book) {
  return {
    context: book.context,
    config: book.config,
    randomness: b64(book.randomness),
    adverts: book.adverts.map((a) => ({ device: a.device, cipher_key: b64(a.cipher_key), mask_key: b64(a.mask_key) })),
    plan: book.plan,
    base_size: book.base_size,
  };
}

/** @param {unknown} a @param {unknown} b */
export function sameJson(a, b) {
  /** @param {any} v @returns {any} */
  const canonical = (v) =>
    v && typeof v === 'object' && !Array.isArray(v)
      ? Object.fromEntries(
          Object.keys(v)
            .sort()
            .map((k) => [k, canonical(v[k])]),
        )
      : Array.isArray(v)
        ? v.map(canonical)
        : v;
  return JSON.stringify(canonical(a)) === JSON.stringify(canonical(b));
}
