// @ts-check
// The bundle's manifest.json as the page reads it (edgepfl/manifest.py writes it): its types, the portable
// engine's entry and files, the personal spec and the model input's type.

import { EngineError } from './errors.js';

/** One tensor of manifest.json: its role and block (the split) and its shape and dtype. @typedef {{name: string, role: string, block: number, shape: number[], dtype: string}} TensorSpec */
/** The model input (manifest.json `input`; older exports also wrote a `layout`, which the kind says). @typedef {{shape: number[], mean: number[], std: number[], dtype?: string}} InputSpec */
/** A batch of model inputs: float32 pixels or sensor values, or int64 token ids (a text bundle). @typedef {Float32Array | BigInt64Array} ModelInput */
/** A step's frozen variant (export/frozen.py); webgpu_problems: why WebGPU cannot run it whole (export/webgpu.py). @typedef {{model: string, data_location: string, inputs: string[], outputs: string[], initializers: string[], webgpu_problems?: string[]}} FrozenVariant */
/** One graph of the portable engine: state inputs, then x, y, w (and lr); loss, then the new state (updates: the tensor each output after the loss is the new value of; batch_size: the predict graph's 1, up_to: how many inputs it takes one by one). @typedef {{model: string, inputs: string[], outputs: string[], updates?: string[], frozen?: FrozenVariant, webgpu_problems?: string[], batch_size?: number, up_to?: number}} Graph */
/**
 * manifest.json `engines.portable`.
 * @typedef {object} PortableEntry
 * @property {number} batch_size
 * @property {string[]} params
 * @property {string[]} buffers
 * @property {Record<string, Graph>} steps
 * @property {Graph} eval
 * @property {Graph} [predict] the eval graph for one sample (bundles exported since it exists)
 * @property {string} initial
 * @property {'int32' | 'int64'} [label_dtype] the labels' type (int64 before the graphs ran on WebGPU)
 * @property {number | Record<string, number> | number[]} [bn_momentum]
 */
/**
 * The parts of manifest.json the page reads.
 * @typedef {object} Manifest
 * @property {number} kp the trailing blocks whose parameters are all personal (output:K's K)
 * @property {string} [personal] the --personal spec (bundles exported before it have none: output:kp)
 * @property {{index: number}[]} blocks
 * @property {TensorSpec[]} tensors
 * @property {number} num_classes
 * @property {string[]} [class_names] the classes' names, in class order (edgepfl export --class-names)
 * @property {InputSpec} input
 * @property {string} base_layout_hash
 * @property {Record<string, string>} [files] bundle path -> sha256
 * @property {{portable?: PortableEntry}} [engines]
 * @property {SampleEntry} [sample] what the bundle's samples are (its kind and the kind's own fields: kinds.js)
 * @property {SampleEntry} [task] the same, in bundles exported before `sample` (none for an image bundle)
 */
/** What a manifest says of its samples: their kind and the kind's own fields. @typedef {{kind?: string} & Record<string, any>} SampleEntry */

/**
 * What the manifest says of its samples: its `sample` entry, else an older bundle's `task`; `kind` is '' where
 * neither names one (an image bundle exported before `sample`).
 * @param {Pick<Manifest, 'sample' | 'task'>} manifest
 * @returns {{kind: string} & Record<string, any>}
 */
export function sampleEntry(manifest) {
  const entry = manifest.sample || manifest.task || {};
  return { ...entry, kind: String(entry.kind || '') };
}

/** The bundle's personal spec as manifest.py writes it: its `personal`, or output:kp for bundles before specs. */
export function personalSpec(/** @type {Pick<Manifest, 'kp' | 'personal'>} */ manifest) {
  return manifest.personal || `output:${manifest.kp}`;
}

/**
 * The bundle paths of the portable engine (Manifest.portable_files): `required`, its initial tensors, eval and step
 * graphs; `variants`, the steps' frozen variants (export/frozen.py), which an engine uses where it has them.
 */
export function portableFiles(/** @type {Manifest} */ manifest) {
  const entry = portableEntry(manifest);
  const steps = Object.values(entry.steps);
  return {
    required: [
      entry.initial,
      entry.eval.model,
      ...(entry.predict ? [entry.predict.model] : []),
      ...steps.map((step) => step.model),
    ],
    variants: steps.flatMap((step) => (step.frozen && step.frozen.data_location ? [step.frozen.model] : [])),
  };
}

/** The manifest's portable engine entry; a bundle without one throws. */
export function portableEntry(/** @type {Manifest} */ manifest) {
  const entry = manifest.engines && manifest.engines.portable;
  if (!entry)
    throw new EngineError('the bundle has no portable graphs', 'ask the operator to export it with --engines portable');
  return entry;
}

/**
 * Which state tensor each of a step graph's outputs after the loss is the new value of: the graph's `updates` (a
 * step has no output for a tensor it passes through), or every state tensor in order (bundles exported before).
 * @param {Graph} graph
 * @param {string[]} stateNames
 * @returns {Map<string, string>}
 */
export function stepUpdates(graph, stateNames) {
  const outputs = graph.outputs.slice(1);
  const { updates } = graph;
  if (updates === undefined) return new Map(outputs.map((output, i) => [output, stateNames[i]]));
  if (!Array.isArray(updates) || updates.length !== outputs.length || !updates.every((n) => stateNames.includes(n)))
    throw new EngineError(
      `${graph.model}'s manifest entry does not name one of the bundle's tensors for each output`,
      'ask the operator to export the bundle again',
    );
  return new Map(outputs.map((output, i) => [output, updates[i]]));
}

/**
 * The typed array and ONNX type of a bundle's model input: int64 token ids (BigInt64Array) for a text bundle,
 * else float32.
 * @param {InputSpec} input
 * @returns {{dtype: 'float32' | 'int64', array: Float32ArrayConstructor | BigInt64ArrayConstructor}}
 */
export function inputType(input) {
  if (input.dtype === 'int64') return { dtype: 'int64', array: BigInt64Array };
  if (input.dtype && input.dtype !== 'float32') {
    throw new EngineError(
      `the bundle's model input is ${input.dtype}`,
      'export it again: a page runs float32 or int64 (token id) inputs',
    );
  }
  return { dtype: 'float32', array: Float32Array };
}
