"""The simulator's eager-PyTorch engine: the bundle's model, trained with the same semantics as the ONNX engines.

Semantics shared with `ort-training` and `portable` (so one seed gives the same numbers within float
tolerance): plain SGD on the mean cross-entropy of the batch (a next-word model's: over every position whose target
the kind's `target_weights` counts, <pad> left out); only the tensors of the trainable set
(`full`, `personal`, `base`) move; every BatchNorm layer, frozen or not, runs in training mode during
a step (batch statistics) and updates its running statistics with momentum 0.1 and the unbiased
variance; evaluation uses the running statistics. PersFL's `distill_step` uses the exported graphs'
own loss (`export.portable.distillation_loss`), so it matches both ONNX engines.

`device` (`edgepfl simulate --device cuda`) moves the model to a GPU: batches go there step by step and
tensors come back as numpy arrays, so the rest of the simulator does not change. cuDNN's kernels are not
bit-reproducible from run to run, so a GPU run matches a CPU run within float tolerance, not bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import numpy as np

from edgepfl.device_runtime.engine import DistillStep, Engine, EvalResult
from edgepfl.errors import BundleError, UsageError
from edgepfl.manifest import TRAINABLE_SETS, Manifest


class TorchEngine(Engine):
    """The bundle's model rebuilt from its manifest (zoo spec or MODEL string), holding its initial tensors."""

    name = "torch"

    def __init__(
        self,
        bundle_dir: str | os.PathLike,
        manifest: Manifest,
        initial: Mapping[str, np.ndarray],
        threads: int | None = None,
        device: str = "cpu",
    ):
        super().__init__(bundle_dir, manifest)
        import torch

        from edgepfl.export.personal import rebuild_personal
        from edgepfl.export.source import rebuild_module

        self._torch = torch
        if threads:
            torch.set_num_threads(threads)
        self.device = torch_device(device)
        if self.device.type == "cuda":  # fixed batch shapes: let cuDNN time its kernels once per shape
            torch.backends.cudnn.benchmark = True
        self.model = rebuild_personal(rebuild_module(manifest.model), manifest.tensors).to(self.device)
        self._params = dict(self.model.named_parameters())
        self._buffers = {n: b for n, b in self.model.named_buffers() if not n.endswith("num_batches_tracked")}
        known = set(self._params) | set(self._buffers)
        listed = {spec.name for spec in manifest.tensors}
        if known != listed:
            raise BundleError(
                f"the bundle's manifest does not describe the {manifest.model.get('name')} model of this edgepfl "
                f"({len(known ^ listed)} tensor name(s) differ)",
                "re-export the bundle with this edgepfl version",
            )
        for module in self.model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.momentum is None:
                raise BundleError("a BatchNorm layer uses a cumulative average", "use momentum 0.1")
        self._sets = {name: set(manifest.trainable(name)) for name in TRAINABLE_SETS}
        self.set_tensors(initial)

    def get_tensors(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of named params/buffers (all when `names` is None)."""
        wanted = [*self._params, *self._buffers] if names is None else list(names)
        return {name: self._tensor(name).detach().cpu().numpy().copy() for name in wanted}

    def set_tensors(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Overwrite named params/buffers in place."""
        with self._torch.no_grad():
            for name, value in tensors.items():
                target = self._tensor(name)
                writable = np.require(value, requirements="CW")  # Ray's object store hands out read-only arrays
                target.copy_(self._torch.from_numpy(writable.reshape(target.shape)))

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float, trainable: str = "full") -> float:
        """One SGD step on the set's tensors; BatchNorm statistics update in every block."""
        labels = self._input(y, np.int64)
        if not self.manifest.kind.target_shape:
            return self._sgd_step(
                x, lr, trainable, lambda logits: self._torch.nn.functional.cross_entropy(logits, labels)
            )
        weights = self._input(self.manifest.kind.target_weights(y), np.float32)
        return self._sgd_step(x, lr, trainable, lambda logits: self._sum_loss(logits, labels, weights) / weights.sum())

    def distill_step(self, step: DistillStep) -> float:
        """One SGD step on PersFL's distillation loss (variant kd or gd); returns the batch's loss before it."""
        from edgepfl.export.portable import distillation_loss

        torch = self._torch
        step.checked(self.manifest)
        labels, teacher = self._input(step.y, np.int64), self._input(step.teacher_logits, np.float32)
        weights = torch.ones(len(step.y), dtype=torch.float32, device=self.device)
        temperature = torch.tensor(float(step.temperature), device=self.device)
        lam = torch.tensor(float(step.lam), device=self.device)

        def loss_of(logits):
            return distillation_loss(logits, teacher, labels, weights, temperature, lam, step.variant)

        return self._sgd_step(step.x, step.lr, step.trainable, loss_of)

    def statistics_momenta(self) -> dict[str, float]:
        """Each BatchNorm running statistic's momentum, read off the model's layers."""
        batchnorm = self._torch.nn.modules.batchnorm._BatchNorm
        return {
            f"{name}.{stat}": float(module.momentum)
            for name, module in self.model.named_modules()
            if isinstance(module, batchnorm) and module.track_running_stats
            for stat in ("running_mean", "running_var")
        }

    def statistics_step(self, x: np.ndarray, y: np.ndarray) -> None:
        """A training-mode forward without gradients: the running statistics move, no weight does."""
        self.model.train()
        with self._torch.no_grad():
            self.model(self._input(x, self.manifest.input.dtype))

    def logits(self, x: np.ndarray) -> np.ndarray:
        """The current model's inference-mode logits, (n, classes) float32 (a next-word model's at the last real
        position)."""
        torch = self._torch
        self.model.eval()
        with torch.no_grad():
            logits = self.model(self._input(x, self.manifest.input.dtype)).cpu().numpy().copy()
        return self.manifest.kind.prediction_logits(logits, x)

    def eval_batch(self, x: np.ndarray, y: np.ndarray) -> EvalResult:
        """Summed loss and correct count over the targets the metric counts, in inference mode (running BatchNorm
        statistics)."""
        torch = self._torch
        self.model.eval()
        with torch.no_grad():
            logits = self.model(self._input(x, self.manifest.input.dtype))
            labels = self._input(y, np.int64)
            weights = self._input(self.manifest.kind.target_weights(y, scoring=True), np.float32)
            loss_sum = self._sum_loss(logits, labels, weights)
            hits = (logits.argmax(dim=-1) == labels).to(weights.dtype) * weights
        return EvalResult(loss_sum=float(loss_sum), correct=int(hits.sum()), count=int(weights.sum()))

    def _sum_loss(self, logits, labels, weights):
        """sum(w · cross-entropy) over every target (a sequence's positions flattened)."""
        per_target = self._torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        )
        return (per_target * weights.reshape(-1)).sum()

    def _sgd_step(self, x: np.ndarray, lr: float, trainable: str, loss_of) -> float:
        """Forward in training mode, `loss_of(logits)`, backward, plain SGD on the set's tensors."""
        torch = self._torch
        self.check_set(trainable)
        chosen = self._sets[trainable]
        self.model.train()
        for name, param in self._params.items():
            param.requires_grad_(name in chosen)
            param.grad = None
        loss = loss_of(self.model(self._input(x, self.manifest.input.dtype)))
        loss.backward()
        with torch.no_grad():
            for name in chosen:
                param = self._params[name]
                if param.grad is not None:
                    param.sub_(lr * param.grad)
                    param.grad = None
        return float(loss.detach())

    def _input(self, array: np.ndarray, dtype: type | str) -> object:
        """A batch (inputs, labels, teacher logits) as a tensor on the engine's device."""
        return self._torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(self.device)

    def _tensor(self, name: str):
        if name in self._params:
            return self._params[name]
        if name in self._buffers:
            return self._buffers[name]
        raise BundleError(f"tensor {name!r} is not in this bundle", "use names from manifest.json")


def torch_device(name: str):
    """`cpu`, `cuda` or `cuda:N` (SimulateConfig's pattern checks the form) as a torch device this process can
    use; one line when the GPU is not there."""
    import torch

    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(
                f"--device {name}: this torch sees no CUDA GPU (torch {torch.__version__})",
                "drop --device (cpu), or run on a machine with a GPU and a CUDA build of torch",
            )
        if device.index is not None and device.index >= count:
            raise UsageError(f"--device {name}: this machine has {count} CUDA GPU(s)", f"use cuda:0..cuda:{count - 1}")
    return device
