// The browser device's secure aggregation (src/secagg.js) against edgepfl/secagg: the same keys, masks, shares,
// quantized integers and protocol messages bit for bit (fixtures from make_secagg_fixtures.py), state either side
// resumes, and a live round in which the Python server unmasks the JavaScript device's upload exactly.

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import {
  ClientSession,
  SecAggError,
  agree,
  b64,
  decrypt,
  derive,
  encrypt,
  graphSeed,
  info,
  maskVector,
  messageFromJson,
  messageToJson,
  neighbourMap,
  pack,
  publicKey,
  quantizeDelta,
  shamirSplit,
  unb64,
  uniformRandom,
  unpack,
} from '../src/secagg.js';
import { FIXTURES, NEEDS_FIXTURES } from './fixtures.mjs';

const PYTHON = process.env.EDGEPFL_WEB_PYTHON || '';
const HERE = dirname(fileURLToPath(import.meta.url));

function fixtures() {
  return JSON.parse(readFileSync(join(FIXTURES, 'secagg.json'), 'utf8'));
}

/** A randomBytes that hands out the recorded chunks in order (and checks each request's size). */
function replay(chunks) {
  const queue = chunks.map((c) => unb64(c, 'recorded bytes'));
  return (count) => {
    const next = queue.shift();
    assert.ok(next, 'the JavaScript client drew more random bytes than Python did');
    assert.equal(next.length, count);
    return next;
  };
}

function toTensors(delta) {
  return Object.fromEntries(
    Object.entries(delta).map(([name, t]) => [name, { shape: t.shape, data: Float32Array.from(t.data) }]),
  );
}

test("keys, HKDF, AES-GCM, AES-CTR masks, packing and Shamir equal Python's bit for bit", {
  skip: NEEDS_FIXTURES,
}, async () => {
  const p = fixtures().primitives;
  const [a, b] = p.private.map((k) => unb64(k, 'key'));
  assert.deepEqual([b64(await publicKey(a)), b64(await publicKey(b))], p.public);
  const shared = await agree(a, await publicKey(b), 'b');
  assert.equal(b64(shared), p.shared);
  assert.equal(b64(await agree(b, await publicKey(a), 'a')), p.shared);
  assert.equal(b64(await derive(shared, 'mask', 'run-web/round-2', 'phone-000', 'phone-001')), p.derived);
  const seed = unb64(p.mask_seed, 'seed');
  assert.deepEqual(Array.from(await maskVector(seed, 37)), p.mask_32);
  assert.deepEqual(Array.from(await maskVector(seed, 37, 12)), p.mask_12);
  const values = Uint32Array.from(p.pack_values);
  assert.equal(b64(pack(values, 12)), p.packed_12);
  assert.equal(
    b64(
      pack(
        values.map((v) => v & 1023),
        10,
      ),
    ),
    p.packed_10,
  );
  assert.deepEqual(unpack(pack(values, 12), values.length, 12), values);
  const coefficients = replay(p.coefficients);
  const shares = shamirSplit(unb64(p.secret, 'secret'), [1, 2, 4, 7], 3, coefficients);
  assert.deepEqual(Object.fromEntries(Object.entries(shares).map(([x, s]) => [x, b64(s)])), p.shares);
  const key = await derive(shared, 'share', 'run-web/round-2', 'a', 'b');
  const sealed = await encrypt(key, unb64(p.plaintext, 'text'), info('share', 'run-web/round-2', 'a', 'b'), () =>
    unb64(p.nonce, 'nonce'),
  );
  assert.equal(b64(sealed), p.sealed);
  assert.equal(b64(await decrypt(key, sealed, info('share', 'run-web/round-2', 'a', 'b'), 'x')), p.plaintext);
  await assert.rejects(
    decrypt(key, sealed, info('share', 'run-web/round-2', 'b', 'a'), 'the shares'),
    /does not decrypt/,
  );
  await assert.rejects(agree(a, new Uint8Array(32), 'evil'), SecAggError);
});

test("a delta quantizes to Python's integers, stochastically and to nearest", { skip: NEEDS_FIXTURES }, async () => {
  const { quantize, round } = fixtures();
  const book = messageFromJson(round.book, 'KeyBook');
  const delta = toTensors(quantize.delta);
  assert.deepEqual(
    Array.from(await quantizeDelta(delta, quantize.weight, book, uniformRandom(quantize.entropy))),
    quantize.stochastic,
  );
  assert.deepEqual(Array.from(await quantizeDelta(delta, quantize.weight, book, null)), quantize.nearest);
  await assert.rejects(
    quantizeDelta({ ...delta, 'fc.weight': { shape: [3, 7], data: new Float32Array(21).fill(NaN) } }, 1, book),
    /NaN or Inf/,
  );
});

test("the JavaScript client replays a Python device's round and sends the same bytes", {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { quantize, round } = fixtures();
  const random = replay(round.random);
  const client = await ClientSession.start(round.device, round.context, random);
  assert.deepEqual(JSON.parse(messageToJson('KeyAdvert', client.advert())), JSON.parse(round.advert));
  const book = messageFromJson(round.book, 'KeyBook');
  assert.equal(b64(await graphSeed(book)), round.graph_seed);
  assert.deepEqual(
    await neighbourMap(
      book.adverts.map((a) => a.device),
      await graphSeed(book),
      book.plan.neighbours,
    ),
    round.neighbours,
  );
  const bundle = await client.receiveBook(book, random);
  assert.deepEqual(JSON.parse(messageToJson('ShareBundle', bundle)), JSON.parse(round.bundle));
  const inbox = messageFromJson(round.inbox, 'ShareInbox');
  const vector = Uint32Array.from(quantize.stochastic);
  const masked = await client.receiveInbox(inbox, vector);
  assert.deepEqual(JSON.parse(messageToJson('MaskedInput', masked)), JSON.parse(round.masked));
  const request = messageFromJson(round.request, 'UnmaskRequest');
  const reveal = client.receiveUnmask(request);
  assert.deepEqual(JSON.parse(messageToJson('UnmaskShares', reveal)), JSON.parse(round.reveal));
  assert.ok(Object.keys(reveal.key_shares).includes(round.dropped), "the dropped partner's mask-key share is revealed");
  assert.deepEqual(JSON.parse(client.toJSON()), JSON.parse(round.state));
  assert.deepEqual(round.sum, round.plain_sum);
  // Python's saved state resumes here: the same answer again, a different request refused
  const resumed = await ClientSession.fromJSON(round.state);
  assert.deepEqual(resumed.receiveUnmask(request), reveal);
  assert.throws(
    () => resumed.receiveUnmask({ survivors: [...request.survivors, round.dropped].sort(), dropped: [] }),
    /again with other survivors/,
  );
});

test('the client refuses a tampered share, a foreign inbox and a request for both shares; its state stays', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { quantize, round } = fixtures();
  const random = replay(round.random);
  const client = await ClientSession.start(round.device, round.context, random);
  const book = messageFromJson(round.book, 'KeyBook');
  await client.receiveBook(book, random);
  assert.deepEqual(
    await client.receiveBook(book),
    await client.receiveBook(book),
    'a repeated key book gets the same bundle',
  );
  const inbox = messageFromJson(round.inbox, 'ShareInbox');
  const saved = client.toJSON();
  const [peer] = Object.keys(inbox.sealed);
  const flipped = Uint8Array.from(inbox.sealed[peer]);
  flipped[30] ^= 1;
  const vector = Uint32Array.from(quantize.stochastic);
  await assert.rejects(
    client.receiveInbox({ device: inbox.device, sealed: { ...inbox.sealed, [peer]: flipped } }, vector),
    /does not decrypt/,
  );
  await assert.rejects(client.receiveInbox({ device: 'phone-000', sealed: inbox.sealed }, vector), /share inbox of/);
  await assert.rejects(client.receiveInbox(inbox, vector.subarray(1)), /ring vector is not/);
  assert.equal(client.toJSON(), saved);
  await client.receiveInbox(inbox, vector);
  await assert.rejects(
    client.receiveInbox(
      inbox,
      vector.map((v) => (v + 1) % 2 ** book.plan.bits),
    ),
    /different masked vector/,
  );
  const request = messageFromJson(round.request, 'UnmaskRequest');
  const survivor = request.survivors.find((d) => d !== round.device);
  assert.throws(
    () => client.receiveUnmask({ survivors: request.survivors, dropped: [...request.dropped, survivor] }),
    /both shares of device/,
  );
  assert.throws(() => messageFromJson(round.book, 'ShareInbox'), /is not ShareInbox/);
  const lowered = { ...book, plan: { ...book.plan, threshold: 1 } };
  await assert.rejects(
    (await ClientSession.start('phone-009', round.context)).receiveBook(lowered),
    /does not follow from its settings/,
  );
});

test("a live round: the Python server and three Python devices unmask the JavaScript device's upload exactly", {
  skip: NEEDS_FIXTURES || (!PYTHON && 'EDGEPFL_WEB_PYTHON is unset: run scripts/web-env.sh'),
}, async () => {
  const folder = mkdtempSync(join(tmpdir(), 'edgepfl-secagg-'));
  const peer = (step, message) =>
    JSON.parse(execFileSync(PYTHON, [join(HERE, 'secagg_peer.py'), folder, step, message], { encoding: 'utf8' }));
  let client = await ClientSession.start('web-phone', 'run-live/round-1');
  const book = messageFromJson(JSON.stringify(peer('keys', messageToJson('KeyAdvert', client.advert()))), 'KeyBook');
  const bundle = await client.receiveBook(book);
  client = await ClientSession.fromJSON(client.toJSON()); // the page saves the state before sending
  const inbox = messageFromJson(JSON.stringify(peer('shares', messageToJson('ShareBundle', bundle))), 'ShareInbox');
  const delta = toTensors(fixtures().quantize.delta);
  const vector = await quantizeDelta(delta, 17, book, uniformRandom([9, 1]));
  const upload = await client.receiveInbox(inbox, vector);
  const request = peer(
    'masked',
    JSON.stringify({ upload: JSON.parse(messageToJson('MaskedInput', upload)), vector: Array.from(vector) }),
  );
  const reveal = client.receiveUnmask(messageFromJson(JSON.stringify(request), 'UnmaskRequest'));
  const result = peer('unmask', messageToJson('UnmaskShares', reveal));
  assert.deepEqual(result, { exact: true, total_weight: 20 + 21 + 22 + 17, devices: 4 });
});
