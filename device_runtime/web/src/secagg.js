// @ts-check
// The browser device's side of secure aggregation (SecAgg+ / SecAgg with double masking), as edgepfl/secagg
// specifies it, split as that package is: keys (X25519, HKDF-SHA256, AES-GCM), the ring and its masks, Shamir
// shares, the plan's numbers (config), the graph, the quantizer, the messages, the client session and a device's round. This module
// is the package's public face, as edgepfl/secagg/__init__.py is: the page and the tests import from it.
// Only WebCrypto (crypto.subtle: https pages and localhost) and BigInt; no other dependency.

export { uniformRandom } from './encoding.js';
export { SecAggError } from './errors.js';
export { checkPlan, levels, paddedSize, rotationBlock, vectorLength, weightDigits } from './secagg_config.js';
export { graphSeed, neighbourMap } from './secagg_graph.js';
export { agree, decrypt, derive, encrypt, info, publicKey, systemRandomBytes } from './secagg_keys.js';
export { b64, maskedInputBytes, messageFromJson, messageToJson, unb64 } from './secagg_messages.js';
export { quantizeDelta, rotate } from './secagg_quantize.js';
export { maskVector, pack, unpack } from './secagg_ring.js';
export { takeSecureSteps } from './secagg_round.js';
export { ClientSession, inboxDigest, SEALED_BYTES } from './secagg_session.js';
export { PRIME, shamirSplit } from './secagg_shamir.js';
