// @ts-check
// The device's model as one plain ONNX inference file, written in the page: the bundle's model.onnx with the
// device's tensors baked in, a softmax added and the metadata_props that `edgepfl device export-model` writes
// (device_runtime/model_export.py bake and set_metadata, fp32), so a person can take the model elsewhere.
// The file is rewritten at the protobuf level by a small reader and writer for exactly the fields involved:
// every other field passes through byte for byte, and fields are written in field-number order as protobuf
// writes them, so the page writes the very bytes Python writes for the same tensors. The texts and the order of
// the metadata come from the device contract (device_runtime/model_metadata.py).

import { concat } from './bytes.js';
import { classNames } from './data.js';
import { DeviceError } from './errors.js';
import { sampleEntry } from './manifest.js';
import { pythonFloat } from './protocol.js';

/** @typedef {import('./engine.js').Manifest} Manifest */
/** @typedef {import('./engine.js').Engine} Engine */
/** @typedef {import('./safetensors.js').Tensors} Tensors */
/**
 * The contract's `model_file` (model_metadata.py model_file_contract).
 * @typedef {object} ModelFileSpec
 * @property {string} producer_name
 * @property {string} producer_version
 * @property {string} graph_name
 * @property {{input: string, logits: string, probabilities: string}} names
 * @property {[string, string | null][]} metadata every key in file order, with its fixed value or null
 * @property {{standardized: string, scaled: string}} normalization
 * @property {string} doc_string a template: {model}, {description} and metadata keys such as {input_shape}
 * @property {Record<string, Record<string, string>>} [input_kinds] keys a non-image input's file says instead
 * @property {number} check_tolerance
 */
/** Which model of the device this is. @typedef {{trained: boolean, lastCompletedRound: number | null, description: string}} DeviceModelInfo */
/** One field of a protobuf message: its number, wire type and value (a varint's bytes, or a length-delimited field's content). @typedef {{number: number, wire: number, bytes: Uint8Array}} Field */

/** The bundle's inference graph cannot take the device's tensors, or the written file does not compute the model. */
export class ModelFileError extends DeviceError {}

// field numbers of onnx.proto
const MODEL = { producerName: 2, producerVersion: 3, docString: 6, graph: 7, metadataProps: 14 };
const GRAPH = { node: 1, name: 2, initializer: 5, input: 11, output: 12, valueInfo: 13 };
const NODE = { input: 1, output: 2, name: 3, opType: 4, attribute: 5 };
const TENSOR = { dims: 1, dataType: 2, name: 8, rawData: 9 };
const DATA_TYPES = {
  float32: 1,
  uint8: 2,
  int8: 3,
  uint16: 4,
  int16: 5,
  int32: 6,
  int64: 7,
  bool: 9,
  float16: 10,
  float64: 11,
  uint32: 12,
  uint64: 13,
};
const FLOAT = 1;
const ATTRIBUTE_INT = 2;
const LENGTH_DELIMITED = 2;
const text = new TextDecoder();
const utf8 = new TextEncoder();

/**
 * The file `edgepfl device export-model` writes (fp32) for these tensors: `modelOnnx` (the bundle's model.onnx)
 * computing `logits` and `probabilities` from `input` alone, the device's tensors as its initializers.
 * @param {Uint8Array} modelOnnx
 * @param {Tensors} tensors every param and buffer (engine.getTensors(): params, then buffers)
 * @param {Manifest} manifest
 * @param {ModelFileSpec} spec
 * @param {DeviceModelInfo} device
 */
export function deviceModelFile(modelOnnx, tensors, manifest, spec, device) {
  const model = readFields(modelOnnx, 'model.onnx');
  const graphField = model.find((f) => f.number === MODEL.graph);
  if (!graphField) throw new ModelFileError("the bundle's model.onnx holds no graph", 're-export the bundle');
  const graph = readFields(graphField.bytes, 'the graph of model.onnx');
  const all = (/** @type {Field[]} */ fields, /** @type {number} */ number) =>
    fields.filter((f) => f.number === number);
  const initializers = all(graph, GRAPH.initializer).map((f) => ({
    field: f,
    name: stringOf(readFields(f.bytes, 'an initializer'), TENSOR.name),
  }));
  const named = new Set(initializers.map((i) => i.name));
  if (!manifest.tensors.every((t) => named.has(t.name))) {
    throw new ModelFileError(
      "the bundle's model.onnx does not name the model's tensors (an older export, with BatchNorm folded in)",
      'ask whoever runs the server to export the model again with this edgepfl version',
    );
  }
  const { input, logits, probabilities } = spec.names;
  const [imageInput] = all(graph, GRAPH.input);
  const [logitsOutput] = all(graph, GRAPH.output);
  if (!imageInput || !logitsOutput)
    throw new ModelFileError("the bundle's model.onnx has no input or output", 're-export the bundle');
  /** @type {[string, string][]} */
  const pairs = [
    [nameOf(imageInput), input],
    [nameOf(logitsOutput), logits],
  ];
  const renames = new Map(pairs.filter(([from, to]) => from !== to));

  // nodes: renamed, the softmax added, then only those the outputs depend on (model_export.py _prune)
  const nodes = all(graph, GRAPH.node).map((f) => renamedNode(f, renames));
  const softmax = [
    stringField(NODE.input, logits),
    stringField(NODE.output, probabilities),
    stringField(NODE.name, probabilities),
    stringField(NODE.opType, 'Softmax'),
    messageField(NODE.attribute, [stringField(1, 'axis'), varintField(3, 1), varintField(20, ATTRIBUTE_INT)]),
  ];
  nodes.push({ field: messageField(GRAPH.node, softmax), inputs: [logits], outputs: [probabilities] });
  const needed = new Set([logits, probabilities]);
  const kept = [];
  for (const node of nodes.reverse()) {
    if (node.outputs.some((name) => needed.has(name))) {
      kept.push(node);
      for (const name of node.inputs) needed.add(name);
    }
  }
  kept.reverse();
  const used = new Set(kept.flatMap((node) => node.inputs));
  const produced = new Set(kept.flatMap((node) => node.outputs));

  // initializers: the graph's own constants in their order, then the device's tensors in their order
  const baked = Object.entries(tensors)
    .filter(([name]) => used.has(name))
    .map(([name, tensor]) => ({ field: tensorField(name, tensor), name }));
  const ownConstants = initializers.filter((i) => !Object.hasOwn(tensors, i.name));
  const image = valueInfo(renamed(imageInput, renames), input, ['batch', ...manifest.input.shape]);
  const outputInfo = readFields(renamed(logitsOutput, renames).bytes, 'an output');
  const newGraph = replaceFields(
    graph,
    [GRAPH.node, GRAPH.name, GRAPH.initializer, GRAPH.input, GRAPH.output, GRAPH.valueInfo],
    [
      ...kept.map((node) => node.field),
      stringField(GRAPH.name, spec.graph_name),
      ...[...ownConstants, ...baked].filter((i) => used.has(i.name)).map((i) => i.field),
      image,
      messageField(GRAPH.output, outputInfo),
      valueInfo(null, probabilities, ['batch', manifest.num_classes]),
      ...all(graph, GRAPH.valueInfo)
        .map((f) => renamed(f, renames))
        .filter((f) => produced.has(nameOf(f))),
    ],
  );

  const props = metadataProps(manifest, spec, device);
  const docString = spec.doc_string.replace(/\{(\w+)\}/g, (_, key) =>
    key === 'description' ? device.description : (props.get(key) ?? ''),
  );
  return writeFields(
    replaceFields(
      model,
      [MODEL.producerName, MODEL.producerVersion, MODEL.docString, MODEL.graph, MODEL.metadataProps],
      [
        stringField(MODEL.producerName, spec.producer_name),
        stringField(MODEL.producerVersion, spec.producer_version),
        stringField(MODEL.docString, docString),
        messageField(MODEL.graph, newGraph),
        ...[...props].map(([key, value]) =>
          messageField(MODEL.metadataProps, [stringField(1, key), stringField(2, value)]),
        ),
      ],
    ),
  );
}

/**
 * The file's metadata_props in order (model_metadata.py metadata_props): the contract's fixed values, and the
 * model's and the device's own.
 * @param {Manifest} manifest
 * @param {ModelFileSpec} spec
 * @param {DeviceModelInfo} device
 */
export function metadataProps(manifest, spec, device) {
  const { mean = [], std = [], shape } = manifest.input;
  const name = /** @type {{model?: {name?: string}}} */ (manifest).model?.name;
  /** @type {Record<string, string>} */
  const values = {
    model: String(name ?? ''),
    input_shape: pythonList([JSON.stringify('batch'), ...shape.map(String)]),
    normalization: mean.length ? spec.normalization.standardized : spec.normalization.scaled,
    mean: pythonList(mean.map(pythonFloat)),
    std: pythonList(std.map(pythonFloat)),
    num_classes: String(manifest.num_classes),
    class_names: pythonList(classNames(manifest).map(pythonString)),
    base_layout_hash: manifest.base_layout_hash,
    trained: device.trained ? 'true' : 'false',
    last_completed_round: device.lastCompletedRound == null ? '' : String(device.lastCompletedRound),
    quantization: 'none',
  };
  const props = new Map(spec.metadata.map(([key, fixed]) => [key, fixed ?? values[key]]));
  // a text or sensor bundle's file names its own input instead of the image keys (its kind's model_file)
  const kind = spec.input_kinds?.[String(sampleEntry(manifest).kind)];
  if (kind)
    for (const [key, value] of Object.entries({ input_dtype: manifest.input.dtype || 'float32', ...kind }))
      props.set(key, value);
  return props;
}

/**
 * Whether the written file computes the engine's model: its probabilities in onnxruntime against the engine's on
 * `count` inputs (model_export.py compare_with_engine); returns the largest difference, or throws past the tolerance.
 * @param {typeof import('onnxruntime-web')} ort
 * @param {Uint8Array} file
 * @param {Engine} engine holding the tensors baked into the file
 * @param {import('./engine.js').ModelInput} x
 * @param {number} count
 * @param {ModelFileSpec} spec
 * @param {Map<string, import('onnxruntime-web').Tensor>} [held] the engine's snapshot baked into the file (default: its current tensors)
 */
export async function checkModelFile(ort, file, engine, x, count, spec, held = engine.state) {
  const session = await ort.InferenceSession.create(file, { executionProviders: ['wasm'] });
  try {
    const feeds = { [spec.names.input]: new ort.Tensor(engine.inputType.dtype, x, [count, ...engine.sampleShape]) };
    const got = /** @type {Float32Array} */ (
      (await session.run(feeds, [spec.names.probabilities]))[spec.names.probabilities].data
    );
    const want = await engine.predict(x, count, held);
    let worst = 0;
    for (let i = 0; i < want.length; i++) worst = Math.max(worst, Math.abs(got[i] - want[i]));
    if (!(worst <= spec.check_tolerance)) {
      throw new ModelFileError(
        `the model file's answers differ from the model's by ${worst.toPrecision(3)}`,
        'reload the page and try again; if it persists, tell whoever runs the server',
      );
    }
    return worst;
  } finally {
    await session.release();
  }
}

/** The fields of a protobuf message in their order (groups, which ONNX never uses, are refused). */
export function readFields(/** @type {Uint8Array} */ bytes, what = 'the model file') {
  /** @type {Field[]} */
  const fields = [];
  let at = 0;
  while (at < bytes.length) {
    const [tag, start] = readVarint(bytes, at, what);
    const number = Math.floor(tag / 8);
    const wire = tag % 8;
    let end;
    let content = start;
    if (wire === 0) end = readVarint(bytes, start, what)[1];
    else if (wire === 1) end = start + 8;
    else if (wire === 5) end = start + 4;
    else if (wire === LENGTH_DELIMITED) {
      const [length, after] = readVarint(bytes, start, what);
      content = after;
      end = after + length;
    } else
      throw new ModelFileError(
        `${what} is not a protobuf message this page reads (wire type ${wire})`,
        're-export the bundle',
      );
    if (end > bytes.length || number < 1)
      throw new ModelFileError(`${what} is cut short or damaged`, 're-export the bundle');
    fields.push({ number, wire, bytes: bytes.subarray(content, end) });
    at = end;
  }
  return fields;
}

/** The bytes of a message of these fields, in the order given. */
export function writeFields(/** @type {Field[]} */ fields) {
  /** @type {Uint8Array[]} */
  const parts = [];
  for (const { number, wire, bytes } of fields) {
    parts.push(varint(number * 8 + wire));
    if (wire === LENGTH_DELIMITED) parts.push(varint(bytes.length));
    parts.push(bytes);
  }
  return concat(...parts);
}

/** `fields` without those of the numbers given, plus `added`, in field-number order (protobuf's own order). */
function replaceFields(/** @type {Field[]} */ fields, /** @type {number[]} */ numbers, /** @type {Field[]} */ added) {
  const dropped = new Set(numbers);
  const all = [...fields.filter((f) => !dropped.has(f.number)), ...added];
  return all
    .map((field, i) => ({ field, i }))
    .sort((a, b) => a.field.number - b.field.number || a.i - b.i)
    .map(({ field }) => field);
}

/** A node with its inputs and outputs renamed, and their names. */
function renamedNode(/** @type {Field} */ field, /** @type {Map<string, string>} */ renames) {
  const original = readFields(field.bytes, 'a node');
  const fields = original.map((f) =>
    f.number === NODE.input || f.number === NODE.output ? renamedString(f, renames) : f,
  );
  const names = (/** @type {number} */ number) =>
    fields.filter((f) => f.number === number).map((f) => text.decode(f.bytes));
  const changed = fields.some((f, i) => f !== original[i]);
  return {
    field: changed ? messageField(GRAPH.node, fields) : field,
    inputs: names(NODE.input),
    outputs: names(NODE.output),
  };
}

/** A value info (graph input, output) with its name renamed. */
function renamed(/** @type {Field} */ field, /** @type {Map<string, string>} */ renames) {
  if (!renames.has(nameOf(field))) return field;
  return {
    ...field,
    bytes: writeFields(
      readFields(field.bytes, 'a value info').map((f) => (f.number === 1 ? renamedString(f, renames) : f)),
    ),
  };
}

function renamedString(/** @type {Field} */ field, /** @type {Map<string, string>} */ renames) {
  const to = renames.get(text.decode(field.bytes));
  return to === undefined ? field : { ...field, bytes: utf8.encode(to) };
}

/**
 * A graph input or output of float tensors with these dimensions (a string is a named dimension): `from` keeps its
 * other fields and its element type (model_export.py bake), null makes one as onnx.helper.make_tensor_value_info.
 * @param {Field | null} from
 * @param {string} name
 * @param {(string | number)[]} dims
 */
function valueInfo(from, name, dims) {
  const shape = dims.map((d) => messageField(1, [typeof d === 'string' ? stringField(2, d) : varintField(1, d)]));
  if (!from)
    return messageField(GRAPH.output, [
      stringField(1, name),
      messageField(2, [messageField(1, [varintField(1, FLOAT), messageField(2, shape)])]),
    ]);
  const info = readFields(from.bytes, 'a value info');
  const type = readFields(fieldOf(info, 2).bytes, 'a type');
  const tensorType = readFields(fieldOf(type, 1).bytes, 'a tensor type');
  const newTensorType = replaceFields(tensorType, [2], [messageField(2, shape)]);
  const newType = replaceFields(type, [1], [messageField(1, newTensorType)]);
  return messageField(from.number, replaceFields(info, [2], [messageField(2, newType)]));
}

/** A TensorProto as onnx.numpy_helper.from_array makes it: dims, data type, name, raw little-endian bytes. */
function tensorField(/** @type {string} */ name, /** @type {import('./safetensors.js').Tensor} */ tensor) {
  const dataType = /** @type {Record<string, number>} */ (DATA_TYPES)[tensor.dtype];
  if (!dataType)
    throw new ModelFileError(
      `tensor ${name} has dtype ${tensor.dtype}, which the model file cannot hold`,
      're-export the bundle',
    );
  const data = tensor.data;
  return messageField(GRAPH.initializer, [
    ...tensor.shape.map((d) => varintField(TENSOR.dims, d)),
    varintField(TENSOR.dataType, dataType),
    stringField(TENSOR.name, name),
    {
      number: TENSOR.rawData,
      wire: LENGTH_DELIMITED,
      bytes: new Uint8Array(data.buffer, data.byteOffset, data.byteLength),
    },
  ]);
}

function fieldOf(/** @type {Field[]} */ fields, /** @type {number} */ number) {
  const found = fields.find((f) => f.number === number);
  if (!found)
    throw new ModelFileError(`the bundle's model.onnx lacks field ${number} of a graph input`, 're-export the bundle');
  return found;
}

function nameOf(/** @type {Field} */ field) {
  return stringOf(readFields(field.bytes, 'a value info'), 1);
}

function stringOf(/** @type {Field[]} */ fields, /** @type {number} */ number) {
  const found = fields.find((f) => f.number === number);
  return found ? text.decode(found.bytes) : '';
}

/** @returns {Field} */
function stringField(/** @type {number} */ number, /** @type {string} */ value) {
  return { number, wire: LENGTH_DELIMITED, bytes: utf8.encode(value) };
}

/** @returns {Field} */
function messageField(/** @type {number} */ number, /** @type {Field[]} */ fields) {
  return { number, wire: LENGTH_DELIMITED, bytes: writeFields(fields) };
}

/** @returns {Field} */
function varintField(/** @type {number} */ number, /** @type {number} */ value) {
  return { number, wire: 0, bytes: varint(value) };
}

/** A non-negative integer (below 2^53) as a protobuf varint. */
function varint(/** @type {number} */ value) {
  if (!(Number.isSafeInteger(value) && value >= 0))
    throw new ModelFileError(`${value} cannot be written as a protobuf varint`, 're-export the bundle');
  const bytes = [];
  while (value >= 0x80) {
    bytes.push((value % 0x80) | 0x80);
    value = Math.floor(value / 0x80);
  }
  bytes.push(value);
  return Uint8Array.from(bytes);
}

/** @returns {[number, number]} a varint's value (as a number) and the position after it */
function readVarint(/** @type {Uint8Array} */ bytes, /** @type {number} */ at, /** @type {string} */ what) {
  let value = 0;
  let scale = 1;
  for (let i = 0; i < 10; i++) {
    if (at >= bytes.length) break;
    const byte = bytes[at++];
    value += (byte & 0x7f) * scale;
    if (byte < 0x80) return [value, at];
    scale *= 0x80;
  }
  throw new ModelFileError(`${what} is cut short or damaged`, 're-export the bundle');
}

/** A list as Python's json.dumps writes it: items joined by ", ". */
function pythonList(/** @type {string[]} */ items) {
  return `[${items.join(', ')}]`;
}

/** A string as Python's json.dumps writes it (ensure_ascii: every character outside ' '..'~' escaped). */
function pythonString(/** @type {string} */ value) {
  return JSON.stringify(value).replace(/[^\x20-\x7e]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
}
