// @ts-check
// The steps' frozen variants (export/frozen.py): a step graph with its frozen tensors baked in as constants, built
// once the same frozen tensors have run BAKE_AFTER_STEPS plain steps, and rebuilt when they change
// (portable_engine.py _baked_session).

import { concat } from './bytes.js';
import { EngineError, describe } from './errors.js';
import { inMemory } from './sessions.js';

/** @typedef {import('onnxruntime-web').Tensor} OrtTensor */
/** @typedef {import('./manifest.js').FrozenVariant} FrozenVariant */
/** @typedef {import('./sessions.js').Opened} Opened */
/** @typedef {import('./sessions.js').Sessions} Sessions */

/** Plain steps on the same frozen tensors before a step's frozen variant is built (portable_engine.py BAKE_AFTER_STEPS). */
export const BAKE_AFTER_STEPS = 2;

/** The frozen variants of one engine's steps, by step key, and the plain steps run towards each. */
export class FrozenVariants {
  /**
   * @param {Map<string, Uint8Array>} variants bytes of the frozen variants, kept: one is rebuilt whenever its frozen
   *   tensors change
   * @param {Sessions} sessions where a variant's session is opened
   */
  constructor(variants, sessions) {
    this.variants = variants;
    this.sessions = sessions;
    /** @type {Map<string, {values: OrtTensor[], steps: number}>} step key -> plain steps run on these frozen tensors */
    this.plainOn = new Map();
    /** @type {Map<string, {opened: Opened, values: OrtTensor[]}>} step key -> the variant built on these frozen tensors */
    this.baked = new Map();
    this.steps = 0; // steps run on a frozen variant, for tests and benchmarks
  }

  /** Whether the bundle's files held this frozen variant. @param {FrozenVariant} frozen */
  has(frozen) {
    return this.variants.has(frozen.model);
  }

  /**
   * The step's frozen variant built on the frozen tensors `values`, or null for the plain graph. It is built
   * after BAKE_AFTER_STEPS plain steps on them, so a caller that changes them every step (or trains a set for a
   * step or two) never pays for a build, and a seeded run takes the same graphs every time
   * (portable_engine.py _baked_session). onnxruntime-web takes the frozen tensors as the variant's one external
   * data file: their bytes laid end to end in the variant's order (export/frozen.py).
   * @param {string} key
   * @param {FrozenVariant} frozen
   * @param {OrtTensor[]} values
   * @returns {Promise<Opened | null>}
   */
  async session(key, frozen, values) {
    const built = this.baked.get(key);
    if (built && sameTensors(built.values, values)) return built.opened;
    if (built) {
      this.baked.delete(key); // its frozen tensors changed: free its memory before building another
      await built.opened.session.release();
    }
    const held = this.plainOn.get(key);
    if (!held || !sameTensors(held.values, values) || held.steps < BAKE_AFTER_STEPS) return null;
    for (const t of values) await inMemory(t); // read back once: the variant holds them from now on
    const arrays = values.map((t) => /** @type {import('./safetensors.js').TypedArray} */ (t.data));
    const data = concat(...arrays.map((a) => new Uint8Array(a.buffer, a.byteOffset, a.byteLength)));
    let opened;
    try {
      const extra = { externalData: [{ path: frozen.data_location, data }] };
      opened = await this.sessions.open(
        frozen.model,
        /** @type {Uint8Array} */ (this.variants.get(frozen.model)),
        frozen,
        extra,
      );
    } catch (err) {
      throw new EngineError(
        `the frozen variant ${frozen.model} does not load (${describe(err).split('\n')[0].slice(0, 200)})`,
        're-export the bundle, or export it with --no-frozen-variants',
      );
    }
    this.baked.set(key, { opened, values });
    return opened;
  }

  /** Count a step run on the variant (`baked`) or a plain step on the frozen tensors `values`. @param {string} key @param {OrtTensor[]} values @param {boolean} baked */
  ran(key, values, baked) {
    if (baked) {
      this.steps += 1;
      return;
    }
    const held = this.plainOn.get(key);
    this.plainOn.set(key, { values, steps: held && sameTensors(held.values, values) ? held.steps + 1 : 1 });
  }

  /** Free the variants' sessions. */
  async release() {
    for (const { opened } of this.baked.values()) await opened.session.release();
    this.baked.clear();
  }
}

/** Whether two lists hold the very same tensor objects (state is replaced, never written in place; portable_engine.py _same). */
function sameTensors(/** @type {OrtTensor[]} */ held, /** @type {OrtTensor[]} */ current) {
  return held.length === current.length && held.every((t, i) => t === current[i]);
}
