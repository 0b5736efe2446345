"""The DeepSpeed learner backend on a real local Ray: two ZeRO ranks over gloo (CPU), LoRA and full fine-tune,
checkpoints that resume exactly; and the errors for what it does not do."""

from __future__ import annotations

import sys

import pytest
import torch

from actors.models import load_causal_lm
from cluster.learner_group import LearnerGroup
from configs.schema import Config
from tests.cluster.test_learner_group import fixed_batch, make_cfg, mean_logprob

pytest.importorskip("deepspeed")


def ds_cfg(mode: str, stage: int, lr: float) -> Config:
    cfg = make_cfg(mode, lr)
    cfg.learner.backend = "deepspeed"
    cfg.learner.deepspeed.stage = stage
    return cfg


async def train_save_resume(cfg: Config, tmp_path) -> tuple[list[dict], list[dict]]:
    """Three steps (checkpoint after the first), then a fresh group loads it and runs the last two again.
    Returns the first group's and the second group's (metrics, score) of those two steps."""
    batch = fixed_batch()
    folder = str(tmp_path / "ckpt")
    first, second = [], []
    group = LearnerGroup(cfg)
    try:
        info = await group.start()
        assert info["world_size"] == 2 and info["backend"] == "deepspeed"
        first.append({"score": await group.score(batch)})
        await group.train_step(batch)
        await group.save_checkpoint(folder, {"data_position": 5})
        for _ in range(2):
            first.append({"metrics": await group.train_step(batch), "score": await group.score(batch)})
    finally:
        await group.shutdown()
    group = LearnerGroup(cfg)
    try:
        await group.start()
        assert await group.load_checkpoint(folder) == {"data_position": 5}
        for _ in range(2):
            second.append({"metrics": await group.train_step(batch), "score": await group.score(batch)})
    finally:
        await group.shutdown()
    return first, second


@pytest.mark.parametrize("mode,stage", [("lora", 2), ("full", 3)])
async def test_deepspeed_group_learns_and_resumes_exactly(ray_cluster, tmp_path, mode: str, stage: int) -> None:
    cfg = ds_cfg(mode, stage, lr=3e-3 if mode == "lora" else 1e-3)
    if mode == "lora":
        cfg.algorithm.kl_coef = 0.1
        cfg.learner.reference = "ema"  # the frozen reference adapter is saved and restored too
    first, second = await train_save_resume(cfg, tmp_path)

    before, after = mean_logprob(first[0]["score"]), mean_logprob(first[-1]["score"])
    assert after > before + 0.1  # the chosen tokens became likelier
    metrics = first[1]["metrics"]
    assert metrics["samples"] == 5 and metrics["grad_norm"] > 0
    for got, want in zip(second, first[1:], strict=True):
        assert got["score"] == want["score"]
        for k in ("policy_loss", "grad_norm", "ratio_mean", "lr"):
            assert got["metrics"][k] == want["metrics"][k], k
        if mode == "lora":
            assert got["metrics"]["kl"] == want["metrics"]["kl"]
