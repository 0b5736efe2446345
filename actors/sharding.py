"""Sharding backends for the learner: how a model is spread over the ranks of a torch.distributed group.

The Learner talks to a backend only through `ShardingBackend`, so another backend (DeepSpeed ZeRO)
can join without touching it. What a backend owns:
- `wrap(model)`: place the model on its device and shard it (parameters, gradients, and so the optimizer
  state built on them afterwards);
- `compute()`: the context a forward runs in (mixed precision);
- `clip_grad_norm`: the global gradient norm (over all shards), clipped in place;
- `named_full_tensors`: whole parameters gathered (a collective: every rank iterates), on CPU, for rank 0;
- `reshard(model)`: free what a forward without backward left gathered (FSDP2 keeps the root's
  parameters whole after a forward, for the backward that a no-grad pass never runs);
- `local(param)`: this rank's piece of a parameter, for in-place copies between two identically
  sharded models (reference refresh);
- `save`/`load`: model and optimizer state into a folder (resharding-capable);
- `grad_scale`: what the loss is multiplied by so that gradients come out summed over ranks
  (FSDP averages gradients across ranks; the learner's loss is already normalised globally).

- `prepare(model, optimizer)`: bind the optimizer built on the wrapped model's trainable parameters;
  returns the torch optimizer whose param_groups the lr schedule drives;
- `forward(model, **inputs)`, `backward(loss)`, `step(optimizer, params, max_norm)`: one micro-batch's
  forward and backward (gradients accumulate), and the optimizer step that ends them (clip, step, zero).

Three backends:
- `NoShardBackend` (world size 1): the model on one device. FSDP2 needs a DeviceMesh, hence a
  process group; a one-rank learner runs without any, so it uses this instead (for deepspeed too).
- `Fsdp2Backend` (world size > 1): `torch.distributed.fsdp.fully_shard` on every decoder layer, then on
  the root. Parameters stay in their stored dtype (fp32 for what trains) and are gathered in the compute
  dtype (`MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)`). Frozen parameters (a LoRA
  run's base model) are sharded too; only trainable ones get gradients.
- `DeepspeedBackend` (world size > 1, `learner.backend: deepspeed`): a DeepSpeed ZeRO-2/3 engine
  over the learner's own process group (gloo on CPU, NCCL on CUDA), built in `prepare` around the
  learner's torch AdamW. Micro-batches go through the engine (its forward hooks start each backward);
  gradient accumulation is the caller's (`managed_gradient_accumulation: false`: backward only
  accumulates, `step` reduces, clips to `learner.optim.grad_clip` and steps). Precision as
  `NoShardBackend` (fp32 master weights, autocast to the compute dtype). Checkpoints are DeepSpeed's own
  (`engine.save_checkpoint`): they resume at the same world size and ZeRO stage only.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from configs.schema import DeepspeedConfig


class ShardingBackend(Protocol):
    name: str
    world_size: int
    rank: int
    device: torch.device
    grad_scale: float

    def wrap(self, model: nn.Module) -> nn.Module: ...

    def compute(self) -> contextlib.AbstractContextManager[Any]: ...

    def reshard(self, model: nn.Module) -> None: ...

    def clip_grad_norm(self, params: Iterable[torch.Tensor], max_norm: float) -> float: ...

    def named_full_tensors(
        self, model: nn.Module, keep: Callable[[str], bool], all_ranks: bool = False, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor | None]]: ...

    def local(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer: ...

    def forward(self, model: nn.Module, **inputs: Any) -> Any: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], max_norm: float) -> float: ...

    def save(self, folder: str, model: nn.Module, optimizer: Any | None, keep: Callable[[str], bool]) -> None: ...

    def load(self, folder: str, model: nn.Module, optimizer: Any | None, keep: Callable[[str], bool]) -> None: ...


def cpu_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A detached copy of `tensor` on the CPU, in `dtype` if given. An accelerator's tensor is cast where it
    is, then moved: a blocking copy to the CPU would move it whole and cast there (twice the bytes for
    fp32 master weights sent as bf16)."""
    t = tensor.detach()
    if t.device.type == "cpu":
        return t.to(dtype=dtype or t.dtype, copy=True)
    return t.to(dtype or t.dtype).to("cpu")


def make_backend(
    name: str,
    *,
    world_size: int,
    rank: int,
    device: torch.device,
    dtype: torch.dtype,
    deepspeed: DeepspeedConfig | None = None,
    grad_clip: float = 1.0,
) -> ShardingBackend:
    """The backend for `learner.backend` at this world size (`deepspeed`, `grad_clip`: the deepspeed backend's
    `learner.deepspeed` and `learner.optim.grad_clip`)."""
    if name not in ("fsdp2", "deepspeed"):
        raise ValueError(f"learner.backend: unknown sharding backend {name!r} (known: fsdp2, deepspeed)")
    if world_size == 1:
        return NoShardBackend(device=device, dtype=dtype)
    if name == "deepspeed":
        from configs.schema import DeepspeedConfig

        return DeepspeedBackend(
            world_size=world_size,
            rank=rank,
            device=device,
            dtype=dtype,
            options=deepspeed or DeepspeedConfig(),
            grad_clip=grad_clip,
        )
    return Fsdp2Backend(world_size=world_size, rank=rank, device=device, dtype=dtype)


class _Common:
    """What both backends do the same way (DCP checkpoints work for plain and FSDP2 modules alike)."""

    world_size: int
    rank: int
    device: torch.device
    grad_scale: float

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def forward(self, model: nn.Module, **inputs: Any) -> Any:
        return model(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.grad_scale).backward()

    def clip_grad_norm(self, params: Iterable[torch.Tensor], max_norm: float) -> float:
        raise NotImplementedError

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], max_norm: float) -> float:
        norm = self.clip_grad_norm(params, max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def reshard(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def named_full_tensors(
        self, model: nn.Module, keep: Callable[[str], bool], all_ranks: bool = False, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, whole tensor on CPU, cast to `dtype` if given) on rank 0 (on every rank with `all_ranks`),
        else (name, None), for the parameters `keep` accepts, in model order.

        Every rank must drain the iterator: gathering a sharded parameter is a collective."""
        from torch.distributed.tensor import DTensor

        for name, param in model.named_parameters():
            if not keep(name):
                continue
            full = param.full_tensor() if isinstance(param, DTensor) else param
            yield name, (cpu_copy(full, dtype) if all_ranks or self.rank == 0 else None)

    def save(self, folder: str, model: nn.Module, optimizer: Any | None, keep: Callable[[str], bool]) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # "assuming ... a single process": exactly the intent at world size 1
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(_state(model, optimizer, keep), checkpoint_id=folder)

    def load(self, folder: str, model: nn.Module, optimizer: Any | None, keep: Callable[[str], bool]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        state = _state(model, optimizer, keep)  # templates (right shapes and shards), filled in place
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, checkpoint_id=folder)
        options = StateDictOptions(strict=False)  # LoRA: the frozen base is not in the checkpoint
        if optimizer is None:
            set_model_state_dict(model, state["model"], options=options)
        else:
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
            )


def _state(model: nn.Module, optimizer: Any | None, keep: Callable[[str], bool]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": {k: v for k, v in get_model_state_dict(model).items() if keep(k)}}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": {k: v for k, v in model_sd.items() if keep(k)}, "optim": optim_sd}


class NoShardBackend(_Common):
    """World size 1: the whole model on one device.

    Compute dtype: a policy stored wholly in float32 (full fine-tune's master weights) runs under autocast
    to `dtype`; a LoRA policy (base already in `dtype`, adapter in float32 as PEFT keeps it) runs as is —
    autocast there only adds casts. Decided by the first model wrapped (the policy)."""

    name = "none"
    grad_scale = 1.0

    def __init__(self, *, device: torch.device, dtype: torch.dtype) -> None:
        self.world_size = 1
        self.rank = 0
        self.device = device
        self.dtype = dtype
        self._autocast: bool | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        import torch

        if self._autocast is None:
            dtypes = {p.dtype for p in model.parameters()}
            self._autocast = dtypes == {torch.float32} and self.dtype != torch.float32
        return model.to(self.device)

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def clip_grad_norm(self, params: Iterable[torch.Tensor], max_norm: float) -> float:
        import torch

        return float(torch.nn.utils.clip_grad_norm_(list(params), max_norm))


class Fsdp2Backend(_Common):
    """FSDP2 (`fully_shard`) per decoder layer + root, over a 1-D mesh of all ranks."""

    name = "fsdp2"

    def __init__(self, *, world_size: int, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.world_size = world_size
        self.rank = rank
        self.device = device
        self.dtype = dtype
        # FSDP2 averages gradients over ranks; the loss is normalised by the global token count,
        # so the per-rank losses must be summed: undo the average.
        self.grad_scale = float(world_size)
        self._mesh: Any = None

    def wrap(self, model: nn.Module) -> nn.Module:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        model.to(self.device)
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=self._mesh, mp_policy=mp)
        fully_shard(model, mesh=self._mesh, mp_policy=mp)
        return model

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # FSDP2 casts parameters and inputs itself

    def clip_grad_norm(self, params: Iterable[torch.Tensor], max_norm: float) -> float:
        import torch

        # On DTensor gradients the norm is a DTensor reduced over the mesh: the global norm.
        norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


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
        """As `_Common.named_full_tensors`; a ZeRO-3 parameter is gathered (a collective) one at a time."""
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


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: modules whose class the HF model names in `_no_split_modules`."""
    kinds: set[str] = set()
    for module in model.modules():
        kinds.update(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__} to shard (no `_no_split_modules` class found)"
        )
    return layers
