"""The HF engine's continuous batching (actors/hf_engine.py), on tiny-random in float32: a request that arrives
while a batch runs joins it between two decode steps and leaves as soon as it is done, and neither it nor the
rows already running generate anything other than they would alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from actors.hf_engine import HFEngine
from configs.schema import Config, SamplingConfig

LONG = SamplingConfig(temperature=0, max_new_tokens=160, stop=[])
SHORT = SamplingConfig(temperature=0, max_new_tokens=6, stop=[])
SEEDED = SamplingConfig(temperature=1.0, max_new_tokens=6, stop=[], seed=11)


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[HFEngine]:
    cfg = Config.model_validate(
        {"model": {"name": "tiny-random", "dtype": "float32"}, "rollout": {"backend": "hf", "max_model_len": 512}}
    )
    eng = HFEngine(cfg)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()


async def test_a_request_joins_a_running_batch_and_generates_as_alone(engine: HFEngine) -> None:
    long_prompt, short_prompt, seeded_prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41], [300, 301, 302, 303]
    long_alone = await engine.generate(long_prompt, LONG)
    short_alone = await engine.generate(short_prompt, SHORT)
    seeded_alone = await engine.generate(seeded_prompt, SEEDED)
    assert long_alone.finish_reason == "length"  # tiny-random's greedy path here meets no EOS

    batches = engine.stats()["batches"]
    running = asyncio.create_task(engine.generate(long_prompt, LONG))
    while engine.stats()["batches"] == batches:  # the long request's batch has started decoding
        await asyncio.sleep(0.001)
    short, seeded = await asyncio.gather(engine.generate(short_prompt, SHORT), engine.generate(seeded_prompt, SEEDED))
    assert not running.done()  # they left while the long request still ran
    long = await running

    assert engine.stats()["joined"] == 2
    assert short.timings["batch"] == seeded.timings["batch"] == long.timings["batch"] == 3
    for got, alone in ((long, long_alone), (short, short_alone), (seeded, seeded_alone)):
        assert got.token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=0)


async def test_no_request_joins_while_weights_wait(engine: HFEngine) -> None:
    """update_weights waits for the running batch; meanwhile new requests queue (then run on the new weights)
    instead of joining and keeping the batch alive."""
    joined = engine.stats()["joined"]
    batches = engine.stats()["batches"]
    running = asyncio.create_task(engine.generate([5, 6, 7], LONG))
    while engine.stats()["batches"] == batches:
        await asyncio.sleep(0.001)
    update = asyncio.create_task(engine.update_weights(7, []))
    await asyncio.sleep(0)  # update_weights is now waiting for the batch
    late = await engine.generate([40, 41], SHORT)
    await update
    assert running.done() and late.version == 7
    assert engine.stats()["joined"] == joined
