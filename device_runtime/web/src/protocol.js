// @ts-check
// The page's client for the server's /v1 protocol (edgepfl/protocol.py), mirroring device_runtime/client.py:
// network errors, 5xx and 429 are retried with exponential backoff and jitter (Retry-After wins); a 4xx is a
// Refusal carrying the server's `fix`; an HTML answer (a captive portal's sign-in page) is one clear error.
// The token only ever goes to the page's own origin. The API prefix, the retry policy and the refusal codes
// that end a round come from the device contract (contract.js).

import { DeviceError, describe } from './errors.js';
import { encodeSafetensors } from './safetensors.js';
import { sha256Hex } from './sha256.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./contract.js').RetryPolicy} RetryPolicy */
/** @typedef {import('./safetensors.js').Tensors} Tensors */
/** The body of an error reply. @typedef {{error: string, detail: string, fix: string}} ErrorBody */
/**
 * The server's answer to GET /v1/task (edgepfl/protocol.py Task.to_json).
 * @typedef {object} Task
 * @property {'train' | 'wait' | 'done'} action
 * @property {number | null} [round]
 * @property {unknown} [settings] RoundSettings JSON, checked against the contract before any use
 * @property {string | null} [base_url]
 * @property {number | null} [deadline]
 * @property {number | null} [retry_after]
 * @property {string} base_layout_hash
 * @property {SecureTask | null} [secure_aggregation] a secure round: the update is masked, never uploaded
 */
/** Where a secure round's steps are, and the device's id and the round's context in them (protocol.py SecureTask). @typedef {{url: string, device: string, context: string}} SecureTask */
/** What an upload's metadata says (UploadMeta). @typedef {{baseLayoutHash: string, numSamples: number, trainLoss: number, valAccuracy: number, valLoss: number, startValAccuracy?: number}} UploadMeta */

/**
 * What a person is told of a refusal, by the server's code: the server's own `fix` speaks to an operator or a
 * developer (flags, headers), so the page says it in its own words and keeps the server's in `detail`.
 * @type {Record<string, [string, string]>}
 */
const FOR_PEOPLE = {
  unauthorized: [
    'the server no longer lets this phone in',
    'ask whoever runs it for a new join link and open it on this phone; your photos and your model stay',
  ],
  enrollment_closed: ['the server takes no new phones through a link', 'ask whoever runs it for a join link'],
  too_many_attempts: [
    'too many wrong join links were tried from this network',
    'wait a few minutes, then open the join link again',
  ],
  already_enrolled: ['the server already knows a phone of this name', 'open the join link again'],
  not_sampled: [
    'the server did not pick this phone for this round',
    'nothing to do: the phone waits for the next round',
  ],
  layout_mismatch: ['the server now trains another model than the one this page holds', 'reload the page'],
};
const JOIN_LINK_CLOSED = ['join_link_expired', 'join_link_used_up', 'join_link_revoked'];
const NEW_LINK = 'ask whoever gave you the link for a new one';
const TELL_OPERATOR = 'reload the page; if it happens again, tell whoever runs the server';

/** The server refused a request (4xx): retrying it would not help. `serverFix` is the server's advice. */
export class Refusal extends DeviceError {
  /**
   * @param {string} method
   * @param {string} path
   * @param {number} status
   * @param {ErrorBody} body
   * @param {boolean} roundGone whether the refusal ends this device's part in the round (contract round_gone_errors)
   */
  constructor(method, path, status, body, roundGone) {
    const error = String(body.error);
    const enrolling = path.endsWith('/enroll');
    let [problem, fix] = FOR_PEOPLE[error] || [`the server refused what this phone sent (${error})`, TELL_OPERATOR];
    if (JOIN_LINK_CLOSED.includes(error))
      [problem, fix] = [body.detail, NEW_LINK]; // "this join link expired at …"
    else if (enrolling && error === 'unauthorized')
      [problem, fix] = ['the server did not accept this join link', NEW_LINK];
    const detail = `${method} ${path}: ${status} ${error}: ${body.detail}${body.fix ? `; the server says: ${body.fix}` : ''}`;
    super(problem, fix, detail);
    this.status = status;
    this.error = error;
    this.serverFix = String(body.fix || '');
    /** Whether the server refused this device's token (a new join link lets it in again). */
    this.tokenRefused = status === 401 && error === 'unauthorized' && !enrolling;
    /** Whether the round is over for this device (it then rejoins the next one). */
    this.roundGone = roundGone;
  }
}

/** Network errors or 5xx answers outlasted every retry; `busy`: the server did answer, with an error (5xx, 429). */
export class Unreachable extends DeviceError {
  constructor(/** @type {string} */ detail, busy = false) {
    super(
      busy ? 'the server answers, but with an error (it may be busy or broken)' : 'no connection to the server',
      busy
        ? 'nothing to do on this phone: the page tries again by itself; if this lasts, tell the person who runs the server'
        : 'check the Wi-Fi or mobile data; the page goes on by itself when the server answers again',
      detail,
    );
    this.busy = busy;
  }
}

/** Something between the phone and the server answered with a web page (a captive portal's sign-in page). */
export class NotTheServer extends DeviceError {
  /**
   * @param {string} method
   * @param {string} path
   * @param {number} status
   * @param {string | null} contentType
   */
  constructor(method, path, status, contentType) {
    super(
      'a web page answered instead of the server',
      'the network may want you to sign in (open any web site to see its page), or the link points at another server',
      `${method} ${path}: HTTP ${status}, ${contentType || 'no content type'}`,
    );
  }
}

/** One device's connection to `edgepfl serve` at the page's own origin. */
export class ApiClient {
  /**
   * @param {object} options
   * @param {string} options.origin the page's origin: the only one the token is sent to
   * @param {Contract} options.contract
   * @param {string | null} [options.token]
   * @param {RetryPolicy} [options.retry] the contract's policy unless given
   * @param {typeof globalThis.fetch | null} [options.fetchImpl]
   * @param {((seconds: number) => Promise<unknown>) | null} [options.sleep]
   * @param {((text: string) => void) | null} [options.onRetry]
   */
  constructor({
    origin,
    contract,
    token = null,
    retry = contract.timing.retry,
    fetchImpl = null,
    sleep = null,
    onRetry = null,
  }) {
    this.origin = new URL(origin).origin;
    this.prefix = contract.api_prefix;
    this.roundGoneErrors = new Set(contract.round_gone_errors);
    this.token = token;
    this.attempts = retry.attempts;
    this.firstDelay = retry.first_delay;
    this.maxDelay = retry.max_delay;
    /** @type {typeof globalThis.fetch} */
    this.fetch = fetchImpl || ((input, init) => globalThis.fetch(input, init));
    this.sleep =
      sleep || ((/** @type {number} */ seconds) => new Promise((resolve) => setTimeout(resolve, seconds * 1000)));
    this.onRetry = onRetry;
  }

  /** POST /v1/enroll with the shared secret in place of a token; the same `key` on every retry. -> token */
  async enroll(/** @type {string} */ device, /** @type {string} */ key, /** @type {string} */ secret) {
    const path = `${this.prefix}/enroll`;
    const reply = await this.request('POST', path, { json: { device, key }, bearer: secret });
    const body = await this.json(reply, 'POST', path);
    if (typeof body.token !== 'string' || !body.token)
      throw new NotTheServer('POST', path, reply.status, 'a reply without a token');
    return body.token;
  }

  /** GET /v1/task: {action: train|wait|done, round, settings, base_url, retry_after, base_layout_hash}. */
  async task() {
    const reply = await this.request('GET', `${this.prefix}/task`);
    return /** @type {Task} */ (await this.json(reply, 'GET', `${this.prefix}/task`));
  }

  /** The path of a round's base (when the task names none). */
  basePath(/** @type {number} */ roundId) {
    return `${this.prefix}/rounds/${roundId}/base`;
  }

  /** GET bytes (a round's base, a bundle file); with `sha256` (or the reply's ETag) the bytes are checked. */
  async bytes(/** @type {string} */ path, /** @type {string | null} */ sha256 = null) {
    for (let attempt = 0; attempt < this.attempts; attempt++) {
      const reply = await this.request('GET', path);
      const bytes = new Uint8Array(await reply.arrayBuffer());
      const expected = sha256 || (reply.headers.get('etag') || '').replaceAll('"', '');
      if (!expected || (await sha256Hex(bytes)) === expected) return bytes;
      if (this.onRetry) this.onRetry('A download arrived damaged; fetching it again…');
    }
    throw new Unreachable(`GET ${path} kept returning bytes that do not match their sha256`);
  }

  /** POST /v1/rounds/{r}/update with a body from encodeUpdate; an identical retry gets the same receipt. */
  async upload(/** @type {number} */ roundId, /** @type {Uint8Array} */ payload) {
    const path = `${this.prefix}/rounds/${roundId}/update`;
    const reply = await this.request('POST', path, {
      body: /** @type {Uint8Array<ArrayBuffer>} */ (payload),
      contentType: 'application/octet-stream',
    });
    return this.json(reply, 'POST', path);
  }

  /** POST /v1/rounds/{r}/refusal: this device refused the round's base (NaN/Inf in it, or training diverged). */
  async reportRefusal(/** @type {number} */ roundId, /** @type {string} */ reason) {
    const path = `${this.prefix}/rounds/${roundId}/refusal`;
    return this.json(await this.request('POST', path, { json: { reason: reason.slice(0, 200) } }), 'POST', path);
  }

  /** POST /v1/rounds/{r}/metrics: the personalised model's held-out evaluation. */
  async postMetrics(
    /** @type {number} */ roundId,
    /** @type {{accuracy: number, num_samples: number, loss: number | null}} */ metrics,
  ) {
    const path = `${this.prefix}/rounds/${roundId}/metrics`;
    return this.json(await this.request('POST', path, { json: metrics }), 'POST', path);
  }

  /** POST a secure round's message to `${url}/${kind}` (advert, shares, reveal: JSON text; masked: binary). */
  async secureSend(/** @type {string} */ url, /** @type {string} */ kind, /** @type {string | Uint8Array} */ body) {
    const path = `${url}/${kind}`;
    const binary = typeof body !== 'string';
    const sent = /** @type {BodyInit} */ (body);
    const reply = await this.request('POST', path, {
      body: sent,
      contentType: binary ? 'application/octet-stream' : 'application/json',
    });
    return this.json(reply, 'POST', path);
  }

  /**
   * GET a secure round's book, inbox or unmask request at `${url}/${what}`: {text} once the server has it,
   * {text: null, wait} (seconds) while its step is open (202).
   * @returns {Promise<{text: string | null, wait: number}>}
   */
  async secureFetch(/** @type {string} */ url, /** @type {string} */ what) {
    const path = `${url}/${what}`;
    const reply = await this.request('GET', path);
    if (reply.status !== 202) return { text: await reply.text(), wait: 0 };
    const wait = Number((await this.json(reply, 'GET', path)).retry_after);
    return { text: null, wait: Number.isFinite(wait) && wait > 0 && wait < 3600 ? wait : 1 };
  }

  /**
   * Send with retries; a 2xx/304 Response, or throws Refusal / NotTheServer / Unreachable.
   * @param {string} method
   * @param {string} path
   * @param {{json?: unknown, body?: BodyInit, contentType?: string | null, bearer?: string | null}} [options]
   */
  async request(method, path, { json = undefined, body = undefined, contentType = null, bearer = null } = {}) {
    const url = new URL(path, this.origin);
    if (url.origin !== this.origin) {
      throw new DeviceError(
        `refusing to send the device token to ${url.origin}: the page talks to ${this.origin} only`,
        'ask the operator to check the server; a reply named another address',
      );
    }
    /** @type {Record<string, string>} */
    const headers = {};
    const credential = bearer || this.token;
    if (credential) headers.Authorization = `Bearer ${credential}`;
    if (json !== undefined) {
      body = JSON.stringify(json);
      contentType = 'application/json';
    }
    if (contentType) headers['Content-Type'] = contentType;
    let problem = '';
    let busy = false; // the server answered, but not now (5xx, 429); else there was no connection
    for (let attempt = 0; attempt < this.attempts; attempt++) {
      let retryAfter = null;
      let reply = null;
      busy = false;
      try {
        reply = await this.fetch(url.href, {
          method,
          headers,
          body,
          cache: 'no-store',
          credentials: 'omit',
          redirect: 'manual',
          referrerPolicy: 'no-referrer',
        });
      } catch (err) {
        problem = err instanceof Error ? `${err.name}: ${err.message}` : describe(err);
      }
      if (reply) {
        // a redirect (a captive portal's usual answer) is never the server's: its routes answer in place
        if (reply.type === 'opaqueredirect' || (reply.status >= 300 && reply.status < 400 && reply.status !== 304)) {
          throw new NotTheServer(method, path, reply.status, 'a redirect');
        }
        if (isHtml(reply)) throw new NotTheServer(method, path, reply.status, reply.headers.get('content-type'));
        if (reply.status < 400) return reply;
        if (reply.status < 500 && reply.status !== 429) {
          const refused = await errorBody(reply, method, path);
          throw new Refusal(method, path, reply.status, refused, this.roundGoneErrors.has(refused.error));
        }
        problem = `HTTP ${reply.status} ${(await errorBody(reply, method, path)).detail}`;
        retryAfter = reply.headers.get('retry-after');
        busy = true;
      }
      if (attempt + 1 < this.attempts) {
        const delay = this.backoff(attempt, retryAfter);
        if (this.onRetry) this.onRetry(retryLine(busy, delay));
        await this.sleep(delay);
      }
    }
    throw new Unreachable(`${method} ${path} failed ${this.attempts} times (last: ${problem})`, busy);
  }

  /** Seconds before the next try: the server's Retry-After (capped), else exponential backoff with jitter. */
  backoff(/** @type {number} */ attempt, /** @type {string | null} */ retryAfter) {
    const stated = retryAfter === null ? NaN : Number(retryAfter);
    if (Number.isFinite(stated)) return Math.min(Math.max(stated, 0), 10 * this.maxDelay);
    return Math.min(this.firstDelay * 2 ** attempt, this.maxDelay) * (0.5 + 0.5 * Math.random());
  }

  /** @returns {Promise<Record<string, any>>} the JSON object of a reply; anything else is NotTheServer */
  async json(/** @type {Response} */ reply, /** @type {string} */ method, /** @type {string} */ path) {
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
 * @param {Tensors} tensors
 * @param {UploadMeta} meta
 * @param {Record<string, string>} [extra]
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
export function pythonFloat(/** @type {number} */ value) {
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

/** What a person reads while the page waits to try again: "No connection; trying again in 14 s." */
export function retryLine(/** @type {boolean} */ busy, /** @type {number} */ seconds) {
  return `${busy ? 'The server is busy' : 'No connection to the server'}; trying again in ${Math.max(1, Math.round(seconds))} s.`;
}

function isHtml(/** @type {Response} */ reply) {
  return /^\s*text\/html/i.test(reply.headers.get('content-type') || '');
}

/** @returns {Promise<ErrorBody>} */
async function errorBody(/** @type {Response} */ reply, /** @type {string} */ method, /** @type {string} */ path) {
  let body;
  try {
    body = await reply.json();
  } catch {
    throw new NotTheServer(method, path, reply.status, reply.headers.get('content-type'));
  }
  return body && typeof body === 'object'
    ? { error: body.error || 'http_error', detail: body.detail || '', fix: body.fix || '' }
    : { error: 'http_error', detail: String(body), fix: '' };
}
