// @ts-check
// What a round sends and how its saved update reaches the server (round.py upload_body, runner.py's upload path):
// the trained tensors or their delta encoded as the round asks, the saved bytes uploaded as they are, or a secure
// round's steps over the saved clipped delta; and the advisory reports (held-out metrics, a refused base), whose
// failure only shows a note.

import { roundUploads, travellingNames } from './algorithms.js';
import { baseDelta, encodeWithFeedback, parseEncoding, uniformRandom, uploadsDelta } from './encoding.js';
import { DeviceError } from './errors.js';
import { encodeUpdate, Refusal, Unreachable } from './protocol.js';
import { decodeSafetensors } from './safetensors.js';
import { ClientSession, SecAggError, takeSecureSteps } from './secagg.js';
import { sha256Hex } from './sha256.js';

/** @typedef {import('./runner.js').DeviceEvents} DeviceEvents */
/** @typedef {import('./runner.js').TrainingDiverged} TrainingDiverged */
/** @typedef {import('./store.js').PendingUpload} PendingUpload */
/** @typedef {import('./protocol.js').Task} Task */
/** @typedef {import('./store.js').RoundRecord} RoundRecord */
/** A secure round's saved update (never sent: masked in the steps) and its session's state. @typedef {PendingUpload & {secure?: import('./protocol.js').SecureTask & {session: string}}} SecurePending */
/**
 * The calls the loop makes to the server (protocol.js ApiClient).
 * @typedef {object} DeviceClient
 * @property {() => Promise<Task>} task
 * @property {(path: string, sha256?: string | null) => Promise<Uint8Array>} bytes
 * @property {(roundId: number) => string} basePath
 * @property {(roundId: number, payload: Uint8Array) => Promise<unknown>} upload
 * @property {(roundId: number, metrics: {accuracy: number, num_samples: number, loss: number | null}) => Promise<unknown>} postMetrics
 * @property {(roundId: number, reason: string) => Promise<unknown>} reportRefusal
 * @property {(url: string, kind: string, body: string | Uint8Array) => Promise<unknown>} secureSend
 * @property {(url: string, what: string) => Promise<{text: string | null, wait: number}>} secureFetch
 */
/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./contract.js').RoundSettings} RoundSettings */
/** @typedef {import('./engine.js').Engine} Engine */
/** @typedef {import('./encoding.js').Delta} Delta */
/** @typedef {import('./safetensors.js').Tensors} Tensors */
/** @typedef {import('./runner.js').Measured} Measured */
/** What sending the pending upload needs: the client, the events, the wait between polls, the device's seed. @typedef {{client: DeviceClient, events: DeviceEvents, sleep: (seconds: number) => Promise<unknown>, seed: number}} Sender */

/**
 * What the round sends, encoded as it asks (encoding.js; a secure round's clipped delta, masked later in its steps):
 * the pending upload and the residual it leaves, or none for a round that uploads nothing.
 * @param {{contract: Contract, engine: Engine, store: import('./store.js').DeviceStore}} device
 * @param {{task: Task, roundId: number, settings: RoundSettings, base: Tensors, layout: string}} round
 * @param {Measured} measured
 * @returns {Promise<{pending: SecurePending | null, residual?: Delta}>}
 */
export async function encodeUpload({ contract, engine, store }, { task, roundId, settings, base, layout }, measured) {
  if (!roundUploads(contract, settings)) return { pending: null };
  const { before, after, result } = measured;
  const meta = {
    baseLayoutHash: layout,
    numSamples: result.numSamples,
    trainLoss: result.trainLoss,
    valAccuracy: after.count ? after.correct / after.count : NaN,
    valLoss: after.count ? after.lossSum / after.count : NaN,
    startValAccuracy: before.count ? before.correct / before.count : NaN, // the held model, as the round began
  };
  const trained = await engine.getTensors(travellingNames(engine.manifest, settings));
  if (!uploadsDelta(settings)) {
    const payload = encodeUpdate(trained, meta);
    return { pending: { round: roundId, payload, sha256: await sha256Hex(payload) } };
  }
  // the base delta, encoded as the round asks, with what earlier rounds owe
  const owed = (await store.get('residual')).residual;
  const encoding = parseEncoding(settings.upload_encoding);
  const rng = encoding.stochastic ? uniformRandom([contract.device.seed, roundId]) : null;
  const encoded = encodeWithFeedback(baseDelta(trained, base), owed, encoding, { rng, clipNorm: settings.clip_norm });
  const payload = encodeUpdate(encoded.tensors, meta, encoded.metadata);
  /** @type {SecurePending} */
  const pending = { round: roundId, payload, sha256: await sha256Hex(payload), residualBefore: owed || null };
  const secure = task.secure_aggregation;
  if (secure) {
    // a secure round: the clipped delta stays here, masked in the steps (sendPending)
    pending.secure = { ...secure, session: (await ClientSession.start(secure.device, secure.context)).toJSON() };
  }
  return { pending, residual: encoded.residual };
}

/**
 * Send the pending round's saved bytes (the same bytes after any reload): true once the server holds them, false
 * when the round closed before they arrived or the phone refused a secure step's message (it joins the next
 * round). A secure round's steps run over the saved clipped delta (secagg.js takeSecureSteps); `save` keeps the
 * pending upload with its session's state before each answer is sent, so a reload takes the steps again with the
 * same answers.
 * @param {Sender} sender
 * @param {SecurePending} pending
 * @param {(saved: SecurePending) => Promise<void>} save
 * @returns {Promise<boolean>}
 */
export async function sendPending({ client, events, sleep, seed }, pending, save) {
  if ((await sha256Hex(pending.payload)) !== pending.sha256) {
    throw new DeviceError(`the saved upload of round ${pending.round} does not match its sha256`, 'start over');
  }
  const secure = pending.secure;
  events.stage(
    'uploading',
    secure
      ? `Round ${pending.round}: masking what this phone learned with the other phones…`
      : `Round ${pending.round}: sending what this phone learned (the shared part of the model)…`,
  );
  try {
    if (!secure) await client.upload(pending.round, pending.payload);
    else {
      const { tensors, metadata } = decodeSafetensors(pending.payload, 'the saved update');
      const delta = Object.fromEntries(
        Object.entries(tensors).map(([name, t]) => [
          name,
          { shape: t.shape, data: /** @type {Float32Array} */ (t.data) },
        ]),
      );
      const fetch = async (/** @type {string} */ what) => {
        for (;;) {
          const { text, wait } = await client.secureFetch(secure.url, what);
          if (text !== null) return text;
          await sleep(wait);
        }
      };
      const keep = (/** @type {string} */ state) => save({ ...pending, secure: { ...secure, session: state } });
      const send = (/** @type {string} */ kind, /** @type {string | Uint8Array} */ body) =>
        client.secureSend(secure.url, kind, body);
      await takeSecureSteps({ send, fetch, save: keep }, secure.session, delta, Number(metadata?.num_samples), [
        seed,
        pending.round,
      ]);
    }
    return true;
  } catch (err) {
    if (!(err instanceof Refusal && err.roundGone) && !(secure && err instanceof SecAggError)) throw err;
    const why = err instanceof SecAggError ? ` (this phone refused the server's message: ${err.problem})` : '';
    events.message(`Round ${pending.round} closed before this phone's part arrived${why}; it joins the next round.`);
    return false;
  }
}

/** Report the personalised model's held-out evaluation; advisory, so a failure only shows a note. */
export async function postMetrics(
  /** @type {DeviceClient} */ client,
  /** @type {DeviceEvents} */ events,
  /** @type {RoundRecord} */ record,
) {
  if (record.accuracy == null || !record.samples) return;
  try {
    await client.postMetrics(record.round, {
      accuracy: record.accuracy,
      num_samples: record.samples,
      loss: record.loss,
    });
  } catch (err) {
    if (!(err instanceof Refusal || err instanceof Unreachable)) throw err;
    events.message(`The results of round ${record.round} did not reach the server (${err.problem}); the page goes on.`);
  }
}

/** Tell the server this device refused the round's base, so a base most devices refuse is rolled back (runner.py
 * _report_refusal); advisory, like metrics. */
export async function reportRefusal(
  /** @type {DeviceClient} */ client,
  /** @type {DeviceEvents} */ events,
  /** @type {number} */ roundId,
  /** @type {TrainingDiverged} */ refusal,
) {
  try {
    await client.reportRefusal(roundId, refusal.detail || refusal.problem);
  } catch (err) {
    if (!(err instanceof Refusal || err instanceof Unreachable)) throw err;
    events.message(`The server was not told that round ${roundId} was skipped (${err.problem}); the page goes on.`);
  }
}
