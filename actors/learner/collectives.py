"""The learner's process group: its device, joining and leaving the group, and the all-reduces and barriers
the steps and checkpoints use (a mixin of `Learner`, actors/learner/__init__.py).

Every rank runs the same number of forwards and backwards (the largest micro-batch count of any rank;
the others run empty micro-batches with a zero mask), or the sharded model's gathers hang.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Collectives:
    """The process group of the learner's ranks; uses the attributes `Learner.__init__` sets."""

    def close(self) -> None:
        """Leave the process group (the actor may stay alive)."""
        import torch.distributed as dist

        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def _pick_device(self) -> torch.device:
        import torch

        if not torch.cuda.is_available():
            return torch.device("cpu")
        # Under Ray each worker sees only its assigned GPU (CUDA_VISIBLE_DEVICES): index 0.
        index = self.rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def _init_process_group(self) -> None:
        import datetime

        import torch.distributed as dist

        if self.master_addr.startswith("file://"):
            init_method = self.master_addr  # one node: a file store, nothing listens beyond loopback
        else:
            init_method = f"tcp://{self.master_addr}:{self.master_port}"
        if self.master_addr.startswith("file://") or self.master_addr in ("127.0.0.1", "localhost"):
            # Gloo/NCCL would otherwise pick the interface of the machine's hostname.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        backend = "nccl" if self.device is not None and self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(minutes=10),
        )

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, "sum")

    def _all_reduce_max(self, value: float) -> float:
        return self._all_reduce([value], "max")[0]

    def _all_reduce(self, values: list[float], op: str) -> list[float]:
        if self.world_size == 1:
            return [float(v) for v in values]
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return [float(v) for v in t.cpu()]

    def _barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
