"""What a GRPO group teaches: outcome-first scores and the filter on outcome variance.

Two rules keep the shaped reward from outranking the outcome (the episode's final answer right or not):

- `outcome_first_scores`: an episode's score is its binary outcome plus `shaping` × a squashed shaped
  total, s_i = o_i + shaping · σ(r_i − outcome_i), σ the logistic function (0..1). With shaping < 1 every
  succeeded episode scores above every failed one of its group, whatever their shaped parts; among
  episodes of equal outcome the shaped part still orders them (a right call beats a malformed one).
- `outcome_groups` (DAPO's dynamic sampling): a group whose episodes all succeeded, or all failed,
  carries no outcome signal. Only its shaped differences would be left, and after the group's std
  normalisation they weigh as much as a real success: on the demo such all-fail groups taught the policy
  "any call that runs". The filter looks at the binary outcome, never at the shaped total (a filter on
  the total lets exactly those groups through). Dropping them is also the cheapest learner speed-up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def outcome_first_scores(
    rewards: Sequence[float], outcome_rewards: Sequence[float], outcomes: Sequence[bool], shaping: float
) -> list[float]:
    """Scores s_i = o_i + shaping · σ(r_i − outcome_reward_i); `shaping` in [0, 1) keeps outcomes first.

    rewards: episode totals; outcome_rewards: the part of each total the outcome paid (taken out so that
    the shaped part is the rest); outcomes: whether each episode succeeded."""
    if not 0 <= shaping < 1:
        raise ValueError(f"shaping must be in [0, 1) so that no failed episode outranks a succeeded one; got {shaping}")
    if not len(rewards) == len(outcome_rewards) == len(outcomes):
        raise ValueError(f"lengths differ: {len(rewards)} rewards, {len(outcome_rewards)}, {len(outcomes)} outcomes")
    return [
        float(o) + shaping * _logistic(r - orew) for r, orew, o in zip(rewards, outcome_rewards, outcomes, strict=True)
    ]


def outcome_groups(outcomes: Sequence[bool], group_ids: Sequence[int]) -> tuple[list[bool], dict[str, float]]:
    """Which episodes to keep: those of groups with both outcomes in them. Returns a keep flag per episode
    and stats: groups, groups_kept, groups_kept_frac, groups_all_right, groups_all_wrong, episodes_kept."""
    if len(outcomes) != len(group_ids):
        raise ValueError(f"{len(outcomes)} outcomes but {len(group_ids)} group ids")
    seen: dict[int, set[bool]] = {}
    for o, g in zip(outcomes, group_ids, strict=True):
        seen.setdefault(int(g), set()).add(bool(o))
    mixed = {g for g, values in seen.items() if len(values) == 2}
    keep = [int(g) in mixed for g in group_ids]
    n = len(seen)
    stats = {
        "groups": float(n),
        "groups_kept": float(len(mixed)),
        "groups_kept_frac": len(mixed) / n if n else 0.0,
        "groups_all_right": float(sum(values == {True} for values in seen.values())),
        "groups_all_wrong": float(sum(values == {False} for values in seen.values())),
        "episodes_kept": float(sum(keep)),
    }
    return keep, stats


def _logistic(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)
