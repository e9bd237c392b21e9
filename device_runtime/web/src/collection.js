// @ts-check
// What a text or sensor bundle collects on the phone (sentences typed, windows recorded, or the lines or windows of
// a file the person picks): kept in the page's store one record each, oldest first, up to the kind's cap (the oldest
// dropped, and the page says so), never sent. The section shows how much the phone holds and how it splits, takes a
// file, saves everything as the file `edgepfl device train --data` reads ("Save my data") and forgets it. The round
// loop reads it as its ExampleSource; the kind (kind_next_word.js, kind_sensor.js) says what a record is.

import { shortfallLine, shortfallReason } from './data.js';
import { DeviceError } from './errors.js';
import { plural } from './results.js';
import { $, clearProblem, fatal, readPicked, showHeld, showProblem, status } from './ui.js';

/** @typedef {import('./contract.js').Contract} Contract */
/** @typedef {import('./store.js').PageStore} PageStore */
/** @typedef {import('./store.js').Saved} Saved */
/** @typedef {import('./kinds.js').ExampleSource} ExampleSource */
/** @typedef {import('./kinds.js').KindWords} KindWords */
/** @typedef {import('./algorithms.js').Samples} Samples */

/**
 * The words of a collecting kind's section: its title and what it asks for, the file picker (its label, the types
 * it offers, the suffix a file must have and the fix for one without), what one record is ("sentence") and how it
 * comes ("typed"), the forget button, and the name and type of the file Save my data writes.
 * @typedef {object} CollectionWords
 * @property {string} title
 * @property {string} needs
 * @property {string} pick
 * @property {string} accept
 * @property {string} suffix
 * @property {string} notFix
 * @property {string} record one record: "sentence", "window"
 * @property {string} forget the button that erases them: "Forget what I typed"
 * @property {string} fileName what Save my data names its file
 * @property {string} fileType its media type
 */
/**
 * A kind that collects its samples on the phone: its name and words, its cap, a record and its item, a picked
 * file's items, the saved file's text, and the samples items make (count, classes, split, probe).
 * @template Item
 * @typedef {object} Collecting
 * @property {string} name the kind's name (an older page kept a picked file under `examples`, with it)
 * @property {KindWords} words
 * @property {CollectionWords} file
 * @property {number} cap records kept at most (the oldest dropped)
 * @property {(record: unknown) => Item} decode a stored record (records.js), refused with one DeviceError
 * @property {(item: Item) => unknown} encode the record of an item
 * @property {(bytes: Uint8Array, name: string) => Item[]} read a picked file's items, refused with one DeviceError
 * @property {(items: Item[]) => string} write the file Save my data writes (read back, the same samples)
 * @property {(items: Item[]) => number} count the samples the items make
 * @property {(items: Item[]) => number} classesHeld the classes their samples show (0: not counted)
 * @property {(items: Item[], valFraction: number, seed: number) => {train: Samples, val: Samples}} split
 * @property {(items: Item[], count: number) => {x: import('./engine.js').ModelInput, count: number} | null} probe
 * @property {Saved} [forgotten] what else Forget erases (the keyboard's measure)
 */
/**
 * The section as the kind's capture uses it: the items held, adding some (with kv `changes` in the same
 * transaction; false when the browser could not keep them, the problem shown and nothing lost), and a listener
 * of changes.
 * @template Item
 * @typedef {object} Collection
 * @property {ExampleSource} examples
 * @property {() => Item[]} items
 * @property {(items: Item[], said: string, changes?: Saved) => Promise<boolean>} add
 * @property {(listener: () => void) => void} onChange
 */

/**
 * Open a kind's collection: read what the store holds (an older page's kept file moved into it), draw the section.
 * @template Item
 * @param {{store: PageStore, contract: Contract, kind: Collecting<Item>}} parts
 * @returns {Promise<Collection<Item>>}
 */
export async function openCollection({ store, contract, kind }) {
  const { file } = kind;
  /** @type {Item[]} */
  let items = [];
  let unreadable = 0;
  for (const record of await store.samples()) {
    try {
      items.push(kind.decode(record));
    } catch (err) {
      if (!(err instanceof DeviceError)) throw err;
      unreadable += 1; // left in the store, never trained on; Forget erases it
    }
  }
  if (unreadable) {
    showProblem({
      problem: `${plural(unreadable, `${file.record} kept on this phone`, `${file.record}s kept on this phone`)} could not be read, so the model does not learn from ${unreadable === 1 ? 'it' : 'them'}`,
      fix: `${file.forget.toLowerCase()} to start afresh, or carry on without ${unreadable === 1 ? 'it' : 'them'}`,
    });
  }
  /** @type {(() => void)[]} */
  const listeners = [];
  /** @type {(() => void)[]} */
  let waiting = [];
  const changed = () => {
    render();
    for (const listener of listeners) listener();
    for (const resolve of waiting) resolve();
    waiting = [];
  };
  const render = () => renderCollection(items, kind, contract);
  /** @type {Collection<Item>['add']} */
  const add = async (more, said, changes = {}) => {
    if (!more.length) return true;
    let dropped;
    try {
      dropped = await store.addSamples(more.map(kind.encode), kind.cap, changes);
    } catch (err) {
      if (!(err instanceof DeviceError)) throw err;
      showProblem(err); // a full storage: nothing was written, what the person gave stays where it was
      return false;
    }
    items = [...items, ...more].slice(Math.max(0, items.length + more.length - kind.cap));
    clearProblem();
    const keeps = `this phone keeps the newest ${kind.cap}`;
    status(dropped ? `${said} The oldest ${plural(dropped, file.record)} went: ${keeps}.` : said);
    changed();
    return true;
  };

  const saved = /** @type {any} */ ((await store.get('examples')).examples);
  if (saved && saved.kind === kind.name && typeof saved.text === 'string') {
    // an older page kept the file a person picked: its lines or windows join the collection, the file goes
    const moved = kind.read(new TextEncoder().encode(saved.text), String(saved.name));
    await add(moved, `Kept ${saved.name} on this phone.`, { examples: undefined });
  }

  $('recording-title').textContent = file.title;
  $('recording-needs').textContent = file.needs;
  $('recording-pick').textContent = file.pick;
  const input = $('recording-file', HTMLInputElement);
  input.accept = file.accept;
  input.addEventListener('change', () => {
    const name = input.files && input.files[0] ? input.files[0].name : 'the file';
    readPicked(input, `Reading ${name}…`, async (files) => {
      if (!files[0].name.toLowerCase().endsWith(file.suffix)) {
        throw new DeviceError(`the file ${files[0].name} is not a ${file.suffix} file`, file.notFix);
      }
      const read = kind.read(new Uint8Array(await files[0].arrayBuffer()), files[0].name);
      await add(read, `Kept ${plural(read.length, file.record)} of ${files[0].name}.`);
    }).catch(fatal);
  });
  const forget = $('recording-forget', HTMLButtonElement);
  forget.textContent = file.forget;
  forget.addEventListener('click', () => {
    const held = plural(items.length + unreadable, file.record);
    if (!confirm(`${file.forget}: delete the ${held} on this phone? What the model already learned from them stays.`))
      return;
    store
      .clearSamples(kind.forgotten || {})
      .then(() => {
        items = [];
        unreadable = 0;
        status(`Deleted the ${held} this phone kept.`);
        changed();
      })
      .catch(fatal);
  });
  $('save-data').addEventListener('click', () => saveFile(kind.write(items), file));
  $('recording').hidden = false;
  render();
  return {
    examples: {
      words: kind.words,
      count: () => kind.count(items),
      added: () => new Promise((resolve) => waiting.push(resolve)),
      split: (valFraction, seed) => kind.split(items, valFraction, seed),
      probe: (count) => (items.length ? kind.probe(items, count) : null),
    },
    items: () => items,
    add,
    onChange: (listener) => listeners.push(listener),
  };
}

/**
 * How much the phone holds (records, the samples they make, how those split), what is missing, and the buttons.
 * @template Item
 * @param {Item[]} items
 * @param {Collecting<Item>} kind
 * @param {Contract} contract
 */
function renderCollection(items, kind, contract) {
  const count = kind.count(items);
  const { device } = contract;
  const short = [shortfallLine(count, device, kind.words), shortfallReason(count, device, kind.words)].join(' ');
  let split = '';
  if (count && !short.trim()) {
    const { train, val } = kind.split(items, device.val_fraction, device.split_seed);
    split = ` They make ${plural(count, kind.words.sample ?? kind.words.one)}: ${train.count} to learn from and ${val.count} kept aside to check how well the model does.`;
  }
  const held = `${plural(items.length, kind.file.record)} on this phone (it keeps the newest ${kind.cap}), never sent.`;
  $('recording-held').textContent = `${held}${split} ${short}`.trim();
  Object.assign($('recording-held').dataset, { records: String(items.length), samples: String(count) });
  $('recording-forget').hidden = !items.length;
  $('save-data').hidden = !items.length;
  showHeld(kind.words, kind.classesHeld(items));
}

/** Hand the person a file (Save my data): a download of `text`, named as the kind names it. */
function saveFile(/** @type {string} */ text, /** @type {CollectionWords} */ file) {
  const link = $('data-link', HTMLAnchorElement);
  if (link.href.startsWith('blob:')) URL.revokeObjectURL(link.href);
  link.href = URL.createObjectURL(new Blob([text], { type: file.fileType }));
  link.download = file.fileName;
  link.click();
}
