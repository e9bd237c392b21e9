// @ts-check
// A sample's targets as every engine weighs them (edgepfl/kinds/base.py target_weights): one label, or a next token
// at each position of a next-word sequence (the manifest's `sample.target_shape`), each weighed 1 in a graph batch
// unless its class is one the loss (`loss_ignores`: <pad>) or the metric (`metric_ignores`: <pad>, <oov>) leaves
// out; padding samples weigh 0. Read from the sample entry, never from the kind's name.

import { sampleEntry } from './manifest.js';

/** @typedef {import('./manifest.js').Manifest} Manifest */

/**
 * @typedef {object} TargetSpec
 * @property {number[]} shape one sample's targets: [] for one label, [seq_len] for a next token at every position
 * @property {number} size their number
 * @property {number[]} lossIgnores classes the loss leaves out
 * @property {number[]} metricIgnores classes the metric leaves out
 */

/** @returns {TargetSpec} */
export function targetSpec(/** @type {Manifest} */ manifest) {
  const sample = sampleEntry(manifest);
  /** @type {number[]} */
  const shape = (sample.target_shape || []).map(Number);
  return {
    shape,
    size: shape.reduce((size, dim) => size * dim, 1),
    lossIgnores: (sample.loss_ignores || []).map(Number),
    metricIgnores: (sample.metric_ignores || []).map(Number),
  };
}

/**
 * The labels and weights of a graph batch of `size` samples: `count` real ones from `start` of y (a sample's
 * targets together), zero-padded; `weights` is the weights' sum (the targets a graph's mean loss is over).
 * @template {{array: any, of: (label: number) => number | bigint}} L
 * @param {TargetSpec} spec
 * @param {L} labels the graphs' label type
 * @param {Int32Array | BigInt64Array} y
 * @param {number} start
 * @param {number} count
 * @param {number} size
 * @param {boolean} scoring weigh as the metric counts (else as the loss does)
 */
export function paddedTargets(spec, labels, y, start, count, size, scoring) {
  const per = spec.size;
  const ignored = scoring ? spec.metricIgnores : spec.lossIgnores;
  const by = new labels.array(size * per);
  const bw = new Float32Array(size * per);
  let weights = 0;
  for (let i = 0; i < count * per; i++) {
    const label = Number(y[start * per + i]);
    by[i] = labels.of(label);
    bw[i] = ignored.includes(label) ? 0 : 1;
    weights += bw[i];
  }
  return { by, bw, weights, shape: [size, ...spec.shape] };
}
