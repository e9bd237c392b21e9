// The page's client for the server's /v1 protocol (edgepfl/protocol.py), mirroring device_runtime/client.py:
// network errors, 5xx and 429 are retried with exponential backoff and jitter (Retry-After wins); a 4xx is a
// Refusal carrying the server's `fix`; an HTML answer (a captive portal's sign-in page) is one clear error.
// The token only ever goes to the page's own origin.

import { encodeSafetensors } from './safetensors.js';
import { sha256Hex } from './sha256.js';

export const API_PREFIX = '/v1';
// server error names that end this device's part in a round: drop the round, poll for the next one
const ROUND_GONE_ERRORS = new Set(['round_closed', 'deadline_passed', 'not_sampled', 'no_such_round']);

/** The server refused a request (4xx): retrying it would not help. `fix` is the server's advice. */
export class Refusal extends Error {
  constructor(method, path, status, body) {
    super(`the server refused ${method} ${path} (${status} ${body.error}): ${body.detail}`);
    this.name = 'Refusal';
    this.status = status;
    this.error = String(body.error);
    this.fix = String(body.fix || '');
  }

  /** Whether the round is over for this device (it then rejoins the next one). */
  get roundGone() {
    return ROUND_GONE_ERRORS.has(this.error);
  }
}

/** Network errors or 5xx answers outlasted every retry. */
export class Unreachable extends Error {
  constructor(message) {
    super(message);
    this.name = 'Unreachable';
    this.fix = 'check the Wi-Fi or mobile data; the page goes on by itself when the server answers again';
  }
}

/** Something between the phone and the server answered with a web page (a captive portal's sign-in page). */
export class NotTheServer extends Error {
  constructor(method, path, status, contentType) {
    super(`${method} ${path} was answered by a web page (HTTP ${status}, ${contentType || 'no content type'}), not by the edgepfl server`);
    this.name = 'NotTheServer';
    this.fix = 'the network wants you to sign in (open any web site to see its page) or the link points at another server';
  }
}

/** One device's connection to `edgepfl serve` at the page's own origin. */
export class ApiClient {
  constructor({ origin, token = null, attempts = 8, firstDelay = 0.5, maxDelay = 30, fetchImpl = null, sleep = null, onRetry = null }) {
    this.origin = new URL(origin).origin;
    this.token = token;
    this.attempts = attempts;
    this.firstDelay = firstDelay;
    this.maxDelay = maxDelay;
    this.fetch = fetchImpl || ((...args) => globalThis.fetch(...args));
    this.sleep = sleep || ((seconds) => new Promise((resolve) => setTimeout(resolve, seconds * 1000)));
    this.onRetry = onRetry;
  }

  /** POST /v1/enroll with the shared secret in place of a token; the same `key` on every retry. -> token */
  async enroll(device, key, secret) {
    const reply = await this.request('POST', `${API_PREFIX}/enroll`, { json: { device, key }, bearer: secret });
    const body = await this.json(reply, 'POST', `${API_PREFIX}/enroll`);
    if (typeof body.token !== 'string' || !body.token) throw new NotTheServer('POST', `${API_PREFIX}/enroll`, reply.status, 'a reply without a token');
    return body.token;
  }

  /** GET /v1/task: {action: train|wait|done, round, settings, base_url, retry_after, base_layout_hash}. */
  async task() {
    const reply = await this.request('GET', `${API_PREFIX}/task`);
    return this.json(reply, 'GET', `${API_PREFIX}/task`);
  }

  /** GET bytes (a round's base, a bundle file); with `sha256` (or the reply's ETag) the bytes are checked. */
  async bytes(path, sha256 = null) {
    for (let attempt = 0; attempt < this.attempts; attempt++) {
      const reply = await this.request('GET', path);
      const bytes = new Uint8Array(await reply.arrayBuffer());
      const expected = sha256 || (reply.headers.get('etag') || '').replaceAll('"', '');
      if (!expected || (await sha256Hex(bytes)) === expected) return bytes;
      if (this.onRetry) this.onRetry(`GET ${path}: the bytes do not match their sha256, fetching again`);
    }
    throw new Unreachable(`GET ${path} kept returning bytes that do not match their sha256`);
  }

  /** POST /v1/rounds/{r}/update with a body from encodeUpdate; an identical retry gets the same receipt. */
  async upload(roundId, payload) {
    const path = `${API_PREFIX}/rounds/${roundId}/update`;
    const reply = await this.request('POST', path, { body: payload, contentType: 'application/octet-stream' });
    return this.json(reply, 'POST', path);
  }

  /** POST /v1/rounds/{r}/metrics: the personalised model's held-out evaluation. */
  async postMetrics(roundId, metrics) {
    const path = `${API_PREFIX}/rounds/${roundId}/metrics`;
    return this.json(await this.request('POST', path, { json: metrics }), 'POST', path);
  }

  /** Send with retries; a 2xx/304 Response, or throws Refusal / NotTheServer / Unreachable. */
  async request(method, path, { json = undefined, body = undefined, contentType = null, bearer = null } = {}) {
    const url = new URL(path, this.origin);
    if (url.origin !== this.origin) throw new Error(`refusing to send the device token to ${url.origin}: the page talks to ${this.origin} only`);
    const headers = {};
    const credential = bearer || this.token;
    if (credential) headers.Authorization = `Bearer ${credential}`;
    if (json !== undefined) {
      body = JSON.stringify(json);
      contentType = 'application/json';
    }
    if (contentType) headers['Content-Type'] = contentType;
    let problem = '';
    for (let attempt = 0; attempt < this.attempts; attempt++) {
      let retryAfter = null;
      let reply = null;
      try {
        reply = await this.fetch(url.href, { method, headers, body, cache: 'no-store', credentials: 'omit', redirect: 'manual', referrerPolicy: 'no-referrer' });
      } catch (err) {
        problem = `${err.name}: ${err.message}`;
      }
      if (reply) {
        // a redirect (a captive portal's usual answer) is never the server's: its routes answer in place
        if (reply.type === 'opaqueredirect' || (reply.status >= 300 && reply.status < 400 && reply.status !== 304)) {
          throw new NotTheServer(method, path, reply.status, 'a redirect');
        }
        if (isHtml(reply)) throw new NotTheServer(method, path, reply.status, reply.headers.get('content-type'));
        if (reply.status < 400) return reply;
        if (reply.status < 500 && reply.status !== 429) throw new Refusal(method, path, reply.status, await errorBody(reply, method, path));
        problem = `HTTP ${reply.status} ${(await errorBody(reply, method, path)).detail}`;
        retryAfter = reply.headers.get('retry-after');
      }
      if (attempt + 1 < this.attempts) {
        const delay = this.backoff(attempt, retryAfter);
        if (this.onRetry) this.onRetry(`${method} ${path} failed (${problem}); retry ${attempt + 1} in ${delay.toFixed(1)} s`);
        await this.sleep(delay);
      }
    }
    throw new Unreachable(`${method} ${path} failed ${this.attempts} times (last: ${problem})`);
  }

  backoff(attempt, retryAfter) {
    const stated = retryAfter === null ? NaN : Number(retryAfter);
    if (Number.isFinite(stated)) return Math.min(Math.max(stated, 0), 10 * this.maxDelay);
    return Math.min(this.firstDelay * 2 ** attempt, this.maxDelay) * (0.5 + 0.5 * Math.random());
  }

  async json(reply, method, path) {
    try {
      return await reply.json();
    } catch {
      throw new NotTheServer(method, path, reply.status, reply.headers.get('content-type'));
    }
  }
}

/**
 * The body of an update upload: the travelling tensors (or an encoded delta's, whose `encoding` joins `extra`)
 * with UploadMeta in `__metadata__`, as the Python device writes it.
 */
export function encodeUpdate(tensors, meta, extra = {}) {
  return encodeSafetensors(tensors, {
    base_layout_hash: String(meta.baseLayoutHash),
    num_samples: String(meta.numSamples),
    train_loss: pythonFloat(meta.trainLoss),
    val_accuracy: pythonFloat(meta.valAccuracy),
    val_loss: pythonFloat(meta.valLoss),
    start_val_accuracy: pythonFloat(meta.startValAccuracy ?? NaN),
    ...extra,
  });
}

/** A number written as Python's str(float) writes it (UploadMeta.to_metadata): 0.5, 1.0, 1e-05, nan, inf. */
export function pythonFloat(value) {
  if (Number.isNaN(value)) return 'nan';
  if (!Number.isFinite(value)) return value > 0 ? 'inf' : '-inf';
  if (value === 0) return Object.is(value, -0) ? '-0.0' : '0.0';
  // the shortest round-tripping digits, as both languages find them; Python switches to exponents outside [1e-4, 1e16)
  const [mantissa, exp] = Math.abs(value).toExponential().split('e');
  const exponent = Number(exp);
  const digits = mantissa.replace('.', '');
  const sign = value < 0 ? '-' : '';
  if (exponent < -4 || exponent >= 16) {
    const fraction = digits.length > 1 ? `.${digits.slice(1)}` : '';
    return `${sign}${digits[0]}${fraction}e${exponent < 0 ? '-' : '+'}${String(Math.abs(exponent)).padStart(2, '0')}`;
  }
  if (exponent < 0) return `${sign}0.${'0'.repeat(-exponent - 1)}${digits}`;
  const whole = digits.slice(0, exponent + 1).padEnd(exponent + 1, '0');
  return `${sign}${whole}.${digits.slice(exponent + 1) || '0'}`;
}

function isHtml(reply) {
  return /^\s*text\/html/i.test(reply.headers.get('content-type') || '');
}

async function errorBody(reply, method, path) {
  let body;
  try {
    body = await reply.json();
  } catch {
    throw new NotTheServer(method, path, reply.status, reply.headers.get('content-type'));
  }
  return body && typeof body === 'object' ? { error: body.error || 'http_error', detail: body.detail || '', fix: body.fix || '' } : { error: 'http_error', detail: String(body), fix: '' };
}
