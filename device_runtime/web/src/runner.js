// @ts-check
// The browser device's round loop, free of the DOM, as device_runtime/runner.py runs it: poll the task, train
// a round once, save everything with the upload in one transaction, upload those saved bytes (again after a
// reload), report metrics. Round settings outside the device contract are refused before any training; a base
// holding NaN/Inf, or a round whose training diverges, is refused: the model held before the round stays,
// nothing is saved or sent, and the device waits for the next round. What happens is told through DeviceEvents.

import {
  divergence,
  nonfiniteNames,
  receive,
  roundLosses,
  roundPhases,
  runClientRound,
  travellingNames,
} from './algorithms.js';
import { checkedSettings } from './contract.js';
import { shortfallLine } from './data.js';
import { decodeDownload } from './encoding.js';
import { DeviceError, StartOver } from './errors.js';
import { Refusal, retryLine, Unreachable } from './protocol.js';
import { encodeUpload, postMetrics, reportRefusal, sendPending } from './delivery.js';
import { decodeSafetensors } from './safetensors.js';
import { scoreSentence } from './results.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./contract.js').RoundSettings} RoundSettings */
/** @typedef {import('./engine.js').Engine} Engine */
/** @typedef {import('./engine.js').EvalResult} EvalResult */
/** @typedef {import('./algorithms.js').Samples} Samples */
/** @typedef {import('./data.js').Examples} Examples */
/** @typedef {import('./protocol.js').Task} Task */
/** @typedef {import('./store.js').DeviceStore} DeviceStore */
/** @typedef {import('./store.js').Progress} Progress */
/** @typedef {import('./store.js').PendingUpload} PendingUpload */
/** @typedef {import('./store.js').RoundRecord} RoundRecord */
/** @typedef {import('./delivery.js').DeviceClient} DeviceClient */
/** @typedef {import('./delivery.js').SecurePending} SecurePending */
/** @typedef {import('./encoding.js').Delta} Delta */
/** @typedef {import('./safetensors.js').Tensors} Tensors */
/** @typedef {import('./kinds.js').ExampleSource} ExampleSource */
/** A round's numbers: held-out before and after training, and the training's. @typedef {{before: EvalResult, after: EvalResult, result: import('./algorithms.js').ClientResult}} Measured */
/** What the page is doing, as `body[data-stage]` shows it. @typedef {'loading' | 'join' | 'examples' | 'waiting' | 'training' | 'uploading' | 'offline' | 'done' | 'problem'} Stage */

/**
 * What the loop reports (runner.py DeviceEvents): the page draws it, tests record it.
 * @typedef {object} DeviceEvents
 * @property {(text: string) => void} message a one-line status
 * @property {(stage: Stage, text: string) => void} stage what the device does now, with its status line
 * @property {(error: DeviceError) => void} problem a problem and its fix, shown until the next round begins
 * @property {() => void} problemCleared
 * @property {(roundId: number, settings: RoundSettings, totalSteps: number) => void} roundStarted training of a round begins
 * @property {(roundId: number, phase: string, step: number, steps: number, loss: number) => void} step one training step finished
 * @property {(roundId: number, record: RoundRecord) => void} roundFinished a round is saved and its upload delivered, dropped or none
 * @property {(history: RoundRecord[]) => void} historyChanged the saved history of rounds changed
 * @property {(roundId: number | null, result: EvalResult) => void} runFinished the run is over: the held-out evaluation of the model kept
 */

const OFFLINE_WAIT = 30; // seconds before trying again after the server stayed unreachable (the page's own)

/** A received base or a training result the device must not keep (NaN, Inf or an exploding loss; runner.py);
 * `detail` is the technical reason the server is told. */
export class TrainingDiverged extends DeviceError {}

/** One device taking part in rounds: the loop, one round, its upload and metrics. */
export class DeviceRunner {
  /**
   * @param {object} parts
   * @param {DeviceClient} parts.client
   * @param {DeviceStore} parts.store
   * @param {Engine} parts.engine holding the saved tensors (or the bundle's initial ones)
   * @param {Contract} parts.contract
   * @param {DeviceEvents} parts.events
   * @param {(seconds: number) => Promise<unknown>} parts.sleep waits; sleep(0) lets the page paint between training steps
   * @param {ExampleSource} parts.examples
   * @param {{progress?: Progress, history?: RoundRecord[]}} [parts.saved] what the store held at start
   */
  constructor({ client, store, engine, contract, events, sleep, examples, saved = {} }) {
    this.client = client;
    this.store = store;
    this.engine = engine;
    this.manifest = engine.manifest;
    this.layout = engine.manifest.base_layout_hash;
    this.contract = contract;
    this.events = events;
    this.sleep = sleep;
    this.examples = examples;
    /** @type {Progress} */
    this.progress = saved.progress || {
      layout: this.layout,
      lastCompletedRound: null,
      lastUploadedRound: null,
      pending: null,
    };
    /** @type {RoundRecord[]} */
    this.history = saved.history || [];
  }

  /** Take part in rounds until the server says done; a problem that is not the network's ends the loop (it throws). */
  async run() {
    const { client, contract, events } = this;
    let told = '';
    const refused = new Set(); // rounds whose base or result this device refused: it waits for the next one
    for (;;) {
      try {
        if (this.progress.pending) await this.deliverPending();
        const more = shortfallLine(this.examples.count(), contract.device, this.examples.words);
        if (more) {
          // the page asks for no round it has nothing to learn from (or nothing to measure with)
          events.stage('examples', more);
          told = '';
          await this.examples.added();
          continue;
        }
        const task = await client.task();
        if (task.base_layout_hash !== this.layout) {
          throw new StartOver(
            'the server trains another model than the one this page loaded',
            'reload the page; start over if that does not help',
          );
        }
        const settings = checkedSettings(contract, task.settings);
        if (task.action === 'done') return await this.finish(task, settings);
        const last = this.progress.lastCompletedRound;
        const waiting =
          task.action === 'train'
            ? `Round ${task.round} is trained on this device; waiting for the next round.`
            : 'Waiting for the next round…';
        if (
          task.action === 'train' &&
          task.round != null &&
          (last == null || task.round > last) &&
          !refused.has(task.round)
        ) {
          try {
            if (await this.trainRound(task, task.round, settings)) continue;
          } catch (err) {
            if (!(err instanceof TrainingDiverged)) throw err;
            refused.add(task.round);
            await reportRefusal(client, events, task.round, err);
            events.problem(err);
            events.stage('waiting', err.problem);
            told = waiting;
          }
        }
        if (waiting !== told) events.stage('waiting', waiting);
        told = waiting;
        await this.sleep(Math.min(task.retry_after || contract.timing.poll_interval, contract.timing.max_wait));
      } catch (err) {
        if (!(err instanceof Unreachable)) throw err; // a refusal or a bad reply is shown once: the page stops
        events.problem(err);
        events.stage('offline', retryLine(err.busy, OFFLINE_WAIT)); // what the page waits for, and why: the problem above
        told = '';
        await this.sleep(OFFLINE_WAIT);
      }
    }
  }

  /**
   * Train one round once, in the phases of the Python round (round.py train_round): receive its base and check
   * it, fit the model to it, train, refuse a diverged result, encode the upload, commit; false when the round was
   * gone before training began. A base holding NaN/Inf or a diverged result throws TrainingDiverged with the engine
   * back at the model held before the round.
   * @param {Task} task
   * @param {number} roundId
   * @param {RoundSettings} settings
   */
  async trainRound(task, roundId, settings) {
    this.events.problemCleared();
    this.events.stage('training', `Round ${roundId}: getting the shared model…`);
    await this.store.commit({ round: { round: roundId, startedAt: Date.now() } });
    const base = await this.receiveBase(task, roundId, settings);
    if (!base) return false;
    const { train, val } = this.split();
    this.events.stage('training', `Round ${roundId}: fitting the shared model to your examples…`);
    const kept = await this.engine.getTensors(); // the model held before the round, back in place if it is refused
    // a tensor kept on the device (HeurpFedLA) keeps the value this device trained; BatchNorm statistics are
    // re-estimated under the new base
    await receive(this.contract, this.engine, base, train, settings);
    const before = await evaluate(this.engine, val);
    const result = await this.train(roundId, train, settings);
    this.events.stage('training', `Round ${roundId}: checking the model on the examples kept aside…`);
    const after = await evaluate(this.engine, val);
    await this.refuseDiverged(roundId, roundLosses(result, after), kept);
    const measured = { before, after, result };
    const { contract, engine, store } = this;
    const round = { task, roundId, settings, base, layout: this.layout };
    const { pending, residual } = await encodeUpload({ contract, engine, store }, round, measured);
    await this.commitRound(roundId, measured, pending, residual);
    return true;
  }

  /**
   * The round's base, downloaded and checked: exactly the tensors this model shares this round, all finite; null
   * when the round closed before it came.
   * @param {Task} task
   * @param {number} roundId
   * @param {RoundSettings} settings
   */
  async receiveBase(task, roundId, settings) {
    const { client, events, manifest, store } = this;
    let baseBytes;
    try {
      baseBytes = await client.bytes(task.base_url || client.basePath(roundId));
    } catch (err) {
      if (err instanceof Refusal && err.roundGone) {
        events.message(`Round ${roundId} closed before training began; waiting for the next one.`);
        await store.commit({ round: undefined });
        return null;
      }
      throw err;
    }
    const base = decodeDownload(baseBytes, settings.download_encoding, `the base of round ${roundId}`);
    const poisoned = nonfiniteNames(base);
    if (poisoned.length)
      throw await this.skipped(
        roundId,
        'came with a broken shared model',
        `the base of round ${roundId} holds NaN or Inf in ${JSON.stringify(poisoned[0])}`,
      );
    const expected = travellingNames(manifest, settings);
    if (Object.keys(base).length !== expected.length || expected.some((name) => !(name in base))) {
      throw new DeviceError(
        `the base of round ${roundId} holds other tensors than this model shares`,
        'the server must run with the bundle this page loaded',
      );
    }
    return base;
  }

  /**
   * The round's training (algorithms.js runClientRound), its steps told as they end, the page painted between them.
   * @param {number} roundId
   * @param {Samples} train
   * @param {RoundSettings} settings
   */
  async train(roundId, train, settings) {
    const { contract, engine, events } = this;
    const steps =
      roundPhases(contract, settings, engine.trainableSets()).reduce((sum, p) => sum + p.epochs, 0) *
      Math.ceil(train.count / settings.batch_size);
    events.roundStarted(roundId, settings, steps);
    const yielding = Object.create(engine);
    yielding.trainStep = async (/** @type {Parameters<Engine['trainStep']>} */ ...args) => {
      await this.sleep(0); // lets the page paint its progress and stay responsive between steps
      return engine.trainStep(...args);
    };
    return runClientRound(contract, yielding, train, settings, {
      seed: contract.device.seed,
      roundId,
      onProgress: ({ phase, step, steps: total, loss }) => events.step(roundId, phase, step, total, loss),
    });
  }

  /**
   * Refuse a round whose losses or tensors blew up (algorithms.js divergence): the model held before it back in
   * place, nothing saved, and TrainingDiverged thrown.
   * @param {number} roundId
   * @param {number[]} losses
   * @param {Tensors} kept
   */
  async refuseDiverged(roundId, losses, kept) {
    const { contract, engine, manifest } = this;
    const why = divergence(losses, await engine.getTensors(), manifest.num_classes, contract.divergence.loss_factor);
    if (why === null) return;
    engine.setTensors(kept);
    throw await this.skipped(
      roundId,
      'went wrong while training (the numbers blew up)',
      `training diverged in round ${roundId} (${why})`,
    );
  }

  /**
   * Save the round in one transaction (the trained tensors, the round marked done, the upload's bytes and its
   * residual, or none of them), then deliver the upload (or post the metrics of a round that sends none).
   * @param {number} roundId
   * @param {Measured} measured
   * @param {SecurePending | null} pending
   * @param {Delta} [residual]
   */
  async commitRound(roundId, { before, after, result }, pending, residual) {
    const { client, engine, events, store } = this;
    /** @type {RoundRecord} */
    const record = {
      round: roundId,
      beforeAccuracy: before.count ? before.correct / before.count : null,
      accuracy: after.count ? after.correct / after.count : null,
      loss: after.count ? after.lossSum / after.count : null,
      samples: after.count,
      trainLoss: result.trainLoss,
      upload: pending ? 'pending' : 'none',
    };
    this.history = [...this.history, record];
    this.progress = { ...this.progress, lastCompletedRound: roundId, pending };
    await store.commit({
      tensors: { layout: this.layout, tensors: await engine.getTensors() },
      progress: this.progress,
      history: this.history,
      round: undefined,
      ...(residual ? { residual } : {}),
    });
    events.historyChanged(this.history);
    if (pending) await this.deliverPending();
    else await postMetrics(client, events, record);
    events.roundFinished(roundId, /** @type {RoundRecord} */ (this.history.find((r) => r.round === roundId)));
  }

  /** Upload the saved bytes of the pending round (the same bytes after any reload), then its metrics. */
  async deliverPending() {
    const { client, events, sleep, store } = this;
    const pending = this.progress.pending;
    if (!pending) return;
    const save = async (/** @type {SecurePending} */ saved) => {
      this.progress = { ...this.progress, pending: saved };
      await store.commit({ progress: this.progress });
    };
    const delivered = await sendPending({ client, events, sleep, seed: this.contract.device.seed }, pending, save);
    const upload = delivered ? 'delivered' : 'dropped';
    this.history = this.history.map((r) => (r.round === pending.round ? { ...r, upload } : r));
    this.progress = {
      ...this.progress,
      pending: null,
      lastUploadedRound: delivered ? pending.round : this.progress.lastUploadedRound,
    };
    // a dropped encoded upload owes nothing: the residual goes back to the one before it
    const restored = !delivered && 'residualBefore' in pending ? { residual: pending.residualBefore || undefined } : {};
    await store.commit({ progress: this.progress, history: this.history, ...restored });
    events.historyChanged(this.history);
    const record = this.history.find((r) => r.round === pending.round);
    if (delivered && record) await postMetrics(client, events, record);
  }

  /**
   * The run is over: take the final base (unless it holds NaN/Inf or its held-out loss explodes: then the
   * model stays as it is, runner.py _take_final_base) and show the personalised model's held-out accuracy.
   * @param {Task} task
   * @param {RoundSettings} settings
   */
  async finish(task, settings) {
    const { client, contract, engine, events, manifest } = this;
    const { train, val } = this.examples.count() ? this.split() : { train: NO_SAMPLES, val: NO_SAMPLES };
    if (task.base_url) {
      const final = decodeSafetensors(await client.bytes(task.base_url), 'the final base').tensors;
      const kept = await engine.getTensors();
      const poisoned = nonfiniteNames(final);
      let why = poisoned.length ? `holds NaN or Inf in ${JSON.stringify(poisoned[0])}` : null;
      if (why === null) {
        await receive(contract, engine, final, train, settings);
        const result = await evaluate(engine, val);
        const loss = divergence(
          result.count ? [result.lossSum / result.count] : [],
          {},
          manifest.num_classes,
          contract.divergence.loss_factor,
        );
        why = loss && `gives a held-out ${loss}`;
      }
      if (why === null)
        await this.store.commit({ tensors: { layout: this.layout, tensors: await engine.getTensors() } });
      else {
        engine.setTensors(kept);
        events.problem(
          new DeviceError(
            `the server's final shared model was broken, so this phone kept ${this.keptInWords()}`,
            'nothing to do',
            `the final base ${why}: kept ${this.kept()} as this device's model`,
          ),
        );
      }
    }
    const result = await evaluate(engine, val);
    events.runFinished(task.round ?? null, result);
    const measured = {
      accuracy: result.correct / result.count,
      count: result.count,
      final: true,
      roundsHere: this.history.length,
      round: task.round ?? null,
      words: this.examples.words,
    };
    const shown = result.count ? scoreSentence(measured) : 'no examples are kept aside to check it';
    events.stage('done', `Training is over (after round ${task.round ?? '–'}): ${shown}.`);
  }

  /** The seeded train/held-out split of the current examples, normalised, as the contract sets it. */
  split() {
    const { val_fraction: valFraction, split_seed: seed } = this.contract.device;
    return this.examples.split(valFraction, seed);
  }

  /** How a refusal names the model it keeps (state.py kept). */
  kept() {
    const last = this.progress.lastCompletedRound;
    return last == null ? 'the model this page held' : `the state of round ${last}`;
  }

  /** The model a device keeps, in a person's words. */
  keptInWords() {
    const last = this.progress.lastCompletedRound;
    return last == null ? 'the model it had' : `its model of round ${last}`;
  }

  /**
   * A round whose base or result the device refuses: the line a person reads, and the technical reason (as the
   * Python device words it) the server is told. Nothing of the round stays saved.
   * @param {number} roundId
   * @param {string} what what went wrong, in words
   * @param {string} reason the technical reason
   */
  async skipped(roundId, what, reason) {
    await this.store.commit({ round: undefined });
    return new TrainingDiverged(
      `round ${roundId} ${what}, so this phone skipped it and kept ${this.keptInWords()}`,
      'nothing to do: the server is told, and the phone joins the next round',
      `${reason}: kept ${this.kept()} and skipped the round`,
    );
  }
}

/** @type {Samples} */
const NO_SAMPLES = { x: new Float32Array(0), y: new Int32Array(0), count: 0 };

/** Summed loss, correct count and count over held-out samples (none: all zero). */
async function evaluate(/** @type {Engine} */ engine, /** @type {Samples} */ part) {
  return part.count ? engine.evaluate(part.x, part.y, part.count) : { lossSum: 0, correct: 0, count: 0 };
}
