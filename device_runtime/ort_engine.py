"""The ort-training engine: ONNX Runtime on-device training artifacts (onnxruntime-training 1.19.2)."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterable, Mapping

import numpy as np

from edgepfl.device_runtime.engine import DistillStep, Engine, EvalResult, check_distill_set, model_input
from edgepfl.errors import BundleError
from edgepfl.manifest import Manifest
from edgepfl.ortbuild import onnxruntime_without_torch


def import_training_api() -> types.ModuleType:
    """`onnxruntime.training.api` without its package __init__, which imports torch (ORT 1.19)."""
    onnxruntime_without_torch()
    import onnxruntime

    if "onnxruntime.training" not in sys.modules:  # onnxruntime was imported before, without its training package
        package = types.ModuleType("onnxruntime.training")
        package.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
        sys.modules["onnxruntime.training"] = package
    from onnxruntime.training import api

    return api


class OrtTrainingEngine(Engine):
    """One CheckpointState/Module/Optimizer per trainable set; tensors follow the active set by name."""

    name = "ort-training"

    def __init__(self, bundle_dir: str | os.PathLike, manifest: Manifest, threads: int | None = None):
        super().__init__(bundle_dir, manifest)
        api = import_training_api()
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)
        entry = manifest.engines["ort-training"]
        self._api = api
        self._entry = entry
        self._threads = threads
        self._sets: dict[str, tuple] = {}
        self._stats = entry.get("bn_stats", [])
        self._momentum = float(entry.get("bn_momentum", 0.1))
        self._lr: dict[str, float] = {}
        if not entry.get("sets"):
            raise BundleError("the bundle's ort-training entry lists no training sets", "re-export the bundle")
        self._active = "full" if "full" in entry["sets"] else next(iter(entry["sets"]))
        self._load_set(self._active)
        self._tensor_names = set(self.manifest.trainable("full"))
        self._tensor_names |= set(self.manifest.names("buffer"))

    def get_tensors(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of named params/buffers from the active checkpoint state."""
        state = self._sets[self._active][0]
        wanted = list(self._tensor_names) if names is None else list(names)
        return {name: np.array(state.parameters[name].data, copy=True) for name in wanted}

    def set_tensors(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Overwrite named params/buffers in the active checkpoint state."""
        state = self._sets[self._active][0]
        for name, value in tensors.items():
            if name not in self._tensor_names:
                raise BundleError(f"tensor {name!r} is not in this bundle", "use names from manifest.json")
            spec = self.manifest.tensor(name)
            state.parameters[name] = np.ascontiguousarray(value, dtype=spec.dtype).reshape(spec.shape)

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float, trainable: str = "full") -> float:
        """One optimizer step of the chosen set; BatchNorm statistics are written back after it."""
        self.check_set(trainable)
        return self._run_step(trainable, lr, x, *self._targets(y, self.manifest.kind.target_weights(y)))

    def distill_step(self, step: DistillStep) -> float:
        """One optimizer step on PersFL's distillation loss (variant kd or gd); returns the batch's loss before it."""
        self.check_set(step.trainable)
        sets = {v: entry["sets"] for v, entry in self._entry.get("distill", {}).items()}
        fix = "re-export with --distill or use --engine portable"
        check_distill_set(self.name, sets, step.variant, step.trainable, fix)
        step.checked(self.manifest)
        return self._run_step(
            f"distill_{step.variant}_{step.trainable}",
            step.lr,
            step.x,
            np.ascontiguousarray(step.y, dtype=np.int64),
            np.ascontiguousarray(step.teacher_logits, dtype=np.float32),
            np.array(step.temperature, dtype=np.float32),
            np.array(step.lam, dtype=np.float32),
        )

    def statistics_step(self, x: np.ndarray, y: np.ndarray) -> None:
        """A training-mode forward (and the graph's backward) without the optimizer step, so AdamW's moments stay."""
        self._run_step(self.statistics_set(), None, x, *self._targets(y, self.manifest.kind.target_weights(y)))

    def _run_step(self, key: str, lr: float | None, x: np.ndarray, *inputs: np.ndarray) -> float:
        """One optimizer step of training set `key` on (x, *inputs) (lr None: no step); BatchNorm statistics are
        written back after it."""
        self._activate(key)
        state, module, optimizer, slots = self._sets[key]
        if lr is not None and self._lr.get(key) != lr:
            optimizer.set_learning_rate(float(lr))
            self._lr[key] = lr
        module.train()
        outputs = module(model_input(self.manifest, x), *inputs)
        if lr is not None:
            optimizer.step()
        module.lazy_reset_grad()
        self._write_back_stats(state, slots, outputs, batch=len(x))
        return float(outputs[0])

    def logits(self, x: np.ndarray) -> np.ndarray:
        """The current model's inference-mode logits, (n, classes) float32."""
        active = self._active if not self._active.startswith("distill_") else self._main_set()
        self._activate(active)
        module = self._sets[active][1]
        module.eval()
        inputs = model_input(self.manifest, x)
        y = np.zeros((len(x), *self.manifest.kind.target_shape), dtype=np.int64)
        logits = np.asarray(module(inputs, *self._targets(y, np.ones(y.shape, np.float32)))[1], dtype=np.float32)
        return self.manifest.kind.prediction_logits(logits, x)

    def eval_batch(self, x: np.ndarray, y: np.ndarray) -> EvalResult:
        """Loss and correct count through the eval graph (BatchNorm in inference mode)."""
        if self._active.startswith("distill_"):  # a distillation set's eval graph wants teacher inputs
            self._activate(self._main_set())
        module = self._sets[self._active][1]
        module.eval()
        weights = self.manifest.kind.target_weights(y, scoring=True)
        outputs = module(model_input(self.manifest, x), *self._targets(y, weights))
        hits = (np.asarray(outputs[1]).argmax(axis=-1) == y) * weights
        scored = float(weights.sum())
        loss_sum = float(outputs[0]) * scored if scored else 0.0
        return EvalResult(loss_sum=loss_sum, correct=int(hits.sum()), count=int(scored))

    def _targets(self, y: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, ...]:
        """The graphs' inputs after x: the labels, and for a model taught every position its targets' weights (its
        graph computes sum(w·ce)/sum(w), export/ort_training.py)."""
        labels = np.ascontiguousarray(y, dtype=np.int64)
        return (labels, np.ascontiguousarray(weights, dtype=np.float32)) if y.ndim > 1 else (labels,)

    def _main_set(self) -> str:
        return "full" if "full" in self._entry["sets"] else next(iter(self._entry["sets"]))

    def _load_set(self, set_name: str) -> None:
        stats = self._stats
        if set_name.startswith("distill_"):  # distill_<variant>_<set>
            _, variant, trainable = set_name.split("_", 2)
            paths = self._entry["distill"][variant]["sets"][trainable]
            stats = self._entry["distill"][variant]["bn_stats"]
        else:
            paths = self._entry["sets"][set_name]
        api = self._api
        folder = self.bundle_dir
        state = api.CheckpointState.load_checkpoint(str(folder / paths["checkpoint"]))
        options = None
        if self._threads:
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = self._threads
            options.inter_op_num_threads = 1
        module = api.Module(
            str(folder / paths["training_model"]), state, str(folder / paths["eval_model"]), session_options=options
        )
        optimizer = api.Optimizer(str(folder / paths["optimizer_model"]), module)
        names = module.output_names()
        slots = [(names.index(stat["output"]), stat) for stat in stats]
        self._sets[set_name] = (state, module, optimizer, slots)

    def _activate(self, set_name: str) -> None:
        """Two sets cannot share a CheckpointState: copy every tensor by name when switching."""
        if set_name == self._active:
            return
        current = self.get_tensors()
        if set_name not in self._sets:
            self._load_set(set_name)
        self._active = set_name
        self.set_tensors(current)

    def _write_back_stats(self, state, slots: list, outputs: list, batch: int) -> None:
        """ORT computes the new running statistics but drops them (onnxruntime#19370); store them.

        ORT updates running_var with the population variance, PyTorch with the unbiased one:
        convert with n = batch * H * W so both engines and the simulator agree.
        """
        keep = 1.0 - self._momentum
        for index, stat in slots:
            value = outputs[index]
            if stat["kind"] == "var":
                n = batch * stat["reduce"]
                old = state.parameters[stat["buffer"]].data
                batch_var = (value - keep * old) / self._momentum
                value = keep * old + self._momentum * batch_var * (n / max(n - 1, 1))
            state.parameters[stat["buffer"]] = np.ascontiguousarray(value, dtype=np.float32)
