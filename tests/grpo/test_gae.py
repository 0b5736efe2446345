"""PPO's per-token rewards and GAE (grpo/gae.py): hand-computed two-turn episodes."""

from __future__ import annotations

import pytest
import torch

from grpo.gae import gae, token_rewards

# Two turns: generated a1 a2, an observation (two tokens, not actions), generated a3 a4.
MASK = [1, 1, 0, 0, 1, 1]


def test_turn_rewards_go_on_each_turns_last_generated_token() -> None:
    assert token_rewards(MASK, [0.5, 1.0]) == [0.0, 0.5, 0.0, 0.0, 0.0, 1.0]
    # a group judge rescored the episode to 2.0: the difference goes on the last generated token
    assert token_rewards(MASK, [0.5, 1.0], total=2.0) == [0.0, 0.5, 0.0, 0.0, 0.0, 1.5]
    # a turn that generated nothing has no run of its own: the whole reward on the last generated token
    assert token_rewards(MASK, [0.5, 1.0, 0.25]) == [0.0, 0.0, 0.0, 0.0, 0.0, 1.75]
    # the runner's closing token after the last turn (mask 0) is not an action
    assert token_rewards([1, 1, 0], [1.0]) == [0.0, 1.0, 0.0]
    assert token_rewards([0, 0], [1.0], total=1.0) == [0.0, 0.0]  # nothing generated: nothing to credit


def test_gae_two_turns_by_hand() -> None:
    """γ = 0.9, λ = 0.8; rewards 0.5 (end of turn 1) and 1.0 (end of turn 2); V = 0.1, 0.2, 0.3, 0.4 on the
    actions and junk (9) on the observation tokens, which GAE steps over (one γ from a2 to a3):
        a4: δ = 1.0 + 0          − 0.4 = 0.6    A = 0.6
        a3: δ = 0   + 0.9·0.4    − 0.3 = 0.06   A = 0.06 + 0.72·0.6     = 0.492
        a2: δ = 0.5 + 0.9·0.3    − 0.2 = 0.57   A = 0.57 + 0.72·0.492   = 0.92424
        a1: δ = 0   + 0.9·0.2    − 0.1 = 0.08   A = 0.08 + 0.72·0.92424 = 0.7454528
    returns R = A + V."""
    rewards = torch.tensor([token_rewards(MASK, [0.5, 1.0])])
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4]], dtype=torch.float64)
    adv, ret = gae(rewards, values, torch.tensor([MASK]), gamma=0.9, lam=0.8)
    assert adv.dtype == torch.float64
    assert adv[0].tolist() == pytest.approx([0.7454528, 0.92424, 0.0, 0.0, 0.492, 0.6])
    assert ret[0].tolist() == pytest.approx([0.8454528, 1.12424, 0.0, 0.0, 0.792, 1.0])


def test_gae_with_gamma_lambda_one_and_no_values_is_reward_to_go() -> None:
    rewards = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([MASK, [1, 1, 1, 0, 0, 0]])  # a second, padded row
    adv, ret = gae(rewards, torch.zeros(2, 6), mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[1.5, 1.5, 0, 0, 1.0, 1.0], [2.0, 2.0, 2.0, 0, 0, 0]]))
    assert torch.equal(adv, ret)
    # λ = 0: one-step TD errors
    adv, _ = gae(rewards[:1], torch.full((1, 6), 0.5), mask[:1], gamma=1.0, lam=0.0)
    assert adv[0].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0, 0.0, 0.5])


def test_gae_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="position 2"):
        gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.zeros(1, 3), torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), gamma=1.5)
    with pytest.raises(ValueError, match="same"):
        gae(torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3))
