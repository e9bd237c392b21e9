// @ts-check
// The page's one error class, as edgepfl's EdgePFLError: `problem` names what went wrong in one line, `fix` says
// what to do. Every error the page expects (engine, codec, data, storage, the server's refusals, the network)
// extends it, so the page shows any of them the same way.

/**
 * A problem the page expects: `problem` (one line) and `fix`, in words for the person holding the phone, and an
 * optional technical `detail` for whoever runs the server (the page shows it folded away); the message joins them
 * for logs and tests.
 */
export class DeviceError extends Error {
  /**
   * @param {string} problem what went wrong, in one line
   * @param {string} fix what to do about it
   * @param {string} [detail] the technical account (a request, a status code, the server's own words)
   */
  constructor(problem, fix, detail = '') {
    super(`${fix ? `${problem} — ${fix}` : problem}${detail ? ` (${detail})` : ''}`);
    this.name = new.target.name;
    this.problem = problem;
    this.fix = fix;
    this.detail = detail;
  }
}

/** A problem whose fix is to forget this device's state and join again (the page offers a button for it). */
export class StartOver extends DeviceError {}

/** A problem of the bundle, the model or its inputs, with the fix (engine.js exports it too). */
export class EngineError extends DeviceError {}

/** A problem with the person's data (photos, an .npz, a text or sensor file), with the fix (data.js exports it). */
export class DataError extends DeviceError {}

/** A secure-aggregation message or state that breaks the protocol (edgepfl's SecAggError); nothing held is lost. */
export class SecAggError extends DeviceError {}

/** The message of anything thrown (an Error's, else its text), for a line that quotes it. */
export function describe(/** @type {unknown} */ err) {
  if (err instanceof DeviceError) return err.problem;
  return err instanceof Error ? err.message : String(err);
}
