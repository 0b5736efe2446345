"""orchestration/startup.py: the rollout and learner sides start at once, except both on GPUs; a failed start
is raised only after the other start has ended (it cleans up after itself)."""

from __future__ import annotations

import asyncio

import pytest

from configs.loader import load_config
from orchestration.startup import start_groups, start_together


def config(engine_gpus: float, learner_gpus: float):
    return load_config(
        None,
        [f"rollout.engine_resources.num_gpus={engine_gpus}", f"learner.worker_resources.num_gpus={learner_gpus}"],
    )


@pytest.mark.parametrize(("engine", "learner", "together"), [(0, 0, True), (1, 0, True), (0, 1, True), (1, 1, False)])
def test_they_start_together_unless_both_sit_on_gpus(engine: float, learner: float, together: bool) -> None:
    assert start_together(config(engine, learner)) is together


async def test_the_starts_overlap_and_return_in_order() -> None:
    rollout_up, learner_up = asyncio.Event(), asyncio.Event()

    async def rollout() -> str:  # each waits for the other: one after the other, this would never end
        rollout_up.set()
        await asyncio.wait_for(learner_up.wait(), 5)
        return "rollout"

    async def learner() -> str:
        learner_up.set()
        await asyncio.wait_for(rollout_up.wait(), 5)
        return "learner"

    assert await start_groups(config(0, 0), rollout, learner) == ["rollout", "learner"]


async def test_on_gpus_the_rollout_side_starts_first_and_a_failure_starts_nothing_after_it() -> None:
    order: list[str] = []

    async def rollout() -> None:
        order.append("rollout")
        raise RuntimeError("no engine")

    async def learner() -> None:
        order.append("learner")

    with pytest.raises(RuntimeError, match="no engine"):
        await start_groups(config(1, 1), rollout, learner)
    assert order == ["rollout"]


async def test_a_failed_start_is_raised_after_the_other_has_finished() -> None:
    finished: list[str] = []

    async def rollout() -> None:
        raise RuntimeError("no engine could be placed")

    async def learner() -> None:
        await asyncio.sleep(0.2)  # still loading when the rollout side fails
        finished.append("learner")

    with pytest.raises(RuntimeError, match="no engine could be placed"):
        await start_groups(config(0, 0), rollout, learner)
    assert finished == ["learner"]  # ended on its own, so the caller's close() finds it whole
