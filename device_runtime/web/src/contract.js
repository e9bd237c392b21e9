// @ts-check
// The device contract: what the page must agree on with the Python device, written by Python
// (device_runtime/contract.py) and served at /device/contract.json: every round setting's default, type and
// bounds, the algorithms' phases, the refusal codes that end a round, timing, the divergence rule, the seeds.
// The page keeps no copy of any of it; this module reads it and checks round settings against it exactly as
// RoundSettings.problem() does.

import { DeviceError, describe } from './errors.js';
import { parseEncoding } from './encoding.js';

/** The contract version this page reads (device_runtime/contract.py CONTRACT_VERSION). */
export const CONTRACT_VERSION = 1;

/**
 * One round setting: its type in JSON Schema's words, whether null is allowed, its default, help and bounds.
 * @typedef {object} SettingSpec
 * @property {'integer' | 'number' | 'boolean' | 'string' | 'array' | 'object'} type
 * @property {boolean} nullable
 * @property {unknown} default
 * @property {string} help
 * @property {unknown[]} [enum]
 * @property {number} [minimum]
 * @property {number} [maximum]
 * @property {number} [exclusiveMinimum]
 * @property {string} [items] the JSON type of an array's items
 */

/** A phase as an algorithm declares it: `epochs` names the setting that gives its epochs, `lr` its learning rate's (null there: the shared lr). @typedef {{name: string, trainable: string, epochs: string, lr?: string}} PhaseSpec */
/** @typedef {{uploads: boolean, phases: PhaseSpec[]}} AlgorithmSpec */
/** Seconds: tries in all, the wait before the second, the cap on one wait. @typedef {{attempts: number, first_delay: number, max_delay: number}} RetryPolicy */

/**
 * @typedef {object} Contract
 * @property {number} version
 * @property {string} api_prefix
 * @property {Record<string, SettingSpec>} settings
 * @property {Record<string, AlgorithmSpec>} algorithms
 * @property {PhaseSpec} finetune_phase
 * @property {string[]} round_gone_errors
 * @property {{max_wait: number, poll_interval: number, retry: RetryPolicy}} timing
 * @property {{loss_factor: number}} divergence
 * @property {{seed: number, split_seed: number, val_fraction: number, min_train_examples: number, min_held_out: number}} device
 * @property {import('./modelfile.js').ModelFileSpec} model_file how to write `device export-model`'s file
 */

/**
 * A round's settings with every default filled in (the fields the page reads by name; the others pass through).
 * @typedef {Record<string, unknown> & {
 *   algorithm: string, epochs: number, batch_size: number, lr: number, finetune_epochs: number,
 *   personal_epochs: number, share_buffers: boolean, recompute_bn: boolean, kept_on_device: string[],
 *   upload_encoding: string, download_encoding: string, clip_norm: number | null
 * }} RoundSettings
 */

/** The contract from its JSON (as fetched, or read from the Node tests' fixtures); one it cannot read throws. */
export function parseContract(/** @type {unknown} */ json) {
  const contract = /** @type {Contract} */ (json);
  if (
    !isObject(json) ||
    contract.version !== CONTRACT_VERSION ||
    !isObject(contract.settings) ||
    !isObject(contract.algorithms)
  ) {
    const version = isObject(json) ? contract.version : undefined;
    throw new DeviceError(
      `the server's device contract (version ${version}) is not the one this page reads (version ${CONTRACT_VERSION})`,
      'reload the page; if that does not help, the server and its page come from different edgepfl versions',
    );
  }
  return contract;
}

/** The server's contract.json (beside the page); a network failure or a contract this page cannot read throws. */
export async function fetchContract(/** @type {URL | string} */ url, fetchImpl = globalThis.fetch) {
  let json;
  try {
    const reply = await fetchImpl(url, { cache: 'no-cache', credentials: 'omit' });
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    json = await reply.json();
  } catch (err) {
    throw new DeviceError(
      `the page could not load its contract.json from the server (${describe(err)})`,
      'reload the page once the network is back',
    );
  }
  return parseContract(json);
}

/** Settings JSON with the contract's defaults filled in for absent keys; keys the contract does not know are dropped. */
export function roundSettings(/** @type {Contract} */ contract, /** @type {object | null | undefined} */ json) {
  const given = /** @type {Record<string, unknown>} */ (json || {});
  /** @type {Record<string, unknown>} */
  const settings = {};
  for (const [name, spec] of Object.entries(contract.settings))
    settings[name] = name in given ? given[name] : structuredClone(spec.default);
  return /** @type {RoundSettings} */ (settings);
}

/** What is wrong with these settings (a type, a choice or a bound), or null when they are valid (RoundSettings.problem). */
export function settingsProblem(/** @type {Contract} */ contract, /** @type {Record<string, unknown>} */ settings) {
  for (const [name, spec] of Object.entries(contract.settings)) {
    const value = settings[name];
    if (value === null && spec.nullable) continue;
    if (!fits(value, spec)) return `${name} ${JSON.stringify(value) ?? 'undefined'} is not ${expected(spec)}`;
  }
  try {
    parseEncoding(settings.upload_encoding);
  } catch (err) {
    if (!(err instanceof DeviceError)) throw err;
    return `upload_encoding ${JSON.stringify(settings.upload_encoding)} is not fp32, fp16, int8, int8-block<N> or int8[...]-sr`;
  }
  return null;
}

/** The round settings of a task, defaults filled in; settings outside the contract throw one line before any training. */
export function checkedSettings(/** @type {Contract} */ contract, /** @type {unknown} */ json) {
  const given = isObject(json) || json == null ? /** @type {object | null | undefined} */ (json) : null;
  const settings = roundSettings(contract, given);
  const problem =
    given === null && json != null
      ? `settings are ${Array.isArray(json) ? 'a list' : typeof json}, not an object`
      : settingsProblem(contract, settings);
  if (problem !== null) {
    throw new DeviceError(
      `the server's round settings are invalid: ${problem}`,
      "ask the operator to check the server's round settings, or use a matching edgepfl version",
    );
  }
  return settings;
}

/** Whether a value has a setting's type and lies within its choices and bounds. */
function fits(/** @type {unknown} */ value, /** @type {SettingSpec} */ spec) {
  if (!hasType(value, spec.type)) return false;
  if (
    spec.type === 'array' &&
    spec.items &&
    !(/** @type {unknown[]} */ (value).every((item) => hasType(item, /** @type {SettingSpec['type']} */ (spec.items))))
  )
    return false;
  if (spec.enum && !spec.enum.includes(value)) return false;
  const number = /** @type {number} */ (value);
  if (spec.minimum !== undefined && !(number >= spec.minimum)) return false;
  if (spec.maximum !== undefined && !(number <= spec.maximum)) return false;
  return spec.exclusiveMinimum === undefined || number > spec.exclusiveMinimum;
}

function hasType(/** @type {unknown} */ value, /** @type {SettingSpec['type']} */ type) {
  switch (type) {
    case 'integer':
      return Number.isInteger(value);
    case 'number':
      return typeof value === 'number' && Number.isFinite(value);
    case 'boolean':
      return typeof value === 'boolean';
    case 'string':
      return typeof value === 'string';
    case 'array':
      return Array.isArray(value);
    case 'object':
      return isObject(value);
    default:
      return false;
  }
}

/** What a setting must be, in words: "an integer in 0..1000", "a positive number", "one of fp32, fp16". */
function expected(/** @type {SettingSpec} */ spec) {
  if (spec.enum) return `one of ${spec.enum.join(', ')}`;
  const range = spec.minimum !== undefined && spec.maximum !== undefined ? ` in ${spec.minimum}..${spec.maximum}` : '';
  switch (spec.type) {
    case 'integer':
      return `an integer${range}`;
    case 'number':
      return spec.exclusiveMinimum === 0 ? 'a positive number' : `a number${range}`;
    case 'boolean':
      return 'true or false';
    case 'array':
      return `a list of ${spec.items || 'value'}s`;
    case 'object':
      return 'an object';
    default:
      return `a ${spec.type}`;
  }
}

function isObject(/** @type {unknown} */ value) {
  return value !== null && typeof value === 'object' && !Array.isArray(value);
}
