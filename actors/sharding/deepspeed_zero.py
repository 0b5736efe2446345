"""The DeepSpeed ZeRO-2/3 sharding backend (see actors/sharding/__init__.py): an engine over the learner's
own process group, built around its torch AdamW; checkpoints in DeepSpeed's own format."""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from actors.sharding.torch_native import NoShardBackend, cpu_copy

if TYPE_CHECKING:
    import torch
    from torch import nn

    from configs.schema import DeepspeedConfig


class DeepspeedBackend(NoShardBackend):
    """DeepSpeed ZeRO-2/3 over the learner's process group (see the module docstring).

    `wrap` places the model (the first one wrapped is the policy; a second one, a full fine-tune's frozen KL
    reference, stays whole on every rank with ZeRO-2 and is partitioned with ZeRO-3); `prepare` builds the
    engine, which partitions the optimizer state and gradients (and with ZeRO-3 the parameters, frozen
    ones included)."""

    name = "deepspeed"

    def __init__(
        self,
        *,
        world_size: int,
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
        options: DeepspeedConfig,
        grad_clip: float,
    ) -> None:
        super().__init__(device=device, dtype=dtype)
        self.world_size = world_size
        self.rank = rank
        # ZeRO averages gradients over ranks; the loss is normalised by the global token count: undo it.
        self.grad_scale = float(world_size)
        self.options = options
        self.grad_clip = grad_clip
        self.engine: Any = None
        self._policy: nn.Module | None = None
        self._optimizer: Any = None  # the torch optimizer inside the engine
        # The moments of other optimizers stepped through the engine (the warm start's), while they live.
        self._stashed: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._ds = import_deepspeed()
        # DeepSpeed reads the device index from LOCAL_RANK, which its launcher sets and Ray does not.
        os.environ["LOCAL_RANK"] = str(device.index or 0)
        if device.type == "cpu":
            # On CPU its comm layer JIT-compiles a shared-memory all-reduce when it starts (~30 s on 2 cores,
            # and it needs g++ with OpenMP); only its inference all-reduce uses it, and training never does.
            # Marked unavailable, DeepSpeed keeps to torch.distributed (gloo).
            self._ds.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    def config(self) -> dict[str, Any]:
        """The DeepSpeed config: the learner's own keys, then `learner.deepspeed.config` merged in."""
        extra = dict(self.options.config)
        # ZeRO-3 keeps no parameter whole between forwards (persistence threshold 0): each partition is then
        # the only copy, which the reference refresh blends in place (`local`). A run whose KL reference does
        # not move may raise it for fewer small gathers.
        persist = {"stage3_param_persistence_threshold": 0} if self.options.stage == 3 else {}
        zero = {**persist, **extra.pop("zero_optimization", {}), "stage": self.options.stage}
        return {
            # Batch sizes only feed DeepSpeed's throughput logging: the learner splits batches itself.
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            # Micro-batch counts vary per step: backward only accumulates, step() reduces and steps.
            "managed_gradient_accumulation": False,
            "gradient_clipping": self.grad_clip,
            # The learner's torch AdamW: no compiled DeepSpeed op (FusedAdam, CPUAdam) is needed.
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            **extra,
            "zero_optimization": zero,
        }

    def wrap(self, model: nn.Module) -> nn.Module:
        model = super().wrap(model)
        if self._policy is None:
            self._policy = model
        elif self.options.stage == 3:
            # A frozen model (a full fine-tune's KL reference) partitioned like the policy: an engine without
            # an optimizer. Each rank's partitions then pair up with the policy's (`local`, reference refresh).
            config = {k: v for k, v in self.config().items() if k != "gradient_clipping"}
            self._ds.initialize(model=model, config=config, dist_init_required=False)
        return model

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if model is not self._policy:
            raise ValueError("DeepspeedBackend.prepare: the model is not the policy that was wrapped first")
        if self.engine is not None:
            raise RuntimeError("DeepspeedBackend.prepare: the engine has its optimizer already (one per run)")
        self.engine, _, _, _ = self._ds.initialize(
            model=model, optimizer=optimizer, config=self.config(), dist_init_required=False
        )
        self._optimizer = optimizer
        # ZeRO replaced the optimizer's parameters by flat partitions but kept its param_groups: an lr
        # schedule on it still drives the step.
        return optimizer

    def _engine_for(self, model: nn.Module) -> Any:
        return self.engine if self.engine is not None and model is self._policy else None

    def forward(self, model: nn.Module, **inputs: Any) -> Any:
        engine = self._engine_for(model)
        return engine(**inputs) if engine is not None else model(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        if self.engine is None:
            raise RuntimeError("DeepspeedBackend.backward: prepare() the optimizer first")
        self.engine.backward(loss * self.grad_scale)

    def clip_grad_norm(self, params: Iterable[torch.Tensor], max_norm: float) -> float:
        raise NotImplementedError("DeepspeedBackend: the engine clips in step() (gradients live in its partitions)")

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], max_norm: float) -> float:
        if max_norm != self.grad_clip:
            raise ValueError(f"DeepspeedBackend.step: max_norm {max_norm} differs from the engine's {self.grad_clip}")
        with self._stepping_as(optimizer):
            self.engine.step()  # reduce-scatter, global norm, clip, optimizer step, zero the gradients
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    @contextlib.contextmanager
    def _stepping_as(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """While open, the engine's torch optimizer steps as `optimizer`: its hyperparameters, its own moments.

        An engine has one optimizer, but the learner's supervised warm start trains with a second AdamW (its
        own lr, fresh moments) over the same parameters. For its steps the engine's optimizer (whose
        parameters are ZeRO's flat partitions) takes its settings and its moments (kept here between steps),
        then gets its own back. `optimizer` itself never steps: its parameters are not the partitions."""
        inner = self._optimizer
        if optimizer is inner:
            yield
            return
        if len(optimizer.param_groups) != 1:
            raise ValueError("learner.backend deepspeed: a second optimizer must have one parameter group")
        own_state, own_settings = inner.state, [_settings(g) for g in inner.param_groups]
        inner.state = self._stashed.pop(optimizer, collections.defaultdict(dict))
        for group in inner.param_groups:
            group.update(_settings(optimizer.param_groups[0]))
        try:
            yield
        finally:
            self._stashed[optimizer] = inner.state
            inner.state = own_state
            for group, settings in zip(inner.param_groups, own_settings, strict=True):
                group.update(settings)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """ZeRO-3: this rank's partition, the parameter's only up-to-date copy (writable: the next forward
        gathers from it). A whole copy still gathered from an earlier forward is freed first, or a write to
        the partition would not reach the forward."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if not hasattr(tensor, "ds_id"):
            return tensor
        if tensor.ds_persist:
            raise ValueError(
                "learner.deepspeed.config: a moving KL reference (learner.reference ema/periodic, or a warm start) "
                "needs zero_optimization.stage3_param_persistence_threshold 0 (else ZeRO-3 keeps small "
                "parameters whole, apart from their partitions)"
            )
        if tensor.ds_status == ZeroParamStatus.AVAILABLE:
            tensor.partition()  # frees the whole copy; the partition is kept
        return tensor.ds_tensor

    def named_full_tensors(
        self, model: nn.Module, keep: Callable[[str], bool], all_ranks: bool = False, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """As `torch_native._Common.named_full_tensors`; a ZeRO-3 parameter is gathered (a collective) one at a time."""
        for name, param in model.named_parameters():
            if not keep(name):
                continue
            with self._ds.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
                full = cpu_copy(param, dtype) if all_ranks or self.rank == 0 else None
            yield name, full

    def save(self, folder: str, model: nn.Module, optimizer: Any | None, keep: Callable[[str], bool]) -> None:
        """The engine's checkpoint (trained parameters, ZeRO optimizer partitions) and, in `frozen.pt`, the
        frozen parameters `keep` asks for (a LoRA run's KL reference adapter); another (frozen) model: its
        parameters, gathered into `frozen.pt`."""

        if self._engine_for(model) is None:  # a frozen model: its parameters, gathered
            return self._save_gathered(os.path.join(folder, _FROZEN), model, keep)
        self.engine.save_checkpoint(
            folder, tag=DEEPSPEED_TAG, client_state={}, save_latest=False, exclude_frozen_parameters=True
        )
        self._save_gathered(os.path.join(folder, _FROZEN), model, lambda n: keep(n) and not _trains(model, n))

    def load(self, folder: str, model: nn.Module, optimizer: Any | None, keep: Callable[[str], bool]) -> None:

        if self._engine_for(model) is None:
            return self._load_gathered(os.path.join(folder, _FROZEN), model)
        if not os.path.isdir(os.path.join(folder, DEEPSPEED_TAG)):
            raise FileNotFoundError(
                f"{folder} holds no DeepSpeed checkpoint (no {DEEPSPEED_TAG}/): saved by another backend?"
            )
        saved_by = len(glob.glob(os.path.join(folder, DEEPSPEED_TAG, "*_optim_states.pt")))
        if optimizer is not None and saved_by != self.world_size:
            raise ValueError(
                f"a DeepSpeed checkpoint of {saved_by} rank(s) resumes only at learner.workers {saved_by} "
                f"(this group has {self.world_size})"
            )
        path, _ = self.engine.load_checkpoint(
            folder,
            tag=DEEPSPEED_TAG,
            load_module_strict=False,  # frozen parameters are not in it
            load_optimizer_states=optimizer is not None,
            load_lr_scheduler_states=False,
        )
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint to load in {folder}")
        self._load_gathered(os.path.join(folder, _FROZEN), model)

    def _save_gathered(self, path: str, model: nn.Module, keep: Callable[[str], bool]) -> None:
        """The parameters `keep` accepts, whole, in one file that rank 0 writes (a collective)."""
        import torch

        tensors = dict(self.named_full_tensors(model, keep))
        if self.rank == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(tensors, path)
        torch.distributed.barrier()  # the file is complete before any rank goes on

    def _load_gathered(self, path: str, model: nn.Module) -> None:
        """`_save_gathered`'s file back into `model` (a collective for ZeRO-3 parameters)."""
        import torch

        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in torch.load(path, weights_only=True).items():
                param = params[name]
                # ZeRO-3: gathered, written on rank 0, partitioned again from rank 0's copy.
                with self._ds.zero.GatheredParameters([param], modifier_rank=0, enabled=hasattr(param, "ds_id")):
                    if self.rank == 0 or not hasattr(param, "ds_id"):
                        param.copy_(value)


DEEPSPEED_TAG = "zero"  # the engine's checkpoint subfolder (jobs/export.py reads it too)
_FROZEN = "frozen.pt"  # frozen parameters that a checkpoint keeps (not in the engine's)


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """An optimizer parameter group's hyperparameters (lr, betas, ...), without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def _trains(model: nn.Module, name: str) -> bool:
    return model.get_parameter(name).requires_grad


def import_deepspeed() -> Any:
    """The deepspeed module, or an ImportError that says how to install it."""
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(
            f"learner.backend deepspeed needs the deepspeed package ({e}): pip install -e '.[deepspeed]'"
        ) from e
    return deepspeed
