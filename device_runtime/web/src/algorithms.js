// Client algorithms of one round (fedsim, fedalt, local, personal fine-tuning) over the browser engine,
// mirroring device_runtime/algorithms.py run_client_round: the same phases, the same epoch numbering and,
// through random.js, the same seeded batch order and train/held-out split as the Python device.

import { EngineError } from './engine.js';
import { permutation, seedSequenceState } from './random.js';
import { numel } from './safetensors.js';

// algorithm -> its phases [name, trainable set, epochs] for the round settings (Python's ClientAlgorithm.phases)
const ALGORITHMS = {
  fedsim: { uploads: true, phases: (s) => [['joint', 'full', s.epochs]] },
  fedalt: { uploads: true, phases: (s) => [['personal', 'personal', s.personal_epochs], ['base', 'base', s.epochs]] },
  local: { uploads: false, phases: (s) => [['personal', 'personal', s.epochs]] },
};
const DEFAULTS = { algorithm: 'fedsim', epochs: 1, batch_size: 32, lr: 0.01, finetune_epochs: 0, personal_epochs: 1, share_buffers: false, recompute_bn: true, kept_on_device: [] };

/** RoundSettings JSON with Python's defaults filled in; an unknown algorithm throws. */
export function roundSettings(json) {
  const settings = { ...DEFAULTS, ...json };
  if (!ALGORITHMS[settings.algorithm]) {
    throw new EngineError(`unknown client algorithm ${JSON.stringify(settings.algorithm)}`, `the server must send one of: ${Object.keys(ALGORITHMS).join(', ')}`);
  }
  return settings;
}

/** Whether the round ends with an upload (every algorithm but local). */
export function roundUploads(settingsJson) {
  return ALGORITHMS[roundSettings(settingsJson).algorithm].uploads;
}

/** Fine-tuning then the algorithm's phases, without empty phases or sets the bundle lacks (round_phases). */
export function roundPhases(settingsJson, availableSets) {
  const settings = roundSettings(settingsJson);
  const planned = [['finetune', 'personal', settings.finetune_epochs], ...ALGORITHMS[settings.algorithm].phases(settings)];
  if (settings.algorithm === 'local' && !availableSets.includes('personal')) {
    throw new EngineError('the local algorithm trains personal tensors, and this bundle has none (kp=0)', 'use kp >= 1');
  }
  return planned.filter(([, set, epochs]) => epochs > 0 && availableSets.includes(set)).map(([name, trainable, epochs]) => ({ name, trainable, epochs }));
}

/** The shared tensors that travel this round: base (+ base-block buffers when share_buffers) minus kept_on_device. */
export function travellingNames(manifest, settingsJson) {
  const settings = roundSettings(settingsJson);
  const personalStart = manifest.blocks.length - manifest.kp;
  const shared = [
    ...manifest.tensors.filter((t) => t.role === 'base'),
    ...(settings.share_buffers ? manifest.tensors.filter((t) => t.role === 'buffer' && t.block < personalStart) : []),
  ];
  const kept = new Set(settings.kept_on_device);
  return shared.map((t) => t.name).filter((name) => !kept.has(name));
}

/** The shuffling seed of one round (algorithms.py round_seed): distinct per (device seed, round), as in Python. */
export function roundSeed(seed, roundId) {
  return seedSequenceState([seed, roundId], 1)[0];
}

/** Seeded split of n sample indices into {train, val}, both sorted, train never empty (data.py split_train_val). */
export function splitTrainVal(n, valFraction, seed) {
  if (!(valFraction >= 0 && valFraction < 1)) throw new EngineError(`validation fraction ${valFraction} is outside [0, 1)`, 'use e.g. 0.2');
  if (n < 1) throw new EngineError('the data holds no samples', 'add at least one labelled example');
  let nVal = Math.min(roundHalfEven(n * valFraction), n - 1);
  if (valFraction > 0 && n >= 2) nVal = Math.max(nVal, 1);
  const order = permutation(n, seed);
  const sorted = (a) => Int32Array.from(a).sort();
  return { train: sorted(order.subarray(nVal)), val: sorted(order.subarray(0, nVal)) };
}

/** Positions 0..n-1 in batches, shuffled by (seed, epoch); the last partial batch included (data.py iterate_batches). */
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
 */
export async function runClientRound(engine, train, settingsJson, { seed, roundId = 0, onProgress = null } = {}) {
  const settings = roundSettings(settingsJson);
  if (!Number.isSafeInteger(seed) || seed < 0) throw new EngineError(`device seed ${seed} is not a non-negative integer`, 'pass the seed the device was set up with');
  if (!(Number.isInteger(settings.batch_size) && settings.batch_size >= 1)) throw new EngineError(`batch size ${settings.batch_size} is not positive`, 'the server must send a batch size of at least 1');
  if (settings.batch_size > engine.batchSize) {
    throw new EngineError(`the round's batch size ${settings.batch_size} exceeds the portable graphs' batch size ${engine.batchSize}`, `run rounds with batch_size <= ${engine.batchSize} or re-export with a larger portable batch`);
  }
  const phases = roundPhases(settings, engine.trainableSets());
  const perEpoch = Math.ceil(train.count / settings.batch_size);
  const steps = phases.reduce((sum, p) => sum + p.epochs, 0) * perEpoch;
  const shuffleSeed = roundSeed(seed, roundId);
  const sample = engine.sampleSize;
  const logs = [];
  let done = 0;
  let epoch = 0;
  for (const phase of phases) {
    const losses = [];
    for (let e = epoch; e < epoch + phase.epochs; e++) {
      for (const positions of batchOrder(train.count, settings.batch_size, shuffleSeed, e)) {
        const x = new Float32Array(positions.length * sample);
        const y = new Int32Array(positions.length);
        positions.forEach((p, i) => {
          x.set(train.x.subarray(p * sample, (p + 1) * sample), i * sample);
          y[i] = Number(train.y[p]);
        });
        const loss = await engine.trainStep(x, y, positions.length, settings.lr, phase.trainable);
        losses.push(loss);
        done += 1;
        if (onProgress) onProgress({ phase: phase.name, epoch: e, step: done, steps, loss });
      }
    }
    epoch += phase.epochs;
    logs.push({ name: phase.name, trainable: phase.trainable, epochs: phase.epochs, steps: losses.length, meanLoss: mean(losses) });
  }
  return {
    trainLoss: logs.length ? logs[logs.length - 1].meanLoss : NaN,
    numSamples: train.count,
    uploads: ALGORITHMS[settings.algorithm].uploads,
    phases: logs,
  };
}

/**
 * Replace every BatchNorm running statistic by its estimate under the current weights (statistics.py
 * recompute_statistics): one pass over the training examples in stored order, full batches only where there
 * is one, each batch's statistics read back from zero and weighted by its count. Returns the samples used.
 */
export async function recomputeStatistics(engine, train, batchSize) {
  const momenta = engine.statisticsMomenta();
  const names = Object.keys(momenta);
  if (!names.length || train.count < 2) return 0; // one sample has no variance on a 1x1 map
  const zeros = Object.fromEntries(names.map((name) => {
    const { shape } = engine.specs.get(name);
    return [name, { dtype: 'float32', shape: shape.slice(), data: new Float32Array(numel(shape)) }];
  }));
  const sums = Object.fromEntries(names.map((name) => [name, new Float64Array(zeros[name].data.length)]));
  const sample = engine.sampleSize;
  const end = train.count >= batchSize ? train.count - (train.count % batchSize) : train.count;
  let count = 0;
  for (let start = 0; start < end; start += batchSize) {
    const size = Math.min(batchSize, end - start);
    const y = new Int32Array(size);
    for (let i = 0; i < size; i++) y[i] = Number(train.y[start + i]);
    engine.setTensors(zeros);
    await engine.statisticsStep(train.x.subarray(start * sample, (start + size) * sample), y, size);
    const got = await engine.getTensors(names);
    for (const name of names) {
      const scale = size / momenta[name];
      const sum = sums[name];
      got[name].data.forEach((v, i) => { sum[i] += v * scale; });
    }
    count += size;
  }
  const estimates = {};
  for (const name of names) estimates[name] = { ...zeros[name], data: Float32Array.from(sums[name], (v) => v / count) };
  engine.setTensors(estimates);
  return count;
}

/** Lay a received shared part over the device's tensors, then re-estimate BatchNorm statistics (statistics.py receive). */
export async function receive(engine, tensors, train, settingsJson) {
  const settings = roundSettings(settingsJson);
  engine.setTensors(tensors);
  if (Object.keys(tensors).length && settings.recompute_bn) await recomputeStatistics(engine, train, settings.batch_size);
}

function mean(values) {
  return values.length ? values.reduce((a, b) => a + b, 0) / values.length : NaN;
}

/** Python's round(): halves go to the even neighbour. */
function roundHalfEven(v) {
  const floor = Math.floor(v);
  const diff = v - floor;
  if (diff > 0.5) return floor + 1;
  if (diff < 0.5) return floor;
  return floor % 2 === 0 ? floor : floor + 1;
}
