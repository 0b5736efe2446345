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

Two backends:
- `NoShardBackend` (world size 1): the model on one device. FSDP2 needs a DeviceMesh, hence a
  process group; a one-rank learner runs without any, so it uses this instead.
- `Fsdp2Backend` (world size > 1): `torch.distributed.fsdp.fully_shard` on every decoder layer, then on
  the root. Parameters stay in their stored dtype (fp32 for what trains) and are gathered in the compute
  dtype (`MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)`). Frozen parameters (a LoRA
  run's base model) are sharded too; only trainable ones get gradients.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn


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
        self, model: nn.Module, keep: Callable[[str], bool], all_ranks: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | None]]: ...

    def local(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def save(self, folder: str, model: nn.Module, optimizer: Any | None, keep: Callable[[str], bool]) -> None: ...

    def load(self, folder: str, model: nn.Module, optimizer: Any | None, keep: Callable[[str], bool]) -> None: ...


def make_backend(name: str, *, world_size: int, rank: int, device: torch.device, dtype: torch.dtype) -> ShardingBackend:
    """The backend for `learner.backend` at this world size."""
    if name != "fsdp2":
        raise ValueError(f"learner.backend: unknown sharding backend {name!r} (known: fsdp2)")
    if world_size == 1:
        return NoShardBackend(device=device, dtype=dtype)
    return Fsdp2Backend(world_size=world_size, rank=rank, device=device, dtype=dtype)


class _Common:
    """What both backends do the same way (DCP checkpoints work for plain and FSDP2 modules alike)."""

    world_size: int
    rank: int
    device: torch.device

    def reshard(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def named_full_tensors(
        self, model: nn.Module, keep: Callable[[str], bool], all_ranks: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, whole tensor on CPU) on rank 0 (on every rank with `all_ranks`), else (name, None), for the
        parameters `keep` accepts, in model order.

        Every rank must drain the iterator: gathering a sharded parameter is a collective."""
        from torch.distributed.tensor import DTensor

        for name, param in model.named_parameters():
            if not keep(name):
                continue
            full = param.full_tensor() if isinstance(param, DTensor) else param
            yield name, (full.detach().to("cpu", copy=True) if all_ranks or self.rank == 0 else None)

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
