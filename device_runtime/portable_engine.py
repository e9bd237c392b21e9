"""The portable engine: runs a bundle's standard-ONNX step graphs with plain onnxruntime (no training build)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import numpy as np
import onnxruntime as ort

from edgepfl.device_runtime.engine import DistillStep, Engine, EvalResult, check_distill_set, model_input
from edgepfl.errors import BundleError, DataError, UsageError
from edgepfl.manifest import Manifest
from edgepfl.wire import check_tensors, load_tensors

BAKE_AFTER_STEPS = 2  # a step's frozen variant runs from the third step on the same frozen tensors


class PortableEngine(Engine):
    """Trains and evaluates with the `portable/` graphs; tensors stay OrtValues between steps."""

    name = "portable"

    def __init__(
        self, bundle_dir: str | os.PathLike, manifest: Manifest, threads: int | None = None, bake_frozen: bool = True
    ):
        super().__init__(bundle_dir, manifest)
        entry = manifest.engines.get("portable")
        if not entry:
            raise BundleError(f"{bundle_dir} has no portable graphs", "re-export with --engines portable")
        self.entry = entry
        self.batch_size = int(entry["batch_size"])
        # the graphs' label type: int32 (GPU back ends have no int64 kernels); bundles before it was written, int64
        self.label_dtype = np.dtype(entry.get("label_dtype", "int64"))
        self.threads = threads
        # graph inputs and outputs list the state tensors in the entry's order (params, then buffers)
        self._state_names = list(entry["params"]) + list(entry["buffers"])
        self._sessions: dict[str, ort.InferenceSession] = {}
        self._state: dict[str, ort.OrtValue] = {}
        # a step's frozen variant (export/frozen.py): its session with the frozen tensors it was built on, and the
        # number of plain steps run on the current frozen tensors (see _baked_session)
        self.bake_frozen = bake_frozen and hasattr(ort.SessionOptions, "add_external_initializers")
        self.bake_after = BAKE_AFTER_STEPS  # plain steps on the same frozen tensors before a variant is built
        self._baked: dict[str, tuple[ort.InferenceSession, tuple[ort.OrtValue, ...], list[ort.OrtValue]]] = {}
        self._plain_on: dict[str, tuple[tuple[ort.OrtValue, ...], int]] = {}
        initial = load_tensors(self.bundle_dir / entry["initial"])
        check_tensors(initial, [manifest.tensor(n) for n in self._state_names], "portable/initial.safetensors")
        self.set_tensors(initial)

    def get_tensors(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of the named tensors (all params and buffers when `names` is None)."""
        wanted = self._state_names if names is None else list(names)
        unknown = [n for n in wanted if n not in self._state]
        if unknown:
            raise UsageError(f"unknown tensor(s) {unknown[:3]}", "use names listed in the bundle's manifest.json")
        return {n: np.array(self._state[n].numpy(), copy=True) for n in wanted}

    def set_tensors(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Overwrite the named tensors; names, shapes and dtypes must match the manifest."""
        unknown = [n for n in tensors if n not in self._state_names]
        if unknown:
            raise UsageError(f"unknown tensor(s) {unknown[:3]}", "use names listed in the bundle's manifest.json")
        check_tensors(tensors, [self.manifest.tensor(n) for n in tensors], "set_tensors")
        for name, value in tensors.items():
            # a private copy: the OrtValue shares the array's memory
            self._state[name] = ort.OrtValue.ortvalue_from_numpy(np.array(value, copy=True, order="C"))

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float, trainable: str = "full") -> float:
        """One SGD step on a batch of at most `batch_size` samples (a shorter one is padded and masked)."""
        self.check_set(trainable)
        count = self._check_step_batch(x, y)
        batch = (*self._padded(x, y, 0, count), np.array(lr, dtype=np.float32))
        return self._run_step(f"step_{trainable}", self.entry["steps"][trainable], batch)

    def distill_step(self, step: DistillStep) -> float:
        """One SGD step on PersFL's distillation loss (variant kd or gd); returns the batch's loss before it."""
        self.check_set(step.trainable)
        graphs = self.entry.get("distill", {})
        check_distill_set(self.name, graphs, step.variant, step.trainable, "re-export the bundle with --distill")
        count = self._check_step_batch(step.x, step.y)
        step.checked(self.manifest)
        padded_teacher = np.zeros((self.batch_size, self.manifest.num_classes), dtype=np.float32)
        padded_teacher[:count] = step.teacher_logits
        scalars = (np.array(v, dtype=np.float32) for v in (step.temperature, step.lam, step.lr))
        batch = (*self._padded(step.x, step.y, 0, count), padded_teacher, *scalars)
        graph = graphs[step.variant][step.trainable]
        return self._run_step(f"distill_{step.variant}_{step.trainable}", graph, batch)

    def _check_step_batch(self, x: np.ndarray, y: np.ndarray) -> int:
        """The sample count of a training batch, which must fit the step graphs' fixed batch size."""
        count = self._check_batch(x, y)
        if count > self.batch_size:
            raise DataError(
                f"a batch of {count} samples exceeds the portable graphs' batch size {self.batch_size}",
                f"train with batches of at most {self.batch_size} or re-export with a larger portable batch",
            )
        return count

    def _run_step(self, key: str, graph: dict, batch: tuple[np.ndarray, ...]) -> float:
        """Run one step graph on the current state plus `batch`; keep the new state, return the loss.

        A step with a frozen variant leaves its frozen tensors' OrtValues as they are (the graph has no outputs
        for them; in bundles before 2026-11-30 it had copies, not fetched), so that the next step can tell they
        did not change and run the variant instead."""
        by_input = dict(zip(graph["inputs"][: len(self._state_names)], self._state_names))
        by_output = self._updates(graph)
        frozen = graph.get("frozen")
        kept = set(by_input[name] for name in frozen["initializers"]) if frozen else set()
        values = tuple(self._state[by_input[name]] for name in frozen["initializers"]) if frozen else ()
        counted = frozen and self.bake_frozen  # the plain steps on the same frozen tensors, see _baked_session
        baked = self._baked_session(key, frozen, values) if counted else None
        session, inputs, outputs = (
            (baked, frozen["inputs"], frozen["outputs"])
            if baked
            else (self._session(key, graph["model"]), graph["inputs"], graph["outputs"])
        )
        state_inputs = [name for name in inputs if name in by_input]
        binding = self._bind_state(session, ((name, by_input[name]) for name in state_inputs))
        for name, value in zip(inputs[len(state_inputs) :], batch):
            binding.bind_cpu_input(name, value)
        fetched = [outputs[0], *(name for name in outputs[1:] if by_output[name] not in kept)]
        for name in fetched:  # a plain graph's copies of the frozen tensors are not fetched
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        if counted and not baked:
            held = self._plain_on.get(key)
            steps = held[1] if held is not None and _same(held[0], values) else 0
            self._plain_on[key] = (values, steps + 1)
        loss, *state = binding.get_outputs()
        self._state.update((by_output[name], value) for name, value in zip(fetched[1:], state))
        return float(loss.numpy())

    def _updates(self, graph: dict) -> dict[str, str]:
        """Which state tensor each of a step graph's outputs after the loss is the new value of: the entry's
        `updates`, or (a bundle exported before steps left out the tensors they pass through) every state tensor
        in order."""
        outputs = graph["outputs"][1:]
        updates = graph.get("updates")
        if updates is None:
            return dict(zip(outputs, self._state_names))
        if not isinstance(updates, list) or len(updates) != len(outputs) or not set(updates) <= set(self._state_names):
            raise BundleError(
                f"{graph['model']}'s manifest entry does not name one of the bundle's tensors for each output",
                "re-export the bundle",
            )
        return dict(zip(outputs, updates))

    def _baked_session(self, key: str, frozen: dict, values: tuple[ort.OrtValue, ...]) -> ort.InferenceSession | None:
        """The step's frozen variant built on the frozen tensors `values`, or None for the plain graph.

        Building a variant costs about as much as opening the plain graph (0.35 s for mobilenet_v2's personal
        step at 96 px, about two of its steps) and saves a share of every later step on the same frozen
        tensors. It is built after `bake_after` plain steps on them: a caller that changes the frozen tensors
        every step, or trains a set for a step or two, never pays for one. The rule counts steps, not seconds,
        so a seeded run takes the same graphs, and gives the same numbers, every time."""
        built = self._baked.get(key)
        if built is not None and _same(built[1], values):
            return built[0]
        held = self._plain_on.get(key)
        if held is None or not _same(held[0], values) or held[1] < self.bake_after:
            return None
        # onnxruntime reads an external initializer from memory the caller owns: a step's outputs are its own
        owned = [ort.OrtValue.ortvalue_from_numpy(np.array(value.numpy(), copy=True)) for value in values]
        options = self._options()
        options.add_external_initializers(list(frozen["initializers"]), owned)
        path = str(self._path(frozen["model"]))
        try:
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime's own errors have no common type: one line, not its traceback
            raise BundleError(
                f"the frozen variant {frozen['model']} does not load ({str(exc).splitlines()[0][:200]})",
                "re-export the bundle, or export it with --no-frozen-variants",
            ) from None
        self._baked[key] = (session, values, owned)  # the session reads `owned` for as long as it lives
        return session

    def logits(self, x: np.ndarray) -> np.ndarray:
        """The current model's inference-mode logits, (n, classes) float32, for inputs of any count."""
        targets = np.zeros((len(x), *self.manifest.kind.target_shape), dtype=np.int64)
        count = self._check_batch(x, targets)
        key = self.predict_graph(count)
        graph = self.entry[key]
        size = graph.get("batch_size", self.batch_size)
        session = self._session(key, graph["model"])
        rows = []
        for start in range(0, count, size):
            chunk = min(size, count - start)
            binding = self._bind_state(session, zip(graph["inputs"], self._state_names))
            padded = self._padded(x, targets, start, chunk, size)
            for name, value in zip(graph["inputs"][len(self._state_names) :], padded):
                binding.bind_cpu_input(name, value)
            binding.bind_output(graph["outputs"][0], "cpu")
            session.run_with_iobinding(binding)
            rows.append(binding.get_outputs()[0].numpy()[:chunk])
        logits = np.concatenate(rows).astype(np.float32, copy=False)
        return self.manifest.kind.prediction_logits(logits, x)

    def eval_batch(self, x: np.ndarray, y: np.ndarray) -> EvalResult:
        """Summed loss and correct count over a batch of any size (run in chunks of `batch_size`)."""
        count = self._check_batch(x, y)
        graph = self.entry["eval"]
        session = self._session("eval", graph["model"])
        loss_sum, correct, scored = 0.0, 0, 0
        for start in range(0, count, self.batch_size):
            chunk = min(self.batch_size, count - start)
            binding = self._bind_state(session, zip(graph["inputs"], self._state_names))
            padded = self._padded(x, y, start, chunk, scoring=True)
            for name, value in zip(graph["inputs"][len(self._state_names) :], padded):
                binding.bind_cpu_input(name, value)
            for name in graph["outputs"][1:]:  # loss and correct; the logits stay unfetched
                binding.bind_output(name, "cpu")
            session.run_with_iobinding(binding)
            loss, hits = (value.numpy() for value in binding.get_outputs())
            weights = float(padded[2].sum())  # the targets the graph's mean is over: the real samples' scored ones
            loss_sum += float(loss) * weights if weights else 0.0
            correct += int(hits)
            scored += int(weights)
        return EvalResult(loss_sum=loss_sum, correct=correct, count=scored)

    def _bind_state(self, session: ort.InferenceSession, inputs: Iterable[tuple[str, str]]) -> ort.IOBinding:
        """A binding with each (graph input, state tensor) pair's OrtValue bound, as held: no copy."""
        binding = session.io_binding()
        for input_name, tensor_name in inputs:
            binding.bind_ortvalue_input(input_name, self._state[tensor_name])
        return binding

    def _session(self, key: str, relative_path: str) -> ort.InferenceSession:
        if key not in self._sessions:
            path = str(self._path(relative_path))
            self._sessions[key] = ort.InferenceSession(path, self._options(), providers=["CPUExecutionProvider"])
        return self._sessions[key]

    def _path(self, relative_path: str) -> os.PathLike:
        path = self.bundle_dir / relative_path
        if not path.is_file():
            raise BundleError(f"bundle file {relative_path} is missing", "re-export or re-copy the whole bundle")
        return path

    def _options(self) -> ort.SessionOptions:
        options = ort.SessionOptions()
        if self.threads:
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
        return options

    def _check_batch(self, x: np.ndarray, y: np.ndarray) -> int:
        sample_shape = tuple(self.manifest.input.shape)
        if x.ndim != len(sample_shape) + 1 or tuple(x.shape[1:]) != sample_shape:
            raise DataError(
                f"inputs have shape {tuple(x.shape)}, the model expects (batch, {', '.join(map(str, sample_shape))})",
                "reshape the data to the manifest's input shape",
            )
        targets = self.manifest.kind.target_shape
        if y.shape != (x.shape[0], *targets):
            raise DataError(
                f"labels have shape {tuple(y.shape)} for {x.shape[0]} inputs",
                "pass one label per input" if not targets else f"pass {targets[0]} next tokens per input",
            )
        if x.shape[0] == 0:
            raise DataError("the batch is empty", "pass at least one sample")
        return int(x.shape[0])

    def predict_graph(self, count: int) -> str:
        """The graph that predicts `count` inputs: the one-sample predict graph for up to its manifest's `up_to`
        (export/portable.py PREDICT_SHARE; none in a bundle exported before it), else the eval graph's padded
        batches. engine.js predictGraph reads the same entry."""
        return "predict" if count <= self.entry.get("predict", {}).get("up_to", 0) else "eval"

    def _padded(
        self, x: np.ndarray, y: np.ndarray, start: int, count: int, size: int | None = None, scoring: bool = False
    ) -> tuple[np.ndarray, ...]:
        """(x, y, w) of one graph batch of `size` (default: the step graphs'): `count` real samples from `start`,
        zero-padded, each target weighed as the kind weighs it (`scoring`: as the metric counts) and padding 0."""
        size = size or self.batch_size
        real_x = model_input(self.manifest, x[start : start + count])
        real_y = np.ascontiguousarray(y[start : start + count], dtype=self.label_dtype)
        real_w = self.manifest.kind.target_weights(real_y, scoring)
        if count == size:
            return real_x, real_y, real_w
        batch_x = np.zeros((size, *real_x.shape[1:]), dtype=real_x.dtype)  # padding: zeros, <pad> for token ids
        batch_x[:count] = real_x
        batch_y = np.zeros((size, *real_y.shape[1:]), dtype=self.label_dtype)
        batch_y[:count] = real_y
        weights = np.zeros((size, *real_w.shape[1:]), dtype=np.float32)
        weights[:count] = real_w
        return batch_x, batch_y, weights


def _same(held: tuple[ort.OrtValue, ...], current: tuple[ort.OrtValue, ...]) -> bool:
    """Whether the engine still holds the very OrtValues a variant was built on (state is replaced, never
    written in place, so the same objects mean the same values)."""
    return len(held) == len(current) and all(a is b for a, b in zip(held, current))
