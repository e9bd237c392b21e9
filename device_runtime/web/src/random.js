// @ts-check
// numpy's seeded shuffling, reproduced: SeedSequence, the PCG64 bit generator and Generator.permutation.
// With it the browser device splits its data and orders its batches exactly as the Python device
// (edgepfl/data.py split_train_val, iterate_batches; algorithms.py round_seed) for the same seeds.

const MASK32 = 0xffffffff;
const INIT_A = 0x43b0d7e5,
  MULT_A = 0x931e8875,
  INIT_B = 0x8b51f9dd,
  MULT_B = 0x58f38ded;
const MIX_MULT_L = 0xca01f9dd,
  MIX_MULT_R = 0x4973f715,
  XSHIFT = 16,
  POOL_SIZE = 4;
const MASK64 = (1n << 64n) - 1n;
const MASK128 = (1n << 128n) - 1n;
const PCG_MULT = (0x2360ed051fc65da4n << 64n) | 0x4385df649fccf645n;

const mul32 = (/** @type {number} */ a, /** @type {number} */ b) => Math.imul(a, b) >>> 0;

/** A non-negative integer seed, or a list of them (numpy's entropy). @typedef {number | bigint | (number | bigint)[]} Entropy */

/** The uint32 words numpy makes of a non-negative integer or a list of them (least significant first). */
function entropyWords(/** @type {Entropy} */ entropy) {
  /** @type {number[]} */
  const words = [];
  for (const value of Array.isArray(entropy) ? entropy : [entropy]) {
    let n = BigInt(value);
    if (n < 0n) throw new RangeError(`seed ${value} is negative; seeds are non-negative integers`);
    if (n === 0n) words.push(0);
    while (n > 0n) {
      words.push(Number(n & 0xffffffffn));
      n >>= 32n;
    }
  }
  return words;
}

/** numpy.random.SeedSequence(entropy).generate_state(nWords) as uint32 numbers. */
export function seedSequenceState(/** @type {Entropy} */ entropy, /** @type {number} */ nWords) {
  const words = entropyWords(entropy);
  let hashConst = INIT_A;
  const hashmix = (/** @type {number} */ value) => {
    value = (value ^ hashConst) >>> 0;
    hashConst = mul32(hashConst, MULT_A);
    value = mul32(value, hashConst);
    return (value ^ (value >>> XSHIFT)) >>> 0;
  };
  const mix = (/** @type {number} */ x, /** @type {number} */ y) => {
    const result = (mul32(MIX_MULT_L, x) - mul32(MIX_MULT_R, y)) >>> 0;
    return (result ^ (result >>> XSHIFT)) >>> 0;
  };
  /** @type {number[]} */
  const pool = [];
  for (let i = 0; i < POOL_SIZE; i++) pool.push(hashmix(i < words.length ? words[i] : 0));
  for (let src = 0; src < POOL_SIZE; src++) {
    for (let dst = 0; dst < POOL_SIZE; dst++) if (src !== dst) pool[dst] = mix(pool[dst], hashmix(pool[src]));
  }
  for (let src = POOL_SIZE; src < words.length; src++) {
    for (let dst = 0; dst < POOL_SIZE; dst++) pool[dst] = mix(pool[dst], hashmix(words[src]));
  }
  let outConst = INIT_B;
  /** @type {number[]} */
  const state = [];
  for (let i = 0; i < nWords; i++) {
    let value = (pool[i % POOL_SIZE] ^ outConst) >>> 0;
    outConst = mul32(outConst, MULT_B);
    value = mul32(value, outConst);
    state.push((value ^ (value >>> XSHIFT)) >>> 0);
  }
  return state;
}

/** numpy's PCG64 seeded like numpy.random.default_rng(entropy). */
export class PCG64 {
  constructor(/** @type {Entropy} */ entropy) {
    const w = seedSequenceState(entropy, 8).map(BigInt);
    const u64 = (/** @type {number} */ i) => (w[2 * i + 1] << 32n) | w[2 * i];
    const initState = (u64(0) << 64n) | u64(1);
    const initSeq = (u64(2) << 64n) | u64(3);
    this.inc = ((initSeq << 1n) | 1n) & MASK128;
    this.state = 0n;
    this.step();
    this.state = (this.state + initState) & MASK128;
    this.step();
    /** @type {number | null} */
    this.spare = null; // numpy hands out the high half of a 64-bit draw as the next 32-bit one
  }

  step() {
    this.state = (this.state * PCG_MULT + this.inc) & MASK128;
  }

  next64() {
    this.step();
    const value = ((this.state >> 64n) ^ this.state) & MASK64;
    const rot = this.state >> 122n;
    return ((value >> rot) | (value << ((64n - rot) & 63n))) & MASK64;
  }

  next32() {
    if (this.spare !== null) {
      const spare = this.spare;
      this.spare = null;
      return spare;
    }
    const value = this.next64();
    this.spare = Number(value >> 32n);
    return Number(value & 0xffffffffn);
  }

  /** A uniform integer in [0, max] by masked rejection, as numpy's random_interval. */
  interval(/** @type {number} */ max) {
    if (max === 0) return 0;
    if (max > MASK32) throw new RangeError('permutations longer than 2**32 are not supported');
    let mask = max;
    for (const shift of [1, 2, 4, 8, 16]) mask |= mask >>> shift;
    mask >>>= 0;
    let value;
    do value = (this.next32() & mask) >>> 0;
    while (value > max);
    return value;
  }
}

/** numpy.random.default_rng(entropy).permutation(n) as an Int32Array. */
export function permutation(/** @type {number} */ n, /** @type {Entropy} */ entropy) {
  const rng = new PCG64(entropy);
  const order = new Int32Array(n);
  for (let i = 0; i < n; i++) order[i] = i;
  for (let i = n - 1; i >= 1; i--) {
    const j = rng.interval(i);
    const t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  return order;
}
