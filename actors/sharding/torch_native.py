"""The torch-native sharding backends (see actors/sharding/__init__.py): the whole model on one device
(`NoShardBackend`) and FSDP2 (`Fsdp2Backend`), with the DCP checkpoints and gathers they share."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


def cpu_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A detached copy of `tensor` on the CPU, in `dtype` if given. An accelerator's tensor is cast where it
    is, then moved: a blocking copy to the CPU would move it whole and cast there (twice the bytes for
    fp32 master weights sent as bf16)."""
    t = tensor.detach()
    if t.device.type == "cpu":
        return t.to(dtype=dtype or t.dtype, copy=True)
    return t.to(dtype or t.dtype).to("cpu")


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
