"""grpo/groups.py on hand-built GRPO groups: outcomes rank first, and the filter keeps only groups with both."""

from __future__ import annotations

import itertools

import pytest

from grpo.advantages import group_advantages
from grpo.groups import outcome_first_scores, outcome_groups


def test_no_failed_episode_outranks_a_succeeded_one():
    # A group as the demo makes them: a guessed right answer (shaped −0.5 + outcome 1.0 = 0.5 in total)
    # against a failed episode whose calls all ran (shaped 1.0): summed, the failure ranks first.
    rewards = [0.5, 1.0, -0.4, 2.0]
    outcome_paid = [1.0, 0.0, 0.0, 1.0]
    outcomes = [True, False, False, True]
    assert rewards[1] > rewards[0]  # the summed reward's ranking, which taught "any call that runs"
    scores = outcome_first_scores(rewards, outcome_paid, outcomes, shaping=0.5)
    right = [s for s, o in zip(scores, outcomes, strict=True) if o]
    wrong = [s for s, o in zip(scores, outcomes, strict=True) if not o]
    assert min(right) > max(wrong)
    # Among equal outcomes the shaped part still orders them.
    assert scores[1] > scores[2] and scores[3] > scores[0]
    adv, _ = group_advantages(scores, [0] * 4)
    assert min(adv[0], adv[3]) > max(adv[1], adv[2])


def test_outcome_first_holds_for_any_shaped_totals():
    shaped = [-6.0, -1.0, -0.2, 0.0, 0.3, 1.0, 2.4, 8.0]
    for win, lose in itertools.product(shaped, shaped):
        s_win, s_lose = outcome_first_scores([win + 1.0, lose], [1.0, 0.0], [True, False], shaping=0.9)
        assert s_win > s_lose


def test_shaping_must_stay_below_one():
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        outcome_first_scores([1.0], [1.0], [True], shaping=1.0)
    with pytest.raises(ValueError, match="lengths"):
        outcome_first_scores([1.0, 0.0], [1.0], [True], shaping=0.5)


def test_filter_keeps_only_groups_with_both_outcomes():
    # group 0: mixed; 1: all wrong but very different shaped rewards; 2: all right; 3: mixed; 4: a singleton
    outcomes = [True, False, False, False, False, True, True, False, True, True]
    groups = [0, 0, 1, 1, 1, 2, 2, 3, 3, 4]
    keep, stats = outcome_groups(outcomes, groups)
    assert keep == [True, True, False, False, False, False, False, True, True, False]
    assert stats == {
        "groups": 5.0,
        "groups_kept": 2.0,
        "groups_kept_frac": 0.4,
        "groups_all_right": 2.0,
        "groups_all_wrong": 1.0,
        "episodes_kept": 4.0,
    }


def test_filter_looks_at_outcomes_not_shaped_totals():
    # All-fail group whose shaped totals differ: a filter on the total would keep it; this one does not.
    shaped_totals = [1.2, -0.6, 0.3, 0.0]
    assert len(set(shaped_totals)) > 1
    keep, stats = outcome_groups([False] * 4, [7] * 4)
    assert keep == [False] * 4 and stats["groups_kept"] == 0 and stats["groups_all_wrong"] == 1


def test_filter_of_nothing():
    keep, stats = outcome_groups([], [])
    assert keep == [] and stats["groups"] == 0 and stats["groups_kept_frac"] == 0
    with pytest.raises(ValueError, match="group ids"):
        outcome_groups([True], [])
