// @ts-check
// One device's secure aggregation in one round, timed (bench/secagg.py): key pairs, sharing with its neighbours,
// quantizing a base delta of d values, masking with its partners and revealing, each the median over TIMED devices.
// The round's other devices do their part untimed, in a call of their own, so that a caller can slow the CPU only
// around the timed calls (bench/secagg.py --phone: chromium emulating a phone). Under Node: bench/web/secagg.mjs.

import { ClientSession, quantizeDelta, uniformRandom } from '../../device_runtime/web/src/secagg.js';

export const TIMED = 3;
const STAGES = /** @type {const} */ (['keygen_s', 'share_s', 'quantize_s', 'mask_s', 'reveal_s']);

/** @typedef {{config: any, plan: any, base_size: number}} RoundArguments the key book's settings, plan and d */

export class TimedRound {
  /** @param {RoundArguments} args */
  constructor({ config, plan, base_size: size }) {
    this.context = 'bench/round-1';
    this.ids = Array.from({ length: plan.devices }, (_, i) => `phone-${String(i).padStart(4, '0')}`);
    this.config = config;
    this.plan = plan;
    this.size = size;
    /** @type {Record<string, number[]>} */
    this.times = Object.fromEntries(STAGES.map((stage) => [stage, []]));
    /** @type {ClientSession[]} */
    this.sessions = [];
    /** @type {any[]} */
    this.bundles = [];
    /** @type {any} */
    this.book = null;
  }

  /** @template T @param {string} stage @param {() => Promise<T>} work */
  async timed(stage, work) {
    const start = performance.now();
    const result = await work();
    this.times[stage].push((performance.now() - start) / 1000);
    return result;
  }

  /** Every device's key pairs (the first TIMED timed) and the round's key book. */
  async keys() {
    for (const [i, id] of this.ids.entries()) {
      const start = () => ClientSession.start(id, this.context);
      this.sessions.push(i < TIMED ? await this.timed('keygen_s', start) : await start());
    }
    const adverts = this.sessions.map((session) => session.advert());
    this.book = { context: this.context, config: this.config, randomness: new Uint8Array(32).fill(7), adverts, plan: this.plan, base_size: this.size };
  }

  /** The untimed devices' sealed shares. */
  async shareOthers() {
    this.bundles = new Array(this.sessions.length);
    for (const [i, session] of this.sessions.entries()) if (i >= TIMED) this.bundles[i] = await session.receiveBook(this.book);
  }

  /** The timed devices' sharing, then each one's quantizing, masking and revealing; the medians. */
  async timedRest() {
    for (let i = 0; i < TIMED; i++) this.bundles[i] = await this.timed('share_s', () => this.sessions[i].receiveBook(this.book));
    const next = uniformRandom([1]);
    const delta = { base: { shape: [this.size], data: Float32Array.from({ length: this.size }, () => (next() - 0.5) * 0.004) } };
    let partners = 0;
    for (const session of this.sessions.slice(0, TIMED)) {
      /** @type {{device: string, sealed: Record<string, any>}} */
      const inbox = { device: session.device, sealed: {} };
      for (const bundle of this.bundles) if (session.device in bundle.sealed) inbox.sealed[bundle.device] = bundle.sealed[session.device];
      partners = Object.keys(inbox.sealed).length;
      const vector = await this.timed('quantize_s', () => quantizeDelta(delta, 100, this.book, uniformRandom([2])));
      await this.timed('mask_s', () => session.receiveInbox(inbox, vector));
      await this.timed('reveal_s', async () => session.receiveUnmask({ survivors: this.ids, dropped: [] }));
    }
    /** @param {number[]} values */
    const median = (values) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)];
    const result = Object.fromEntries(STAGES.map((stage) => [stage, median(this.times[stage])]));
    const total = Object.values(result).reduce((a, b) => a + b, 0);
    return { partners, devices_timed: TIMED, ...result, total_s: total };
  }
}
