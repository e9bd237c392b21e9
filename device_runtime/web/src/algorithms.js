// @ts-check
// Client algorithms of one round (fedsim, fedalt, local, personal fine-tuning) over the browser engine,
// mirroring device_runtime/algorithms.py run_client_round: the same phases (read from the device contract,
// which Python writes from its algorithms' declarations), the same epoch numbering and, through random.js,
// the same seeded batch order and train/held-out split as the Python device.

import { roundSettings } from './contract.js';
import { EngineError } from './engine.js';
import { permutation, seedSequenceState } from './random.js';
import { numel } from './safetensors.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./contract.js').RoundSettings} RoundSettings */
/** @typedef {import('./engine.js').Engine} Engine */
/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./safetensors.js').Tensors} Tensors */
/**
 * Pre-processed examples: `count` samples of x (float32 C*H*W or C*T each, or int64 token ids) and their labels.
 * @typedef {{x: import('./engine.js').ModelInput, y: Int32Array, count: number}} Samples y: each sample's targets,
 * one label or a next token at every position (all of one sample's together)
 */
/** @typedef {{name: string, trainable: string, epochs: number, lr: number}} Phase */
/** @typedef {{name: string, trainable: string, epochs: number, steps: number, meanLoss: number}} PhaseLog */
/** @typedef {{trainLoss: number, numSamples: number, uploads: boolean, phases: PhaseLog[]}} ClientResult */
/** @typedef {{phase: string, epoch: number, step: number, steps: number, loss: number}} StepProgress */

/** The contract's algorithm of that name; an unknown one throws (algorithms.py client_algorithm). */
export function clientAlgorithm(/** @type {Contract} */ contract, /** @type {string} */ name) {
  const algorithm = Object.hasOwn(contract.algorithms, name) ? contract.algorithms[name] : undefined;
  if (!algorithm) {
    throw new EngineError(
      `unknown client algorithm ${JSON.stringify(name)}`,
      `the server must send one of: ${Object.keys(contract.algorithms).join(', ')}`,
    );
  }
  return algorithm;
}

/** Whether the round ends with an upload (every algorithm but local). */
export function roundUploads(/** @type {Contract} */ contract, /** @type {object} */ settingsJson) {
  return clientAlgorithm(contract, roundSettings(contract, settingsJson).algorithm).uploads;
}

/**
 * Fine-tuning then the algorithm's phases, without empty phases or sets the bundle lacks (round_phases).
 * @param {Contract} contract
 * @param {object} settingsJson
 * @param {readonly string[]} availableSets
 * @returns {Phase[]}
 */
export function roundPhases(contract, settingsJson, availableSets) {
  const settings = roundSettings(contract, settingsJson);
  const algorithm = clientAlgorithm(contract, settings.algorithm);
  const planned = [contract.finetune_phase, ...algorithm.phases].map((p) => ({
    name: p.name,
    trainable: p.trainable,
    epochs: Number(settings[p.epochs]),
    // the phase's own learning rate (fedalt's personal_lr) where the settings give one, else the shared lr
    lr: Number(settings[p.lr ?? 'lr'] ?? settings.lr),
  }));
  if (settings.algorithm === 'local' && !availableSets.includes('personal')) {
    throw new EngineError(
      'the local algorithm trains personal tensors, and this bundle has none (kp=0)',
      'export with --kp 1 or more (or a --personal spec)',
    );
  }
  return planned.filter(({ trainable, epochs }) => epochs > 0 && availableSets.includes(trainable));
}

/**
 * The shared tensors that travel this round: base (+ base-layer buffers when share_buffers) minus kept_on_device.
 * @param {Pick<Manifest, 'tensors'>} manifest
 * @param {{share_buffers?: boolean, kept_on_device?: string[]}} settings
 */
export function travellingNames(manifest, settings) {
  const shared = [
    ...manifest.tensors.filter((t) => t.role === 'base'),
    ...(settings.share_buffers ? baseBuffers(manifest) : []),
  ];
  const kept = new Set(settings.kept_on_device);
  return shared.map((t) => t.name).filter((name) => !kept.has(name));
}

/**
 * Buffers of base layers (manifest.py Manifest.base_buffers): a buffer goes with its layer's parameters (a BatchNorm
 * whose weight is personal keeps its statistics), else with its block (personal if the block holds a personal tensor).
 * @param {Pick<Manifest, 'tensors'>} manifest
 */
export function baseBuffers(manifest) {
  const layerOf = (/** @type {string} */ name) => name.slice(0, Math.max(0, name.lastIndexOf('.')));
  /** @type {Map<string, boolean>} */
  const layerPersonal = new Map();
  for (const t of manifest.tensors) {
    if (t.role !== 'buffer')
      layerPersonal.set(layerOf(t.name), Boolean(layerPersonal.get(layerOf(t.name))) || t.role === 'personal');
  }
  const personalBlocks = new Set(manifest.tensors.filter((t) => t.role === 'personal').map((t) => t.block));
  return manifest.tensors.filter((t) => {
    if (t.role !== 'buffer') return false;
    const layer = layerOf(t.name);
    return layerPersonal.has(layer) ? !layerPersonal.get(layer) : !personalBlocks.has(t.block);
  });
}

/** The shuffling seed of one round (algorithms.py round_seed): distinct per (device seed, round), as in Python. */
export function roundSeed(/** @type {number} */ seed, /** @type {number} */ roundId) {
  return seedSequenceState([seed, roundId], 1)[0];
}

/**
 * Seeded split of n sample indices into {train, val}, both sorted, train never empty (data.py split_train_val).
 * @param {number} n
 * @param {number} valFraction
 * @param {number} seed
 */
export function splitTrainVal(n, valFraction, seed) {
  if (!(valFraction >= 0 && valFraction < 1))
    throw new EngineError(`validation fraction ${valFraction} is outside [0, 1)`, 'use e.g. 0.2');
  if (n < 1) throw new EngineError('the data holds no samples', 'add at least one labelled example');
  const nVal = heldOutCount(n, valFraction);
  const order = permutation(n, seed);
  const sorted = (/** @type {ArrayLike<number>} */ a) => Int32Array.from(a).sort();
  return { train: sorted(order.subarray(nVal)), val: sorted(order.subarray(0, nVal)) };
}

/** The samples at `positions`, in their order. */
export function pickSamples(/** @type {Samples} */ samples, /** @type {ArrayLike<number>} */ positions) {
  const size = samples.count ? samples.x.length / samples.count : 0;
  const per = samples.count ? samples.y.length / samples.count : 1; // a sample's targets
  const x = new /** @type {any} */ (samples.x.constructor)(positions.length * size);
  const y = new Int32Array(positions.length * per);
  Array.from(positions).forEach((at, i) => {
    x.set(/** @type {any} */ (samples.x).subarray(at * size, (at + 1) * size), i * size);
    y.set(samples.y.subarray(at * per, (at + 1) * per), i * per);
  });
  /** @type {Samples} */
  const picked = { x, y, count: positions.length };
  return picked;
}

/** How many of n samples splitTrainVal holds out (at least one of two or more, never all). */
export function heldOutCount(/** @type {number} */ n, /** @type {number} */ valFraction) {
  const nVal = Math.min(roundHalfEven(n * valFraction), n - 1);
  return valFraction > 0 && n >= 2 ? Math.max(nVal, 1) : Math.max(nVal, 0);
}

/**
 * Positions 0..n-1 in batches, shuffled by (seed, epoch); the last partial batch included (data.py iterate_batches).
 * @param {number} n
 * @param {number} batchSize
 * @param {number} seed
 * @param {number} epoch
 */
export function batchOrder(n, batchSize, seed, epoch) {
  const order = permutation(n, [seed, epoch]);
  const batches = [];
  for (let start = 0; start < n; start += batchSize) batches.push(order.subarray(start, start + batchSize));
  return batches;
}

/**
 * One client round on an engine that already holds the round's base. train: {x: Float32Array of count
 * pre-processed samples, y: Int32Array, count}. seed: the device's seed; roundId: the round (together they
 * seed the batch order as round_seed does). Returns {trainLoss, numSamples, uploads, phases}.
 * @param {Contract} contract
 * @param {Engine} engine
 * @param {Samples} train
 * @param {object} settingsJson
 * @param {{seed: number, roundId?: number, onProgress?: ((progress: StepProgress) => void) | null}} options
 * @returns {Promise<ClientResult>}
 */
export async function runClientRound(contract, engine, train, settingsJson, { seed, roundId = 0, onProgress = null }) {
  const settings = roundSettings(contract, settingsJson);
  if (!Number.isSafeInteger(seed) || seed < 0)
    throw new EngineError(
      `device seed ${seed} is not a non-negative integer`,
      'pass the seed the device was set up with',
    );
  if (!(Number.isInteger(settings.batch_size) && settings.batch_size >= 1))
    throw new EngineError(
      `batch size ${settings.batch_size} is not positive`,
      'the server must send a batch size of at least 1',
    );
  if (settings.batch_size > engine.batchSize) {
    throw new EngineError(
      `the round's batch size ${settings.batch_size} exceeds the portable graphs' batch size ${engine.batchSize}`,
      `run rounds with batch_size <= ${engine.batchSize} or re-export with a larger portable batch`,
    );
  }
  const phases = roundPhases(contract, settings, engine.trainableSets());
  const perEpoch = Math.ceil(train.count / settings.batch_size);
  const steps = phases.reduce((sum, p) => sum + p.epochs, 0) * perEpoch;
  const shuffleSeed = roundSeed(seed, roundId);
  const sample = engine.sampleSize;
  const per = engine.targetSize;
  /** @type {PhaseLog[]} */
  const logs = [];
  let done = 0;
  let epoch = 0;
  for (const phase of phases) {
    /** @type {number[]} */
    const losses = [];
    for (let e = epoch; e < epoch + phase.epochs; e++) {
      for (const positions of batchOrder(train.count, settings.batch_size, shuffleSeed, e)) {
        const x = new engine.inputType.array(positions.length * sample);
        const y = new Int32Array(positions.length * per);
        positions.forEach((p, i) => {
          x.set(/** @type {any} */ (train.x).subarray(p * sample, (p + 1) * sample), i * sample);
          y.set(train.y.subarray(p * per, (p + 1) * per), i * per);
        });
        const loss = await engine.trainStep(x, y, positions.length, phase.lr, phase.trainable);
        losses.push(loss);
        done += 1;
        if (onProgress) onProgress({ phase: phase.name, epoch: e, step: done, steps, loss });
      }
    }
    epoch += phase.epochs;
    logs.push({
      name: phase.name,
      trainable: phase.trainable,
      epochs: phase.epochs,
      steps: losses.length,
      meanLoss: mean(losses),
    });
  }
  return {
    trainLoss: logs.length ? logs[logs.length - 1].meanLoss : NaN,
    numSamples: train.count,
    uploads: clientAlgorithm(contract, settings.algorithm).uploads,
    phases: logs,
  };
}

/**
 * Why a training result must not be kept (`loss NaN`, `loss 3.4e+33`, `NaN or Inf in "w"`), or null
 * (algorithms.py divergence): a loss that is not finite or above `lossFactor` * max(ln(classes), 1), or a
 * floating-point tensor holding NaN or Inf.
 * @param {number[]} losses
 * @param {Tensors} tensors
 * @param {number} numClasses
 * @param {number} lossFactor the device contract's divergence.loss_factor
 */
export function divergence(losses, tensors, numClasses, lossFactor) {
  const limit = lossFactor * Math.max(Math.log(numClasses), 1);
  for (const loss of losses) {
    if (!Number.isFinite(loss) || loss > limit)
      return Number.isNaN(loss) ? 'loss NaN' : `loss ${Number(loss.toPrecision(3))}`;
  }
  const bad = nonfiniteNames(tensors);
  return bad.length ? `NaN or Inf in ${JSON.stringify(bad[0])}` : null;
}

/** The losses a round measured: each phase's mean training loss, and the held-out loss after training (round_losses). */
export function roundLosses(/** @type {ClientResult} */ result, /** @type {{lossSum: number, count: number}} */ after) {
  const measured = result.phases.filter((log) => log.steps).map((log) => log.meanLoss);
  return after.count ? [...measured, after.lossSum / after.count] : measured;
}

/** Names of the floating-point tensors holding a NaN or an Inf, in the object's order (wire.py nonfinite_names). */
export function nonfiniteNames(/** @type {Tensors} */ tensors) {
  return Object.keys(tensors).filter((name) => !finite(tensors[name]));
}

/** Whether a tensor holds no NaN or Inf (half floats held as their bits: an all-ones exponent); integers always do. */
function finite(/** @type {import('./safetensors.js').Tensor} */ { dtype, data }) {
  if (dtype === 'float16') return /** @type {Uint16Array} */ (data).every((bits) => (bits & 0x7c00) !== 0x7c00);
  if (dtype === 'bfloat16') return /** @type {Uint16Array} */ (data).every((bits) => (bits & 0x7f80) !== 0x7f80);
  if (dtype === 'float32' || dtype === 'float64')
    return /** @type {Float32Array | Float64Array} */ (data).every(Number.isFinite);
  return true;
}

/**
 * Replace every BatchNorm running statistic by its estimate under the current weights (statistics.py
 * recompute_statistics): one pass over the training examples in stored order, full batches only where there
 * is one, each batch's statistics read back from zero and weighted by its count. Returns the samples used.
 * @param {Engine} engine
 * @param {Samples} train
 * @param {number} batchSize
 */
export async function recomputeStatistics(engine, train, batchSize) {
  const momenta = engine.statisticsMomenta();
  const names = Object.keys(momenta);
  if (!names.length || train.count < 2) return 0; // one sample has no variance on a 1x1 map
  /** @type {Tensors} */
  const zeros = Object.fromEntries(
    names.map((name) => {
      const { shape } = engine.spec(name);
      return [name, { dtype: 'float32', shape: shape.slice(), data: new Float32Array(numel(shape)) }];
    }),
  );
  const sums = Object.fromEntries(names.map((name) => [name, new Float64Array(zeros[name].data.length)]));
  const sample = engine.sampleSize;
  const end = train.count >= batchSize ? train.count - (train.count % batchSize) : train.count;
  let count = 0;
  for (let start = 0; start < end; start += batchSize) {
    const size = Math.min(batchSize, end - start);
    const per = engine.targetSize;
    const y = train.y.slice(start * per, (start + size) * per);
    engine.setTensors(zeros);
    await engine.statisticsStep(train.x.subarray(start * sample, (start + size) * sample), y, size);
    const got = await engine.getTensors(names);
    for (const name of names) {
      const scale = size / momenta[name];
      const sum = sums[name];
      /** @type {Float32Array} */ (got[name].data).forEach((v, i) => {
        sum[i] += v * scale;
      });
    }
    count += size;
  }
  /** @type {Tensors} */
  const estimates = {};
  for (const name of names) estimates[name] = { ...zeros[name], data: Float32Array.from(sums[name], (v) => v / count) };
  engine.setTensors(estimates);
  return count;
}

/**
 * Lay a received shared part over the device's tensors, then re-estimate BatchNorm statistics (statistics.py receive).
 * @param {Contract} contract
 * @param {Engine} engine
 * @param {Tensors} tensors
 * @param {Samples} train
 * @param {object} settingsJson
 */
export async function receive(contract, engine, tensors, train, settingsJson) {
  const settings = roundSettings(contract, settingsJson);
  engine.setTensors(tensors);
  if (Object.keys(tensors).length && settings.recompute_bn)
    await recomputeStatistics(engine, train, settings.batch_size);
}

function mean(/** @type {number[]} */ values) {
  return values.length ? values.reduce((a, b) => a + b, 0) / values.length : NaN;
}

/** Python's round(): halves go to the even neighbour. */
export function roundHalfEven(/** @type {number} */ v) {
  const floor = Math.floor(v);
  const diff = v - floor;
  if (diff > 0.5) return floor + 1;
  if (diff < 0.5) return floor;
  return floor % 2 === 0 ? floor : floor + 1;
}
