"""The learner group on a real local Ray: two FSDP2 ranks over gloo (CPU), LoRA and full fine-tune."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch
from ray.util.placement_group import placement_group_table

from actors.adapter_io import adapter_state_dict
from actors.learner import Learner
from actors.models import load_causal_lm
from configs.schema import Config
from orchestration.learner_group import LearnerGroup

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

CHOSEN = [1500, 2500, 3500, 4500, 5500, 6500]


def make_cfg(mode: str, lr: float) -> Config:
    cfg = Config()
    cfg.finetune.mode = mode
    cfg.finetune.lora.r = 8
    cfg.learner.workers = 2
    cfg.learner.worker_resources.num_cpus = 0.5
    cfg.learner.optim.lr = lr
    cfg.sft_warmup.lr = 3e-3
    return cfg


def fixed_batch(n: int = 5) -> list[dict]:
    """Prompts of different lengths (uneven shards), the same chosen response, positive advantages."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        prompt = torch.randint(100, 40_000, (4 + 3 * i,), generator=g).tolist()
        out.append(
            {
                "prompt_ids": prompt,
                "response_ids": list(CHOSEN),
                "loss_mask": [1] * len(CHOSEN),
                "rollout_logprobs": [-10.8] * len(CHOSEN),
                "advantage": 1.0,
            }
        )
    return out


def mean_logprob(rows: list[list[float]]) -> float:
    vals = [v for row in rows for v in row]
    return sum(vals) / len(vals)


async def test_lora_group_learns_and_exports_the_whole_adapter(ray_cluster) -> None:
    cfg = make_cfg("lora", lr=3e-3)
    # The same seed on one in-process rank: the group's gathered adapter must equal this one's.
    single = Learner(cfg.model_copy(deep=True))
    single.setup()
    reference_adapter = single.export_adapter()
    assert reference_adapter is not None
    del single

    group = LearnerGroup(cfg)
    try:
        info = await group.start()
        assert info["world_size"] == 2 and info["backend"] == "fsdp2"
        adapter = adapter_state_dict(await (await group.export_adapter_ref()))
        reference = adapter_state_dict(reference_adapter)
        assert adapter.keys() == reference.keys()
        for k, v in reference.items():
            assert torch.equal(adapter[k], v), k  # whole, unsharded, in the right order

        batch = fixed_batch()
        sft = [{k: s[k] for k in ("prompt_ids", "response_ids", "loss_mask")} for s in batch]
        losses = [(await group.sft_step(sft))["sft_loss"] for _ in range(3)]  # the warm start comes first
        assert losses[-1] < losses[0] - 0.1

        before = mean_logprob(await group.score(batch))
        metrics = [await group.train_step(batch) for _ in range(3)]
        after = mean_logprob(await group.score(batch))
        assert after > before + 0.1
        assert metrics[0]["samples"] == 5 and metrics[0]["tokens"] == 5 * len(CHOSEN)
        assert metrics[0]["grad_norm"] > 0 and metrics[0]["tokens_per_s"] > 0

        trained = adapter_state_dict(await (await group.export_adapter_ref()))
        assert any(not torch.equal(trained[k], v) for k, v in adapter.items())
    finally:
        await group.shutdown()


async def test_full_group_step_and_weight_export(ray_cluster) -> None:
    cfg = make_cfg("full", lr=1e-3)
    group = LearnerGroup(cfg)
    try:
        await group.start()
        pg = group.placement_group
        for i, actor in enumerate(group.actors):  # named for the dashboard
            assert ray.get_actor(f"mcprl:{cfg.run_name}:learner-{i}")._actor_id == actor._actor_id
        metrics = await group.train_step(fixed_batch(3))  # 3 samples on 2 ranks
        assert metrics["samples"] == 3 and metrics["grad_norm"] > 0
        refs = await group.export_weights_refs(max_chunk_bytes=1 << 20)
        assert len(refs) > 1 and all(isinstance(r, ray.ObjectRef) for r in refs)
        chunks = await asyncio.gather(*refs)
        exported = {n: t for c in chunks for n, t in c.items()}
        model = load_causal_lm(cfg.model)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        assert {n: tuple(t.shape) for n, t in exported.items()} == shapes
        # Training moved the weights away from the stored ones.
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(exported[q], model.state_dict()[q])
    finally:
        await group.shutdown()
    assert placement_group_table(pg)["state"] == "REMOVED"
    assert group.actors == [] and group.placement_group is None
    with pytest.raises(RuntimeError, match="start"):
        await group.train_step(fixed_batch(1))


async def test_group_checkpoint_resumes_exactly_and_reshards(ray_cluster, tmp_path) -> None:
    cfg = make_cfg("lora", lr=3e-3)
    cfg.algorithm.kl_coef = 0.1
    cfg.learner.reference = "ema"  # the reference adapter is saved and restored too
    cfg.learner.reference_every = 1  # and it moves after every step
    batch = fixed_batch()
    group = LearnerGroup(cfg)
    try:
        await group.start()
        await group.train_step(batch)
        await group.save_checkpoint(str(tmp_path / "ckpt"), {"data_position": 5})
        expected_metrics = await group.train_step(batch)
        expected = await group.score(batch)
    finally:
        await group.shutdown()

    group = LearnerGroup(cfg)
    try:
        await group.start()
        assert await group.load_checkpoint(str(tmp_path / "ckpt")) == {"data_position": 5}
        saved_adapter = await (await group.export_adapter_ref())
        metrics = await group.train_step(batch)
        assert await group.score(batch) == expected
        for k in ("policy_loss", "kl", "grad_norm", "ratio_mean"):
            assert metrics[k] == expected_metrics[k], k
    finally:
        await group.shutdown()

    # The sharded checkpoint of two ranks loads into one rank.
    single_cfg = cfg.model_copy(deep=True)
    single_cfg.learner.workers = 1
    single = Learner(single_cfg)
    single.setup()
    assert single.load_checkpoint(str(tmp_path / "ckpt")) == {"data_position": 5}
    adapter = single.export_adapter()
    assert adapter is not None
    loaded = adapter_state_dict(adapter)
    for k, v in adapter_state_dict(saved_adapter).items():
        assert torch.equal(loaded[k], v), k


async def test_ppo_on_two_ranks_matches_one_rank(ray_cluster) -> None:
    """algorithm.name ppo under FSDP2: the value head is sharded with the policy's root, read inside the
    forward; GAE's whitening and explained variance are over all ranks' tokens, and the losses are
    normalised globally, so two ranks (uneven shards) train as one rank does."""
    from grpo.gae import token_rewards

    cfg = make_cfg("lora", lr=3e-3)
    cfg.algorithm.name = "ppo"
    cfg.learner.dtype = cfg.model.dtype = "float32"  # bf16 rounding differs between the two layouts
    rewards = [0.0, 1.0, 0.5, -0.5, 2.0]  # one turn per sample
    batch = [
        {**s, "token_rewards": token_rewards(s["loss_mask"], [r])} for s, r in zip(fixed_batch(), rewards, strict=True)
    ]
    single_cfg = cfg.model_copy(deep=True)
    single_cfg.learner.workers = 1
    single = Learner(single_cfg)
    single.setup()
    expected = [single.train_step(batch) for _ in range(2)]
    del single

    group = LearnerGroup(cfg)
    try:
        await group.start()
        got = [await group.train_step(batch) for _ in range(2)]
    finally:
        await group.shutdown()
    assert expected[1]["value_mean"] != 0  # the head moved in the first step
    for g, e in zip(got, expected, strict=True):
        for k in ("policy_loss", "value_loss", "value_mean", "returns_mean", "explained_variance", "grad_norm"):
            assert g[k] == pytest.approx(e[k], rel=1e-3, abs=1e-5), k
