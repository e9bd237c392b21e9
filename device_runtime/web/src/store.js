// @ts-check
// What the page keeps in the browser (IndexedDB): its token and enrollment key, its tensors (personal, base and
// BatchNorm buffers), the round it is in, an upload not yet acknowledged, its examples, the samples a text or
// sensor bundle collects (sentences typed, windows recorded: one record each, oldest first) and the bundle files.
//
// Every change that belongs together is ONE transaction (`commit`), so a tab killed at any moment leaves the
// state before or after it, never half of it: e.g. a trained round's tensors, `lastCompletedRound` and the
// pending upload's bytes are written together, and the upload is only ever sent from those saved bytes.

import { DeviceError } from './errors.js';

/** @typedef {import('./safetensors.js').Tensors} Tensors */
/** @typedef {import('./encoding.js').Delta} Delta */
/** @typedef {import('./data.js').Examples} Examples */
/** @typedef {{device: string, key?: string, secret?: string, token?: string}} Credentials */
/** An upload saved with its round, sent (again) from these bytes. @typedef {{round: number, payload: Uint8Array, sha256: string, residualBefore?: Delta | null}} PendingUpload */
/** @typedef {{layout: string, lastCompletedRound: number | null, lastUploadedRound: number | null, pending: PendingUpload | null}} Progress */
/**
 * One trained round as the page shows it.
 * @typedef {object} RoundRecord
 * @property {number} round
 * @property {number | null} beforeAccuracy held-out accuracy of the model held when the round began
 * @property {number | null} accuracy held-out accuracy after training
 * @property {number | null} loss held-out loss after training
 * @property {number} samples held-out examples
 * @property {number} trainLoss
 * @property {'pending' | 'none' | 'delivered' | 'dropped'} upload
 */
/**
 * What the `kv` store holds, by key.
 * @typedef {object} Saved
 * @property {Credentials} [creds] the device's name and enrollment key, and its token (the secret is dropped once the token is held)
 * @property {{layout: string, tensors: Tensors}} [tensors] every param and buffer after the last round
 * @property {Progress} [progress] the last rounds completed and uploaded, and the upload not yet acknowledged
 * @property {{round: number, startedAt: number}} [round] the round being trained (restarted from its base after a reload)
 * @property {RoundRecord[]} [history] the rounds trained, newest last
 * @property {Examples} [examples] the person's photos (an image bundle)
 * @property {{words: number, suggested: number}} [typing] the keyboard's own measure: words the person typed, and
 *   how many of them a suggestion gave (kept with the sentences, forgotten with them)
 * @property {Delta} [residual] what the encoded uploads owe (error feedback), committed with its round; a pending
 *   upload keeps the one before it (`residualBefore`), restored if the server drops that upload
 */
/**
 * The part of the store a device's round loop uses (the page's IndexedDB store, or a test's in-memory one).
 * @typedef {object} DeviceStore
 * @property {(...keys: (keyof Saved)[]) => Promise<Saved>} get the values of some keys, read together
 * @property {(changes: Saved) => Promise<void>} commit write (value) or delete (undefined) keys in one transaction
 */
/**
 * The page's store as the kinds of sample use it: the round loop's part, and the samples a text or sensor bundle
 * collects (each record as the kind wrote it, oldest first; decoded by the kind, records.js).
 * @typedef {object} PageStoreParts
 * @property {() => Promise<unknown[]>} samples every sample record, oldest first
 * @property {(records: unknown[], cap: number, changes?: Saved) => Promise<number>} addSamples add records (and
 *   write `changes`) in one transaction, dropping the oldest beyond `cap`; resolves to how many were dropped
 * @property {(changes?: Saved) => Promise<void>} clearSamples forget every sample record (and write `changes`)
 * @typedef {DeviceStore & PageStoreParts} PageStore
 */

const DB_NAME = 'edgepfl-device';
const DB_VERSION = 2; // 2: the samples a text or sensor bundle collects
const KV = 'kv'; // key -> value: see Saved
const FILES = 'files'; // sha256 -> bytes of a bundle file (downloaded once, checked before use)
const SAMPLES = 'samples'; // auto-incremented key -> one sample record (a sentence, a window), oldest first

/** The page's IndexedDB database; resolves once it is open (and upgraded if new). */
export async function openStore(indexedDB = globalThis.indexedDB) {
  if (!indexedDB)
    throw new DeviceError(
      'this browser keeps no IndexedDB storage for the page',
      'leave private browsing mode, or use a current Chrome or Safari',
    );
  const db = await request(
    (() => {
      const opening = indexedDB.open(DB_NAME, DB_VERSION);
      opening.onupgradeneeded = () => {
        const database = opening.result;
        if (!database.objectStoreNames.contains(KV)) database.createObjectStore(KV);
        if (!database.objectStoreNames.contains(FILES)) database.createObjectStore(FILES);
        if (!database.objectStoreNames.contains(SAMPLES)) database.createObjectStore(SAMPLES, { autoIncrement: true });
      };
      return opening;
    })(),
  );
  return new Store(db);
}

/** The page's IndexedDB store. @implements {PageStore} */
class Store {
  constructor(/** @type {IDBDatabase} */ db) {
    this.db = db;
  }

  /** The values of some keys of the `kv` store, read in one transaction: {key: value | undefined}. */
  async get(/** @type {(keyof Saved)[]} */ ...keys) {
    const tx = this.db.transaction(KV, 'readonly');
    const values = await Promise.all(keys.map((key) => request(tx.objectStore(KV).get(key))));
    return /** @type {Saved} */ (Object.fromEntries(keys.map((key, i) => [key, values[i]])));
  }

  /** Write (value) or delete (undefined) several keys in ONE durable transaction; resolves once it is committed. */
  async commit(/** @type {Saved} */ changes) {
    const tx = this.db.transaction(KV, 'readwrite', { durability: 'strict' });
    write(tx, changes);
    await done(tx);
  }

  /** Every sample record, oldest first. */
  async samples() {
    return /** @type {unknown[]} */ (
      await request(this.db.transaction(SAMPLES, 'readonly').objectStore(SAMPLES).getAll())
    );
  }

  /** Add sample records and write `changes` in ONE transaction, the oldest records beyond `cap` dropped. */
  async addSamples(/** @type {unknown[]} */ records, /** @type {number} */ cap, /** @type {Saved} */ changes = {}) {
    const tx = this.db.transaction([SAMPLES, KV], 'readwrite', { durability: 'strict' });
    const samples = tx.objectStore(SAMPLES);
    for (const record of records) samples.add(record);
    write(tx, changes);
    const keys = await request(samples.getAllKeys());
    const dropped = Math.max(0, keys.length - cap);
    if (dropped) samples.delete(IDBKeyRange.upperBound(keys[dropped - 1]));
    await done(tx);
    return dropped;
  }

  /** Forget every sample record and write `changes`, in ONE transaction. */
  async clearSamples(/** @type {Saved} */ changes = {}) {
    const tx = this.db.transaction([SAMPLES, KV], 'readwrite', { durability: 'strict' });
    tx.objectStore(SAMPLES).clear();
    write(tx, changes);
    await done(tx);
  }

  /** A cached bundle file by its sha256, or undefined. */
  async file(/** @type {string} */ sha256) {
    return /** @type {Uint8Array | undefined} */ (
      await request(this.db.transaction(FILES, 'readonly').objectStore(FILES).get(sha256))
    );
  }

  /** Keep a bundle file under its sha256 and drop cached files no longer in `keep` (a new bundle's leftovers). */
  async putFile(/** @type {string} */ sha256, /** @type {Uint8Array} */ bytes, /** @type {Set<string>} */ keep) {
    const tx = this.db.transaction(FILES, 'readwrite');
    const files = tx.objectStore(FILES);
    files.put(bytes, sha256);
    const keys = await request(files.getAllKeys());
    for (const key of keys) if (!keep.has(String(key))) files.delete(key);
    await done(tx);
  }

  /** Forget everything this page knows (the person's "start over"). */
  async clear() {
    const tx = this.db.transaction([KV, FILES, SAMPLES], 'readwrite');
    for (const name of [KV, FILES, SAMPLES]) tx.objectStore(name).clear();
    await done(tx);
  }
}

/** Write (value) or delete (undefined) keys of the `kv` store within `tx`. */
function write(/** @type {IDBTransaction} */ tx, /** @type {Saved} */ changes) {
  const kv = tx.objectStore(KV);
  for (const [key, value] of Object.entries(changes)) {
    if (value === undefined) kv.delete(key);
    else kv.put(value, key);
  }
}

/**
 * @template T
 * @param {IDBRequest<T>} req
 * @returns {Promise<T>}
 */
function request(req) {
  return new Promise((resolve, reject) => {
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(storageError(req.error));
  });
}

function done(/** @type {IDBTransaction} */ tx) {
  return /** @type {Promise<void>} */ (
    new Promise((resolve, reject) => {
      tx.oncomplete = () => resolve();
      tx.onerror = () => reject(storageError(tx.error));
      tx.onabort = () => reject(storageError(tx.error));
    })
  );
}

function storageError(/** @type {DOMException | null} */ error) {
  const quota = error && error.name === 'QuotaExceededError';
  return new DeviceError(
    `the browser could not save the device's state (${error ? error.name : 'unknown error'})`,
    quota
      ? 'free some storage on the phone, or remove examples (or forget what the page collected), then reload'
      : 'reload the page; nothing half-written was kept',
  );
}
