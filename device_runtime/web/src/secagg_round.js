// @ts-check
// A device's secure round once its clipped delta is saved (device_runtime/secure_round.py): the client session's
// steps, each answer sent after the session is saved.

import { uniformRandom } from './encoding.js';
import { maskedInputBytes, messageFromJson, messageToJson } from './secagg_messages.js';
import { quantizeDelta } from './secagg_quantize.js';
import { ClientSession } from './secagg_session.js';

/** @typedef {import('./secagg_messages.js').KeyBook} KeyBook */
/** @typedef {import('./secagg_messages.js').ShareBundle} ShareBundle */
/** @typedef {import('./secagg_messages.js').UnmaskRequest} UnmaskRequest */
/** @typedef {import('./secagg_quantize.js').Tensor} Tensor */

/**
 * How a device's secure steps reach the server and keep their state (runner.js gives the page's).
 * @typedef {object} SecureIO
 * @property {(kind: string, body: string | Uint8Array) => Promise<unknown>} send POST advert, shares, masked, reveal
 * @property {(what: string) => Promise<string>} fetch the book, inbox or unmask request (JSON) once the server has it
 * @property {(state: string) => Promise<void>} save keep the session's state (private keys and shares) durably
 */
/**
 * A device's secure round once its clipped delta is saved (device_runtime/secure_round.py's `deliver`): advertise
 * its keys, then answer the key book, the share inbox and the unmask request, the session saved before each answer
 * is sent. Taken again from `state` after a reload, the same server messages get the same answers (the rounding is
 * seeded by `seed`, e.g. [device seed, round]), and the server acknowledges what it holds as a duplicate.
 * @param {SecureIO} io @param {string} state the session's JSON @param {Record<string, Tensor>} delta
 * @param {number} weight the sample count @param {number[]} seed
 */
export async function takeSecureSteps(io, state, delta, weight, seed) {
  const session = await ClientSession.fromJSON(state);
  await io.send('advert', messageToJson('KeyAdvert', session.advert()));
  const bundle = await session.receiveBook(/** @type {KeyBook} */ (messageFromJson(await io.fetch('book'), 'KeyBook')));
  await io.save(session.toJSON());
  await io.send('shares', messageToJson('ShareBundle', bundle));
  const inbox = /** @type {ShareBundle} */ (messageFromJson(await io.fetch('inbox'), 'ShareInbox'));
  const masked = await session.receiveInbox(
    inbox,
    await quantizeDelta(delta, weight, session.book, uniformRandom(seed)),
  );
  await io.save(session.toJSON());
  await io.send('masked', maskedInputBytes(masked));
  const reveal = session.receiveUnmask(
    /** @type {UnmaskRequest} */ (messageFromJson(await io.fetch('unmask'), 'UnmaskRequest')),
  );
  await io.save(session.toJSON());
  await io.send('reveal', messageToJson('UnmaskShares', reveal));
}
