"""Sharding backends for the learner: how a model is spread over the ranks of a torch.distributed group.

A package: the interface and the choice of backend here; the one-device and FSDP2 backends in
`torch_native.py`, DeepSpeed ZeRO in `deepspeed_zero.py`.

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

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from actors.sharding.deepspeed_zero import DEEPSPEED_TAG, DeepspeedBackend, import_deepspeed
from actors.sharding.torch_native import Fsdp2Backend, NoShardBackend, cpu_copy

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


__all__ = [
    "DEEPSPEED_TAG",
    "DeepspeedBackend",
    "Fsdp2Backend",
    "NoShardBackend",
    "ShardingBackend",
    "cpu_copy",
    "import_deepspeed",
    "make_backend",
]
