"""CPU pinning for rollout engines that share a node's cores.

On CPU, engines placed on the same node split its cores: engine k of n gets its own contiguous slice
(`core_slice`); `EngineHost.start` (orchestration/rollout_actors.py) applies it (a vLLM engine's process
affinity, an HF engine's torch threads) and reports it in `cpu_list`'s form.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def node_cores() -> list[int]:
    """The CPU ids this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def core_slice(cores: Sequence[int], rank: int, count: int) -> list[int]:
    """Engine `rank` of `count` on one node gets a contiguous, disjoint slice of `cores`; with more
    engines than cores, engines share cores round-robin (one each)."""
    if count < 1 or not 0 <= rank < count:
        raise ValueError(f"rank {rank} of {count} engines is out of range")
    n = len(cores)
    if count > n:
        return [cores[rank % n]]
    return list(cores[rank * n // count : (rank + 1) * n // count])


def cpu_list(cores: Sequence[int]) -> str:
    """'0-3' for a contiguous run, '0,2,5' otherwise."""
    cores = sorted(cores)
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))
