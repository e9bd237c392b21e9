// The page's /v1 client: retries and backoff, refusals with the server's fix, captive portals, the token's origin,
// and upload metadata written as Python writes it.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { ApiClient, encodeUpdate, NotTheServer, pythonFloat, Refusal, Unreachable } from '../src/protocol.js';
import { decodeSafetensors } from '../src/safetensors.js';
import { NEEDS_FIXTURES, fixtureContract } from './fixtures.mjs';

const ORIGIN = 'https://server.example:8443';

/**
 * A client whose fetch answers from `replies` in turn (a Response, or an Error to throw) and records each call;
 * the device contract's retry policy (first delay 0.5 s, at most 30 s) with 4 attempts.
 */
function scripted(replies, options = {}) {
  const calls = [];
  const slept = [];
  const contract = fixtureContract();
  const client = new ApiClient({
    origin: ORIGIN,
    contract,
    token: 'device-token',
    retry: { ...contract.timing.retry, attempts: 4 },
    fetchImpl: async (url, init) => {
      calls.push({ url, init });
      const reply = replies.shift();
      if (reply instanceof Error) throw reply;
      return reply;
    },
    sleep: async (seconds) => slept.push(seconds),
    ...options,
  });
  return { client, calls, slept };
}

const json = (body, status = 200, headers = {}) =>
  new Response(JSON.stringify(body), { status, headers: { 'content-type': 'application/json', ...headers } });

test('network errors, 5xx and 429 are retried with backoff (Retry-After wins); the token goes to the same origin only', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const said = [];
  const { client, calls, slept } = scripted(
    [
      new TypeError('Failed to fetch'),
      json({ error: 'server_error', detail: 'busy', fix: '' }, 503),
      json({ error: 'too_many', detail: 'slow down', fix: '' }, 429, { 'retry-after': '7' }),
      json({ action: 'wait', retry_after: 5 }),
    ],
    { onRetry: (line) => said.push(line) },
  );
  assert.deepEqual(await client.task(), { action: 'wait', retry_after: 5 });
  assert.equal(calls.length, 4);
  // what the person reads meanwhile: words, no request line or HTTP status
  assert.deepEqual(
    said.map((line) => line.replace(/\d+ s\.$/, 'N s.')),
    [
      'No connection to the server; trying again in N s.',
      'The server is busy; trying again in N s.',
      'The server is busy; trying again in N s.',
    ],
  );
  assert.equal(said[2], 'The server is busy; trying again in 7 s.');
  assert.ok(
    calls.every((c) => c.url === `${ORIGIN}/v1/task` && c.init.headers.Authorization === 'Bearer device-token'),
  );
  assert.ok(calls.every((c) => c.init.credentials === 'omit' && c.init.referrerPolicy === 'no-referrer'));
  assert.equal(slept.length, 3);
  assert.ok(slept[0] >= 0.25 && slept[0] <= 0.5 && slept[1] >= 0.5 && slept[1] <= 1.0, String(slept));
  assert.equal(slept[2], 7);
  await assert.rejects(
    client.request('GET', 'https://elsewhere.example/v1/task'),
    /refusing to send the device token to https:\/\/elsewhere\.example/,
  );
  await assert.rejects(client.request('GET', '//elsewhere.example/v1/task'), /refusing to send the device token/);
  assert.equal(calls.length, 4, 'nothing was sent to the other origin');
});

test('a server that stays unreachable ends in Unreachable after every attempt', { skip: NEEDS_FIXTURES }, async () => {
  const { client, calls } = scripted([new TypeError('a'), new TypeError('b'), new TypeError('c'), new TypeError('d')]);
  await assert.rejects(
    client.task(),
    (err) =>
      err instanceof Unreachable &&
      /failed 4 times/.test(err.detail) &&
      err.problem === 'no connection to the server' &&
      /Wi-Fi/.test(err.fix),
  );
  assert.equal(calls.length, 4);
});

test('a server answering 5xx on every attempt is Unreachable in other words: it answers, with an error', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const broken = () => json({ error: 'server_error', detail: 'database is locked', fix: '' }, 500);
  const { client } = scripted([broken(), broken(), broken(), broken()]);
  await assert.rejects(
    client.task(),
    (err) =>
      err instanceof Unreachable &&
      err.busy &&
      err.problem === 'the server answers, but with an error (it may be busy or broken)' &&
      /tell the person who runs the server/.test(err.fix) &&
      /HTTP 500 database is locked/.test(err.detail),
  );
});

test("a 4xx is one Refusal in a person's words, the server's own words kept as its detail; the round-over ones say so", {
  skip: NEEDS_FIXTURES,
}, async () => {
  const bearer = 'send `Authorization: Bearer <token>` with a token from `edgepfl serve tokens add NAME`';
  const { client, calls } = scripted(
    [
      json({ error: 'unauthorized', detail: 'missing or invalid device token', fix: bearer }, 401),
      json({ error: 'round_closed', detail: 'round 3 is closed', fix: 'poll /v1/task' }, 409),
      json(
        { error: 'unauthorized', detail: 'missing or wrong enrollment secret', fix: 'ask for a new join link' },
        401,
      ),
      json({ error: 'join_link_expired', detail: 'this join link expired at 2026-11-27 14:05 UTC', fix: 'x' }, 410),
      json({ error: 'bad_tensors', detail: 'tensor w holds NaN', fix: 'retrain with a lower --lr' }, 422),
    ],
    { token: 'revoked' },
  );
  await assert.rejects(client.task(), (err) => {
    assert.ok(err instanceof Refusal && err.status === 401 && err.tokenRefused && !err.roundGone);
    assert.equal(err.serverFix, bearer);
    assert.equal(err.problem, 'the server no longer lets this phone in');
    assert.match(err.fix, /new join link/);
    assert.ok(!/Bearer|HTTP|\/v1|--/.test(err.problem + err.fix), "nothing aimed at the operator is the person's fix");
    assert.match(
      err.detail,
      /^GET \/v1\/task: 401 unauthorized: missing or invalid device token; the server says: send `Authorization/,
    );
    return true;
  });
  await assert.rejects(client.upload(3, new Uint8Array([1])), (err) => err instanceof Refusal && err.roundGone);
  await assert.rejects(
    client.enroll('web-1', 'k'.repeat(32), 'old'),
    (err) => err.problem === 'the server did not accept this join link' && !err.tokenRefused,
  );
  await assert.rejects(
    client.enroll('web-1', 'k'.repeat(32), 'old'),
    (err) => err.problem === 'this join link expired at 2026-11-27 14:05 UTC' && /new one/.test(err.fix),
  );
  await assert.rejects(
    client.upload(3, new Uint8Array([1])),
    (err) => !/--lr/.test(err.problem + err.fix) && /bad_tensors/.test(err.problem) && /--lr/.test(err.detail),
  );
  assert.equal(calls.length, 5, 'refusals are not retried');
});

test("a refusal of a round's base is reported with its reason (at most 200 characters)", {
  skip: NEEDS_FIXTURES,
}, async () => {
  const { client, calls } = scripted([json({ accepted: true, round: 4, duplicate: false, rolled_back: false })]);
  assert.deepEqual(await client.reportRefusal(4, 'x'.repeat(300)), {
    accepted: true,
    round: 4,
    duplicate: false,
    rolled_back: false,
  });
  assert.equal(calls[0].url, `${ORIGIN}/v1/rounds/4/refusal`);
  assert.equal(calls[0].init.method, 'POST');
  assert.deepEqual(JSON.parse(calls[0].init.body), { reason: 'x'.repeat(200) });
});

test('a captive portal (an HTML page or a redirect instead of the server) is one clear error, not retried', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const portal = new Response('<html>sign in to the Wi-Fi</html>', {
    status: 200,
    headers: { 'content-type': 'text/html; charset=utf-8' },
  });
  const redirect = new Response(null, { status: 302, headers: { location: 'http://portal.example/' } });
  const { client, calls } = scripted([portal, redirect]);
  await assert.rejects(
    client.task(),
    (err) =>
      err instanceof NotTheServer &&
      /web page/.test(err.problem) &&
      /sign in/.test(err.fix) &&
      /HTTP 200/.test(err.detail),
  );
  await assert.rejects(client.task(), NotTheServer);
  assert.equal(calls.length, 2);
});

test('bytes are checked against the ETag sha256 and fetched again when they do not match', {
  skip: NEEDS_FIXTURES,
}, async () => {
  const body = new TextEncoder().encode('abc');
  const sha = 'ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad';
  const { client, calls } = scripted([
    new Response(new Uint8Array([1, 2]), { headers: { etag: `"${sha}"` } }),
    new Response(body, { headers: { etag: `"${sha}"` } }),
  ]);
  assert.deepEqual(await client.bytes('/v1/rounds/1/base'), body);
  assert.equal(calls.length, 2);
});

test('enrollment sends the secret as the bearer and the same key every time', { skip: NEEDS_FIXTURES }, async () => {
  const { client, calls } = scripted([new TypeError('lost'), json({ device: 'web-1', token: 'new-token' })], {
    token: null,
  });
  assert.equal(await client.enroll('web-1', 'k'.repeat(32), 'the-secret'), 'new-token');
  assert.ok(
    calls.every(
      (c) => c.init.headers.Authorization === 'Bearer the-secret' && JSON.parse(c.init.body).key === 'k'.repeat(32),
    ),
  );
});

test("upload metadata is UploadMeta.to_metadata(): Python's str() of every number", () => {
  const cases = [
    [0.1, '0.1'],
    [1, '1.0'],
    [1e-5, '1e-05'],
    [0.0001, '0.0001'],
    [1e16, '1e+16'],
    [123456.789, '123456.789'],
    [NaN, 'nan'],
    [-Infinity, '-inf'],
    [Math.LN2, '0.6931471805599453'],
  ];
  for (const [value, python] of cases) assert.equal(pythonFloat(value), python, String(value));
  const tensors = { w: { dtype: 'float32', shape: [2], data: Float32Array.of(1, 2) } };
  const body = encodeUpdate(tensors, {
    baseLayoutHash: 'abc',
    numSamples: 58,
    trainLoss: 0.25,
    valAccuracy: 1,
    valLoss: NaN,
    startValAccuracy: 0.5,
  });
  assert.deepEqual(decodeSafetensors(body).metadata, {
    base_layout_hash: 'abc',
    num_samples: '58',
    train_loss: '0.25',
    val_accuracy: '1.0',
    val_loss: 'nan',
    start_val_accuracy: '0.5',
  });
  // without held-out examples the held accuracy is unknown: nan, as Python writes it
  const unknown = encodeUpdate(tensors, {
    baseLayoutHash: 'abc',
    numSamples: 58,
    trainLoss: 0.25,
    valAccuracy: NaN,
    valLoss: NaN,
  });
  assert.equal(decodeSafetensors(unknown).metadata.start_val_accuracy, 'nan');
});
