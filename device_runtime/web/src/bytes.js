// @ts-check
// Byte helpers the page's modules share (the model file's protobuf, the engine's frozen variants, SHA-256 and
// secure aggregation): one implementation each.

/** The parts one after another in one new array. @param {...Uint8Array} parts */
export function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let offset = 0;
  for (const part of parts) {
    out.set(part, offset);
    offset += part.length;
  }
  return out;
}

/** Whether two byte arrays hold the same bytes. @param {Uint8Array} a @param {Uint8Array} b */
export function equalBytes(a, b) {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}

/** Lower-case hex of bytes. @param {Uint8Array} bytes */
export function hex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}
