// @ts-check
// A device's secure round (edgepfl/secagg/client.py): the client state machine, with JSON state that Python's
// ClientSession reads as well (secagg_round.js takes a saved delta through it).

import { concat, equalBytes, hex } from './bytes.js';
import { SecAggError } from './errors.js';
import { checkPlan, vectorLength } from './secagg_config.js';
import { graphSeed, neighbourMap } from './secagg_graph.js';
import {
  NONCE_BYTES,
  TAG_BYTES,
  agree,
  decrypt,
  derive,
  encrypt,
  info,
  lengthPrefixed,
  publicKey,
  sha256,
  systemRandomBytes,
} from './secagg_keys.js';
import {
  b64,
  b64Map,
  checkName,
  compareIds,
  keyBookFromDict,
  keyBookToDict,
  sameJson,
  unb64,
} from './secagg_messages.js';
import { maskVector, pack } from './secagg_ring.js';
import { PRIME, SECRET_BYTES, SHARE_BYTES, shamirSplit, toBigInt } from './secagg_shamir.js';

/** @typedef {import('./secagg_messages.js').KeyAdvert} KeyAdvert */
/** @typedef {import('./secagg_messages.js').KeyBook} KeyBook */
/** @typedef {import('./secagg_messages.js').ShareBundle} ShareBundle */
/** @typedef {import('./secagg_messages.js').MaskedInput} MaskedInput */
/** @typedef {import('./secagg_messages.js').UnmaskRequest} UnmaskRequest */
/** @typedef {import('./secagg_messages.js').UnmaskShares} UnmaskShares */
/** @typedef {import('./secagg_keys.js').RandomBytes} RandomBytes */

export const SEALED_BYTES = NONCE_BYTES + 2 * SHARE_BYTES + TAG_BYTES;
const PARALLEL_MASKS = 8; // partner masks expanded at once: 8 vectors of 4 bytes per value in memory
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
    const state = {
      device,
      context,
      phase: 'advertised',
      cipher_private: b64(randomBytes(32)),
      mask_private: b64(randomBytes(32)),
    };
    return ClientSession.#withKeys(state);
  }

  /** @param {Record<string, any>} state */
  static async #withKeys(state) {
    const keys = {
      cipherPublic: await publicKey(unb64(state.cipher_private, 'key', 32)),
      maskPublic: await publicKey(unb64(state.mask_private, 'key', 32)),
    };
    return new ClientSession(state, keys);
  }

  get device() {
    return this.state.device;
  }

  get phase() {
    return this.state.phase;
  }

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
      if (!sameJson(this.state.book, keyBookToDict(book)))
        throw new SecAggError(
          `device ${JSON.stringify(me)} already has another key book this round`,
          'the server must send one key book per round',
        );
      return {
        device: me,
        sealed: Object.fromEntries(Object.entries(this.state.bundle).map(([d, s]) => [d, unb64(s, 'sealed share')])),
      };
    }
    if (book.context !== this.state.context)
      throw new SecAggError(
        `the key book is for round ${JSON.stringify(book.context)}, device ${JSON.stringify(me)} is in ${JSON.stringify(this.state.context)}`,
        'send the key book of this round',
      );
    checkPlan(book);
    const mine = book.adverts.find((a) => a.device === me);
    if (
      !mine ||
      !equalBytes(mine.cipher_key, this.keys.cipherPublic) ||
      !equalBytes(mine.mask_key, this.keys.maskPublic)
    ) {
      throw new SecAggError(
        `the key book does not carry device ${JSON.stringify(me)}'s advertised keys`,
        'the server must send every advert unchanged',
      );
    }
    const { indices, neighbours } = await this.#graph(book);
    const group = [me, ...neighbours[me]];
    const holders = group.map((d) => indices[d]);
    const selfSeed = randomBytes(SECRET_BYTES);
    const seedShares = shamirSplit(selfSeed, holders, book.plan.threshold, randomBytes);
    const keyShares = shamirSplit(unb64(this.state.mask_private, 'key', 32), holders, book.plan.threshold, randomBytes);
    const nonces = neighbours[me].map(() => randomBytes(NONCE_BYTES)); // drawn in neighbour order, as Python does
    const sealedList = await Promise.all(
      neighbours[me].map(async (peer, j) => {
        const key = await this.#shareKey(book, peer, me, peer);
        return encrypt(
          key,
          concat(seedShares[indices[peer]], keyShares[indices[peer]]),
          info('share', book.context, me, peer),
          () => nonces[j],
        );
      }),
    );
    /** @type {Record<string, Uint8Array>} */
    const sealed = Object.fromEntries(neighbours[me].map((peer, j) => [peer, sealedList[j]]));
    const own = indices[me];
    Object.assign(this.state, {
      phase: 'shared',
      book: keyBookToDict(book),
      self_seed: b64(selfSeed),
      own_shares: { seed: b64(seedShares[own]), key: b64(keyShares[own]) },
      bundle: b64Map(sealed),
    });
    return { device: me, sealed };
  }

  /** Open the partners' shares and mask `vector` (ring elements of the key book's length). @param {ShareBundle} inbox @param {Uint32Array} vector @returns {Promise<MaskedInput>} */
  async receiveInbox(inbox, vector) {
    this.#need('shared', 'masked', 'revealed');
    const book = this.book,
      me = this.device;
    const digest = await inboxDigest(inbox);
    if (this.phase !== 'shared' && this.state.inbox_digest !== digest)
      throw new SecAggError(
        `device ${JSON.stringify(me)} already masked with other partners this round`,
        'the server must send one share inbox per device per round',
      );
    const received = await this.#openInbox(book, inbox);
    const masked = { device: me, masked: pack(await this.#mask(book, received, vector), book.plan.bits) };
    const maskedDigest = hex(await sha256(masked.masked));
    if (this.phase !== 'shared') {
      if (maskedDigest !== this.state.masked_digest)
        throw new SecAggError(
          `device ${JSON.stringify(me)} already uploaded a different masked vector this round`,
          'upload the same quantized delta again (seed the rounding by the round)',
        );
      return masked;
    }
    Object.assign(this.state, {
      phase: 'masked',
      inbox_digest: digest,
      masked_digest: maskedDigest,
      received: Object.fromEntries(Object.entries(received).map(([d, [s, k]]) => [d, { seed: b64(s), key: b64(k) }])),
    });
    return masked;
  }

  /** Reveal each partner's seed share if it survived, its mask-key share if it dropped; never both. @param {UnmaskRequest} request @returns {UnmaskShares} */
  receiveUnmask(request) {
    this.#need('masked', 'revealed');
    const me = this.device,
      book = this.book;
    const fromState = (/** @type {Record<string, string>} */ items) =>
      Object.fromEntries(Object.entries(items).map(([d, s]) => [d, unb64(s, 'share')]));
    if (this.phase === 'revealed') {
      if (!sameJson(this.state.request, request))
        throw new SecAggError(
          `the server asked device ${JSON.stringify(me)} again with other survivors; it would learn both shares of a device`,
          'the server must send one unmask request per round',
        );
      return {
        device: me,
        seed_shares: fromState(this.state.reveal.seed),
        key_shares: fromState(this.state.reveal.key),
      };
    }
    const survivors = new Set(request.survivors),
      dropped = new Set(request.dropped);
    const both = request.survivors.filter((d) => dropped.has(d)).sort(compareIds);
    const known = new Set(book.adverts.map((a) => a.device));
    const problems = [
      [survivors.size !== request.survivors.length || dropped.size !== request.dropped.length, 'names a device twice'],
      [both.length > 0, `asks for both shares of device ${JSON.stringify(both[0])}`],
      [[...survivors, ...dropped].some((d) => !known.has(d)), 'names devices outside the key book'],
      [!survivors.has(me), `does not list device ${JSON.stringify(me)} among the survivors`],
      [
        survivors.size < book.plan.min_survivors,
        `lists ${survivors.size} survivors, fewer than the ${book.plan.min_survivors} the round needs`,
      ],
      [this.partners.some((d) => !survivors.has(d) && !dropped.has(d)), 'leaves out a partner that sent its shares'],
    ];
    for (const [bad, problem] of problems) {
      if (bad)
        throw new SecAggError(
          `the unmask request to device ${JSON.stringify(me)} ${problem}`,
          'the server must list each device that sent shares once: survivor or dropped',
        );
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
    Object.assign(this.state, {
      phase: 'revealed',
      request: { survivors: [...request.survivors], dropped: [...request.dropped] },
      reveal: { seed, key },
    });
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
      if (state.type !== 'ClientSession' || state.version !== 1 || !PHASES.includes(state.phase))
        throw new Error('not a client session');
      delete state.type;
      delete state.version;
      checkName(state.device, 'device id');
      const session = await ClientSession.#withKeys(state);
      if (session.phase !== 'advertised') checkPlan(session.book);
      return session;
    } catch {
      throw new SecAggError(
        'the saved secure-aggregation state of this device cannot be read',
        "drop this round's state; the device rejoins the next round",
      );
    }
  }

  /** Indices and neighbours of the session's key book (computed once). @param {KeyBook} book */
  async #graph(book) {
    if (this.graph && book === this.parsedBook) return this.graph;
    const devices = book.adverts.map((a) => a.device);
    /** @type {Record<string, number>} */
    const indices = Object.fromEntries(devices.map((d, i) => [d, i + 1]));
    const graph = graphSeed(book).then(async (seed) => ({
      indices,
      neighbours: await neighbourMap(devices, seed, book.plan.neighbours),
    }));
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
    if (inbox.device !== me)
      throw new SecAggError(
        `device ${JSON.stringify(me)} got the share inbox of ${JSON.stringify(inbox.device)}`,
        'route each inbox to its device',
      );
    const { neighbours } = await this.#graph(book);
    const strangers = Object.keys(inbox.sealed)
      .filter((d) => !neighbours[me].includes(d))
      .sort(compareIds);
    if (strangers.length)
      throw new SecAggError(
        `device ${JSON.stringify(me)} got shares from ${JSON.stringify(strangers[0])}, which is not its neighbour`,
        'route only shares between neighbours',
      );
    if (Object.keys(inbox.sealed).length + 1 < book.plan.threshold)
      throw new SecAggError(
        `only ${Object.keys(inbox.sealed).length} neighbours of device ${JSON.stringify(me)} sent shares; its group cannot reach the threshold ${book.plan.threshold}`,
        'this device sits this round out',
      );
    /** @type {Record<string, [Uint8Array, Uint8Array]>} */
    const received = {};
    for (const peer of Object.keys(inbox.sealed).sort(compareIds)) {
      const what = `the shares from ${JSON.stringify(peer)} to ${JSON.stringify(me)}`;
      const plain = await decrypt(
        await this.#shareKey(book, peer, peer, me),
        inbox.sealed[peer],
        info('share', book.context, peer, me),
        what,
      );
      if (
        plain.length !== 2 * SHARE_BYTES ||
        toBigInt(plain.subarray(0, SHARE_BYTES)) >= PRIME ||
        toBigInt(plain.subarray(SHARE_BYTES)) >= PRIME
      ) {
        throw new SecAggError(`${what} are not two shares in the field`, 'seal two 33-byte shares');
      }
      received[peer] = [plain.slice(0, SHARE_BYTES), plain.slice(SHARE_BYTES)];
    }
    return received;
  }

  /** @param {KeyBook} book @param {Record<string, unknown>} partners @param {Uint32Array} vector */
  async #mask(book, partners, vector) {
    const bits = book.plan.bits,
      length = vectorLength(book),
      me = this.device;
    const modulus = 2 ** bits;
    if (!(vector instanceof Uint32Array) || vector.length !== length || vector.some((v) => v >= modulus)) {
      throw new SecAggError(
        `device ${JSON.stringify(me)}'s ring vector is not ${length} integers in [0, 2^${bits})`,
        'quantize with quantizeDelta for this key book',
      );
    }
    const { indices } = await this.#graph(book);
    const masked = Uint32Array.from(vector);
    const own = await maskVector(unb64(this.state.self_seed, 'seed', 32), length, bits);
    for (let i = 0; i < length; i++) masked[i] += own[i];
    const maskPrivate = unb64(this.state.mask_private, 'key', 32);
    const peers = Object.keys(partners).sort(compareIds);
    for (let first = 0; first < peers.length; first += PARALLEL_MASKS) {
      // WebCrypto works on other threads
      const batch = peers.slice(first, first + PARALLEL_MASKS);
      const masks = await Promise.all(
        batch.map(async (peer) => {
          const advert = /** @type {KeyAdvert} */ (book.adverts.find((a) => a.device === peer));
          const [low, high] = indices[me] < indices[peer] ? [me, peer] : [peer, me];
          const seed = await derive(await agree(maskPrivate, advert.mask_key, peer), 'mask', book.context, low, high);
          return maskVector(seed, length, bits);
        }),
      );
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
    if (!phases.includes(this.phase))
      throw new SecAggError(
        `device ${JSON.stringify(this.device)} is at step ${JSON.stringify(this.phase)} of secure aggregation, this message belongs to step ${phases.join(' or ')}`,
        'send the messages in protocol order',
      );
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
