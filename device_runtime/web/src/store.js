// What the page keeps in the browser (IndexedDB): its token and enrollment key, its tensors (personal, base and
// BatchNorm buffers), the round it is in, an upload not yet acknowledged, its examples and the bundle files.
//
// Every change that belongs together is ONE transaction (`commit`), so a tab killed at any moment leaves the
// state before or after it, never half of it: e.g. a trained round's tensors, `lastCompletedRound` and the
// pending upload's bytes are written together, and the upload is only ever sent from those saved bytes.

const DB_NAME = 'edgepfl-device';
const DB_VERSION = 1;
const KV = 'kv'; // key -> value: creds, tensors, progress, examples, history, round
const FILES = 'files'; // sha256 -> bytes of a bundle file (downloaded once, checked before use)

/** Keys of the `kv` store. */
export const KEYS = Object.freeze({
  creds: 'creds', // {device, key, secret?, token?}: the secret is dropped once the token is held
  tensors: 'tensors', // {layout, tensors: {name: {dtype, shape, data}}}: every param and buffer after the last round
  progress: 'progress', // {layout, lastCompletedRound, lastUploadedRound, pending: {round, payload, sha256} | null}
  round: 'round', // {round, startedAt}: the round being trained (restarted from its base after a reload)
  history: 'history', // [{round, beforeAccuracy, accuracy, loss, trainLoss, samples, upload}] newest last
  examples: 'examples', // {pixels: Uint8Array(N*C*H*W), labels: Int32Array(N), count, shape}
  // {name: {shape, data: Float32Array}}: what the encoded uploads owe (error feedback), committed with its round;
  // a pending upload keeps the one before it (`residualBefore`), restored if the server drops that upload
  residual: 'residual',
});

/** The page's IndexedDB database; resolves once it is open (and upgraded if new). */
export async function openStore(indexedDB = globalThis.indexedDB) {
  if (!indexedDB) throw Object.assign(new Error('this browser keeps no IndexedDB storage for the page'), { fix: 'leave private browsing mode, or use a current Chrome or Safari' });
  const db = await request(
    (() => {
      const opening = indexedDB.open(DB_NAME, DB_VERSION);
      opening.onupgradeneeded = () => {
        const database = opening.result;
        if (!database.objectStoreNames.contains(KV)) database.createObjectStore(KV);
        if (!database.objectStoreNames.contains(FILES)) database.createObjectStore(FILES);
      };
      return opening;
    })(),
  );
  return new Store(db);
}

class Store {
  constructor(db) {
    this.db = db;
  }

  /** The values of some keys of the `kv` store, read in one transaction: {key: value | undefined}. */
  async get(...keys) {
    const tx = this.db.transaction(KV, 'readonly');
    const values = await Promise.all(keys.map((key) => request(tx.objectStore(KV).get(key))));
    return Object.fromEntries(keys.map((key, i) => [key, values[i]]));
  }

  /** Write (value) or delete (undefined) several keys in ONE durable transaction; resolves once it is committed. */
  async commit(changes) {
    const tx = this.db.transaction(KV, 'readwrite', { durability: 'strict' });
    const kv = tx.objectStore(KV);
    for (const [key, value] of Object.entries(changes)) {
      if (value === undefined) kv.delete(key);
      else kv.put(value, key);
    }
    await done(tx);
  }

  /** A cached bundle file by its sha256, or undefined. */
  async file(sha256) {
    return request(this.db.transaction(FILES, 'readonly').objectStore(FILES).get(sha256));
  }

  /** Keep a bundle file under its sha256 and drop cached files no longer in `keep` (a new bundle's leftovers). */
  async putFile(sha256, bytes, keep) {
    const tx = this.db.transaction(FILES, 'readwrite');
    const files = tx.objectStore(FILES);
    files.put(bytes, sha256);
    const keys = await request(files.getAllKeys());
    for (const key of keys) if (!keep.has(key)) files.delete(key);
    await done(tx);
  }

  /** Forget everything this page knows (the person's "start over"). */
  async clear() {
    const tx = this.db.transaction([KV, FILES], 'readwrite');
    tx.objectStore(KV).clear();
    tx.objectStore(FILES).clear();
    await done(tx);
  }
}

function request(req) {
  return new Promise((resolve, reject) => {
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(storageError(req.error));
  });
}

function done(tx) {
  return new Promise((resolve, reject) => {
    tx.oncomplete = () => resolve();
    tx.onerror = () => reject(storageError(tx.error));
    tx.onabort = () => reject(storageError(tx.error));
  });
}

function storageError(error) {
  const quota = error && error.name === 'QuotaExceededError';
  return Object.assign(new Error(`the browser could not save the device's state (${error ? error.name : 'unknown error'})`), {
    fix: quota ? 'free some storage on the phone, or remove examples, then reload' : 'reload the page; nothing half-written was kept',
  });
}
