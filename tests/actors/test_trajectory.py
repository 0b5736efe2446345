"""Trajectory.to_sample: the one record that GRPO, PPO and SFT train on."""

from __future__ import annotations

import pickle

from actors.trajectory import Trajectory
from grpo.batch import Sample, as_sample


def two_turns() -> Trajectory:
    """Two assistant turns (ids 10-11, then 30), an observation (20-21) between them; rewards 0.5 and 1.0."""
    t = Trajectory(task_id="t", group_id=0, sample_index=0, prompt_ids=[1, 2, 3])
    t.add_turn([10, 11], [-0.5, -0.25], "call", {"reward": 0.5}, version=0, finish="stop")
    t.add_observations([{"role": "tool", "content": "x"}], [20, 21], budget=100)
    t.add_turn([30], [-1.0], "answer", {"reward": 1.0}, version=0, finish="stop")
    t.reward = 1.5
    t.check()
    return t


def test_the_sample_carries_the_tokens_mask_logprobs_and_advantage() -> None:
    t = two_turns()
    sample = t.to_sample(0.75)
    assert as_sample(sample) == Sample(
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 20, 21, 30],
        loss_mask=[1, 1, 0, 0, 1],
        rollout_logprobs=[-0.5, -0.25, 0.0, 0.0, -1.0],
        advantage=0.75,
    )
    assert "token_rewards" not in sample  # GRPO and SFT: none
    sample["response_ids"].append(99)  # a copy: the trajectory stays as played
    assert t.response_ids == [10, 11, 20, 21, 30]
    assert pickle.loads(pickle.dumps(sample)) == sample  # plain data: crosses Ray as it is


def test_ppo_samples_put_each_turn_reward_on_its_last_generated_token() -> None:
    sample = two_turns().to_sample(ppo=True)
    assert sample["advantage"] == 0.0
    assert as_sample(sample).token_rewards == [0.0, 0.5, 0.0, 0.0, 1.0]
