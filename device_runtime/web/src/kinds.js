// @ts-check
// The kinds of sample a bundle's model reads, one module each, in one table keyed by the kind's name: the
// manifest's `sample.kind` ("image", "next-word", "sensor"; bundles exported before it have `task.kind`, and no
// entry at all for images). A kind owns how a person gives its samples (its section of the page), their checks,
// normalisation and split, what Try it shows and the words the page uses for them; no other module of the page
// asks which kind a bundle has. A new kind (audio, say) is one module `kind_NAME.js` and one line of KINDS.

import { imageKind } from './kind_image.js';
import { nextWordKind } from './kind_next_word.js';
import { sensorKind } from './kind_sensor.js';
import { EngineError } from './errors.js';
import { sampleEntry } from './manifest.js';

/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./engine.js').Engine} Engine */
/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./store.js').PageStore} PageStore */
/** @typedef {import('./algorithms.js').Samples} Samples */
/** @typedef {import('onnxruntime-web').Tensor} OrtTensor */

/**
 * How the page names the samples of a kind, for the person holding the phone.
 * @typedef {object} KindWords
 * @property {string} one what a held-out score counts: "example", "next word", "window"
 * @property {string} [sample] a training sample where it is not `one` ("sentence": a next-word sample is a line's
 *   words, each of its next words scored)
 * @property {string} right what the model does right with one: "recognised", "guessed right"
 * @property {string} more how to add more, after "Add 4 more windows": "" or " (record longer)"
 * @property {string} rate the training speed's unit: "images", "sentences", "windows"
 * @property {string} [measure] what held-out accuracy counts, said in place of guessing's share (none: guessing's)
 */
/**
 * The person's samples as the round loop reads them: the words for them, how many there are, a promise of more,
 * their train/held-out split (normalised, as the Python device splits them) and up to `count` of them as model
 * input (to check a saved model file on; null: none held).
 * @typedef {object} ExampleSource
 * @property {KindWords} words
 * @property {() => number} count
 * @property {() => Promise<void>} added
 * @property {(valFraction: number, seed: number) => {train: Samples, val: Samples}} split
 * @property {(count: number) => {x: import('./engine.js').ModelInput, count: number} | null} probe
 */
/**
 * What a kind's Try it is given: the engine, the tensors of the model the device keeps (a promise, renewed after
 * each saved round) and the queue that runs one prediction at a time.
 * @typedef {object} TryParts
 * @property {Engine} engine
 * @property {() => Promise<Map<string, OrtTensor>>} held
 * @property {(work: () => Promise<void>) => void} queue
 */
/**
 * A kind on the page of one bundle: its data section (the round loop's ExampleSource) and its part of Try it
 * (`modelChanged` is called after the model the device keeps changed).
 * @typedef {object} KindPage
 * @property {ExampleSource} examples
 * @property {(parts: TryParts) => {modelChanged: () => void}} tryIt
 */
/**
 * What a kind is given to open on the page.
 * @typedef {object} KindParts
 * @property {Manifest} manifest
 * @property {PageStore} store
 * @property {Contract} contract
 * @property {(path: string) => Promise<Uint8Array>} bundleFile a file of the bundle, sha256-checked
 */
/**
 * A kind of sample: its name (the manifest's), its words, whether the page's thread must stay free while a round
 * trains (the motion sensors' readings come on it, 60 a second: the engine then runs in a worker), and how it opens
 * on the page.
 * @typedef {object} SampleKind
 * @property {string} name
 * @property {KindWords} words
 * @property {boolean} freeThread
 * @property {(parts: KindParts) => Promise<KindPage>} open
 */

/** @type {Map<string, SampleKind>} the kinds the page reads, by name */
const KINDS = new Map([imageKind, nextWordKind, sensorKind].map((kind) => [kind.name, kind]));

/** The kind of sample a bundle's model reads (no kind named: images); one the page does not know is refused. */
export function sampleKind(/** @type {Manifest} */ manifest) {
  const kind = sampleEntry(manifest).kind || imageKind.name;
  const known = KINDS.get(kind);
  if (!known) {
    throw new EngineError(
      `the server's model reads samples of kind "${kind}", which this page cannot`,
      'ask whoever runs the server to update the page',
    );
  }
  return known;
}
