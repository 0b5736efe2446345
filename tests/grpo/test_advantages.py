"""group_advantages: hand-computed cases for each method, zero-variance groups and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.advantages import ADVANTAGE_METHODS, group_advantages

EPS = 1e-6


def close(t: torch.Tensor, expected: list[float], tol: float = 1e-6) -> None:
    assert t.dtype == torch.float32
    assert t.tolist() == pytest.approx(expected, abs=tol)


def test_grpo_two_groups_of_two() -> None:
    adv, stats = group_advantages([1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])
    # Each group: mean 0.5, population std 0.5 -> ±0.5 / (0.5 + eps).
    a = 0.5 / (0.5 + EPS)
    close(adv, [a, -a, -a, a])
    assert stats["groups"] == 2 and stats["zero_variance_groups"] == 0 and stats["zero_variance_frac"] == 0
    assert stats["reward_mean"] == pytest.approx(0.5) and stats["reward_std"] == pytest.approx(0.5)


@pytest.mark.parametrize("std_normalize", [True, False])
def test_dr_grpo_is_mean_centred_whatever_std_normalize_says(std_normalize: bool) -> None:
    """Dr. GRPO: r − mean of the group, never divided by the group's std (Liu et al. 2025)."""
    adv, stats = group_advantages([1.0, 0.0, 3.0, 1.0, 2.0, 2.0], [0, 0, 1, 1, 2, 2], "dr_grpo", std_normalize)
    close(adv, [0.5, -0.5, 1.0, -1.0, 0.0, 0.0])
    assert stats["zero_variance_groups"] == 1


def test_grpo_group_of_three_uses_population_std() -> None:
    adv, _ = group_advantages([1.0, 0.0, 0.0], [4, 4, 4])
    # mean 1/3, population std sqrt(2/9): (2/3)/sqrt(2/9) = sqrt(2), -(1/3)/sqrt(2/9) = -1/sqrt(2)
    close(adv, [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)], tol=1e-5)
    # unit RMS within the group whatever G is (ddof 0)
    assert float(adv.pow(2).mean()) == pytest.approx(1.0, abs=1e-5)


def test_grpo_without_std_normalize_is_mean_centred() -> None:
    adv, _ = group_advantages([1.0, 0.0, 3.0, 1.0], [0, 0, 1, 1], std_normalize=False)
    close(adv, [0.5, -0.5, 1.0, -1.0])


def test_rloo_leave_one_out_baseline() -> None:
    adv, stats = group_advantages([1.0, 0.0, 0.0, 2.0], [0, 0, 0, 1], method="rloo")
    # group 0: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (= 3/2 · (r - 1/3)); group 1 is a singleton -> 0
    close(adv, [1.0, -0.5, -0.5, 0.0])
    assert stats["zero_variance_groups"] == 1 and stats["zero_variance_frac"] == 0.5
    # std_normalize does not apply to rloo
    adv2, _ = group_advantages([1.0, 0.0, 0.0, 2.0], [0, 0, 0, 1], method="rloo", std_normalize=False)
    assert torch.equal(adv, adv2)


def test_reinforce_pp_normalises_by_batch_std() -> None:
    rewards, groups = [1.0, 0.0, 3.0, 1.0], [0, 0, 1, 1]
    adv, _ = group_advantages(rewards, groups, method="reinforce_pp")
    # centred: [0.5, -0.5, 1, -1]; batch std sqrt((0.25+0.25+1+1)/4) = sqrt(0.625)
    s = math.sqrt(0.625) + EPS
    close(adv, [0.5 / s, -0.5 / s, 1 / s, -1 / s], tol=1e-5)
    # grpo, by contrast, scales each group to unit size
    grpo, _ = group_advantages(rewards, groups, method="grpo")
    close(grpo, [1.0, -1.0, 1.0, -1.0], tol=1e-5)
    raw, _ = group_advantages(rewards, groups, method="reinforce_pp", std_normalize=False)
    close(raw, [0.5, -0.5, 1.0, -1.0])


@pytest.mark.parametrize("method", ADVANTAGE_METHODS)
def test_zero_variance_groups_give_zero_and_are_counted(method: str) -> None:
    adv, stats = group_advantages([1.0, 1.0, 0.0, 1.0, 0.3], [0, 0, 1, 1, 2], method=method)
    assert adv[0] == 0 and adv[1] == 0 and adv[4] == 0  # equal-reward group and singleton
    assert adv[2] < 0 < adv[3]
    assert stats["groups"] == 3 and stats["zero_variance_groups"] == 2
    assert stats["zero_variance_frac"] == pytest.approx(2 / 3)


def test_all_groups_zero_variance() -> None:
    adv, stats = group_advantages([0.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], method="reinforce_pp")
    assert torch.equal(adv, torch.zeros(4))
    assert stats["zero_variance_frac"] == 1.0


def test_group_ids_need_not_be_contiguous_and_tensors_are_accepted() -> None:
    adv, stats = group_advantages(torch.tensor([2.0, 5.0, 0.0, 5.0]), torch.tensor([7, 3, 7, 3]), std_normalize=False)
    close(adv, [1.0, 0.0, -1.0, 0.0])
    assert stats["groups"] == 2 and stats["zero_variance_groups"] == 1


def test_advantages_sum_to_zero_per_group() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=g)
    groups = torch.arange(24) // 6
    for method in ADVANTAGE_METHODS:
        adv, _ = group_advantages(rewards, groups, method=method)
        sums = torch.zeros(4).index_add_(0, groups, adv)
        assert sums.abs().max() < 1e-5, method


def test_empty_batch() -> None:
    adv, stats = group_advantages([], [])
    assert adv.shape == (0,) and stats["groups"] == 0 and stats["zero_variance_frac"] == 0


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="grpo, rloo, reinforce_pp"):
        group_advantages([1.0], [0], method="ppo")
    with pytest.raises(ValueError, match="4 entries but group_ids has 3"):
        group_advantages([1.0, 0.0, 1.0, 0.0], [0, 0, 1])
    with pytest.raises(ValueError, match=r"rewards\[1\] is nan"):
        group_advantages([1.0, float("nan")], [0, 0])
    with pytest.raises(ValueError, match="group_ids must hold integers"):
        group_advantages([1.0, 0.0], [0.5, 0.0])
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))
