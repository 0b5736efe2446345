"""The DeepSpeed learner backend on a real local Ray: two ZeRO ranks over gloo (CPU), LoRA and full fine-tune,
checkpoints that resume exactly (what needs no process group: tests/actors/test_sharding.py)."""

from __future__ import annotations

import pytest
import ray
import torch

from configs.schema import Config
from orchestration.learner_group import LearnerGroup
from tests.actors.test_sharding import requires_deepspeed
from tests.orchestration.test_learner_group import fixed_batch, make_cfg, mean_logprob

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it


def ds_cfg(mode: str, stage: int, lr: float) -> Config:
    cfg = make_cfg(mode, lr)
    cfg.learner.backend = "deepspeed"
    cfg.learner.deepspeed.stage = stage
    return cfg


async def train_save_resume(cfg: Config, tmp_path, sft: bool) -> tuple[dict, list[dict]]:
    """(Warm start,) a step, a checkpoint, a step; then the checkpoint is loaded (over everything the second
    step changed: parameters, ZeRO optimizer partitions, reference, schedule, RNG) and that step runs again.
    Then the reference is reset to the policy, and one more step runs.
    Returns scores and metrics: before, [the second step's, its rerun's, the step after the reset's]."""
    batch = fixed_batch()
    folder = str(tmp_path / "ckpt")
    runs = []
    group = LearnerGroup(cfg)
    try:
        info = await group.start()
        assert info["world_size"] == 2 and info["backend"] == "deepspeed"
        before = {"score": await group.score(batch)}
        if sft:
            rows = [{k: s[k] for k in ("prompt_ids", "response_ids", "loss_mask")} for s in batch]
            before["sft_losses"] = [(await group.sft_step(rows))["sft_loss"] for _ in range(2)]
        before["metrics"] = await group.train_step(batch)
        await group.save_checkpoint(folder, {"data_position": 5})
        if cfg.finetune.mode == "full":  # what the engines got at the checkpoint: the export must read the same
            before["pushed"] = {k: v for ref in await group.export_weights_refs() for k, v in ray.get(ref).items()}
        for load in (False, True):
            if load:
                assert await group.load_checkpoint(folder) == {"data_position": 5}
            runs.append({"metrics": await group.train_step(batch), "score": await group.score(batch)})
        await group.reset_reference()  # the reference becomes the policy (every partition of it)
        runs.append({"metrics": await group.train_step(batch)})
    finally:
        await group.shutdown()
    return before, runs


# The KL reference moves by EMA and is checkpointed. ZeRO-2 with LoRA after a warm start: the reference is
# a frozen second adapter, saved beside the engine's checkpoint. ZeRO-3 with a full fine-tune: the policy and
# its frozen reference copy are both partitioned, and the reference blends in place, partition by partition.
@requires_deepspeed
@pytest.mark.parametrize("mode,stage", [("lora", 2), ("full", 3)])
async def test_deepspeed_group_learns_and_resumes_exactly(ray_cluster, tmp_path, mode: str, stage: int) -> None:
    cfg = ds_cfg(mode, stage, lr=3e-3 if mode == "lora" else 1e-3)
    cfg.algorithm.kl_coef = 0.1
    cfg.learner.reference = "ema"
    before, (first, second, after_reset) = await train_save_resume(cfg, tmp_path, sft=mode == "lora")

    if mode == "lora":  # the warm start steps with its own optimizer through the same engine
        assert before["sft_losses"][1] < before["sft_losses"][0] - 0.05
    assert mean_logprob(first["score"]) > mean_logprob(before["score"]) + 0.1  # the chosen tokens got likelier
    assert before["metrics"]["samples"] == 5 and before["metrics"]["grad_norm"] > 0
    assert before["metrics"]["lr"] == cfg.learner.optim.lr  # the RL optimizer's, not the warm start's
    assert second["score"] == first["score"]
    for k in ("policy_loss", "kl", "grad_norm", "ratio_mean", "lr"):
        assert second["metrics"][k] == first["metrics"][k], k
    assert first["metrics"]["kl"] > 1e-6  # the reference trails the policy, and resumed where it was
    # The policy was copied into the reference, every partition of it (rounding apart: the adapters' forward).
    assert abs(after_reset["metrics"]["kl"]) < 1e-3 * first["metrics"]["kl"]
    if mode == "full":  # jobs.export consolidates the ZeRO-3 partitions into the weights the engines were pushed
        from actors.models import load_causal_lm
        from jobs.export import _load_full_state

        model = load_causal_lm(cfg.model.model_copy(update={"dtype": "float32"}))
        _load_full_state(model, str(tmp_path / "ckpt" / "state"))
        exported = model.state_dict()
        assert before["pushed"] and set(before["pushed"]) <= set(exported)
        for name, pushed in before["pushed"].items():
            torch.testing.assert_close(exported[name].to(pushed.dtype), pushed, msg=name)  # float32 masters
