"""Starting the rollout side and the learner side of a job at once rather than one after the other.

Each side's start is mostly waiting (actor processes booting, imports, model loads), so even on one CPU
machine the two overlap some. In a training run the engines start at once, beside Serve; the learners wait for
Serve (its proxy takes its port first), the runners for the tool pool's applications (jobs/train_driver.py). Each
start cleans up after itself when it fails, so a failed start here waits for the others to finish theirs (and
the caller's close stops what they started) before raising: nothing is left half-started behind the error."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from configs.schema import Config


def start_together(cfg: Config) -> bool:
    """Whether the engines and the learners may start at the same time: not when both sit on GPUs, where an
    engine sizes its KV cache from the memory free as it starts, and a learner loading beside it would take
    some of that memory away later."""
    return not (cfg.rollout.engine_resources.num_gpus and cfg.learner.worker_resources.num_gpus)


async def start_groups(cfg: Config, *starts: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Call and await the starts (rollout side first) at once where `start_together`, else one after the
    other, in order; their results in order."""
    if not start_together(cfg):
        return [await start() for start in starts]
    results = await asyncio.gather(*(start() for start in starts), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)
