// @ts-check
// Secure aggregation's keys as edgepfl/secagg/keys.py makes them: X25519 key pairs and agreement, HKDF-SHA256
// with round-bound info strings, AES-256-GCM for the shares in transit. Only WebCrypto (crypto.subtle: https pages
// and localhost).

import { concat } from './bytes.js';
import { SecAggError } from './errors.js';
import { unb64 } from './secagg_messages.js';

/** @typedef {(count: number) => Uint8Array} RandomBytes */

const VERSION = 'edgepfl-secagg-v1';
export const NONCE_BYTES = 12;
export const TAG_BYTES = 16;
const PKCS8_X25519 = Uint8Array.from([
  0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x6e, 0x04, 0x22, 0x04, 0x20,
]);
const encoder = new TextEncoder();

/** @returns {SubtleCrypto} */
export function subtle() {
  if (!globalThis.crypto?.subtle)
    throw new SecAggError(
      'secure aggregation needs WebCrypto, which browsers offer only on https pages (and localhost)',
      'open the page over https',
    );
  return globalThis.crypto.subtle;
}

/** @type {RandomBytes} */
export function systemRandomBytes(count) {
  return globalThis.crypto.getRandomValues(new Uint8Array(count));
}

/** Each part as 2-byte big-endian length + bytes (strings as UTF-8). @param {(string|Uint8Array)[]} parts */
export function lengthPrefixed(parts) {
  return concat(
    ...parts.flatMap((part) => {
      const bytes = typeof part === 'string' ? encoder.encode(part) : part;
      return [Uint8Array.from([bytes.length >> 8, bytes.length & 0xff]), bytes];
    }),
  );
}

/**
 * Bytes as WebCrypto's BufferSource: TypeScript's DOM types take only views of an ArrayBuffer, never a
 * SharedArrayBuffer, and every array here is made over an ArrayBuffer.
 * @param {Uint8Array} bytes @returns {Uint8Array<ArrayBuffer>}
 */
export function buffer(bytes) {
  return /** @type {Uint8Array<ArrayBuffer>} */ (bytes);
}

/** @param {Uint8Array} bytes */
export async function sha256(bytes) {
  return new Uint8Array(await subtle().digest('SHA-256', buffer(bytes)));
}

/** The HKDF info and AES-GCM associated data of a purpose, round and devices. @param {string} purpose @param {string} context @param {...string} parties */
export function info(purpose, context, ...parties) {
  return lengthPrefixed([VERSION, purpose, context, ...parties]);
}

/** HKDF-SHA256 of a secret to 32 bytes bound to purpose, context and devices. @param {Uint8Array} secret @param {string} purpose @param {string} context @param {...string} parties */
export async function derive(secret, purpose, context, ...parties) {
  const key = await subtle().importKey('raw', buffer(secret), 'HKDF', false, ['deriveBits']);
  const salt = await sha256(encoder.encode(VERSION));
  return new Uint8Array(
    await subtle().deriveBits(
      { name: 'HKDF', hash: 'SHA-256', salt, info: info(purpose, context, ...parties) },
      key,
      256,
    ),
  );
}

/** @param {Uint8Array} privateKey */
async function importPrivate(privateKey, extractable = false) {
  return subtle().importKey('pkcs8', buffer(concat(PKCS8_X25519, privateKey)), { name: 'X25519' }, extractable, [
    'deriveBits',
  ]);
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
    return new Uint8Array(
      await subtle().deriveBits({ name: 'X25519', public: publicKey }, await importPrivate(privateKey), 256),
    );
  } catch {
    throw new SecAggError(
      `device ${JSON.stringify(peer)} advertised a malformed or low-order X25519 public key`,
      'advertise a key made by X25519 key generation',
    );
  }
}

/** AES-256-GCM: random nonce || ciphertext || tag. @param {Uint8Array} key @param {Uint8Array} plaintext @param {Uint8Array} associated @param {RandomBytes} randomBytes */
export async function encrypt(key, plaintext, associated, randomBytes) {
  const nonce = randomBytes(NONCE_BYTES);
  const aes = await subtle().importKey('raw', buffer(key), 'AES-GCM', false, ['encrypt']);
  return concat(
    nonce,
    new Uint8Array(
      await subtle().encrypt(
        { name: 'AES-GCM', iv: buffer(nonce), additionalData: buffer(associated) },
        aes,
        buffer(plaintext),
      ),
    ),
  );
}

/** @param {Uint8Array} key @param {Uint8Array} sealed @param {Uint8Array} associated @param {string} what */
export async function decrypt(key, sealed, associated, what) {
  try {
    const aes = await subtle().importKey('raw', buffer(key), 'AES-GCM', false, ['decrypt']);
    return new Uint8Array(
      await subtle().decrypt(
        { name: 'AES-GCM', iv: buffer(sealed.subarray(0, NONCE_BYTES)), additionalData: buffer(associated) },
        aes,
        buffer(sealed.subarray(NONCE_BYTES)),
      ),
    );
  } catch {
    throw new SecAggError(
      `${what} does not decrypt (wrong key, sender, recipient or round, or altered in transit)`,
      "the server must route each device's shares unchanged",
    );
  }
}
