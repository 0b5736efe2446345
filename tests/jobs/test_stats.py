"""jobs/stats.py on cases worked out by hand: the exact paired bootstrap, McNemar, pairing, per-template counts."""

from __future__ import annotations

import math
import random

import pytest

from jobs.stats import (
    bootstrap_distribution,
    bootstrap_interval,
    group_success,
    mcnemar_exact,
    outcomes,
    paired_gain,
)


def test_two_tasks_one_gained():
    # Resamples of 2 tasks, each the gained one with probability 1/2: G ~ Binomial(2, 1/2).
    dist = bootstrap_distribution(2, 1, 0)
    assert dist == pytest.approx({0: 0.25, 1: 0.5, 2: 0.25})
    # 2.5% quantile: the first value whose cumulative probability (0.25) reaches 0.025 → 0;
    # 97.5%: cumulative 0.25, 0.75, 1.0 → 2 tasks → a gain of 2/2.
    assert bootstrap_interval(2, 1, 0) == (0.0, 1.0)


def test_four_tasks_two_gained_one_lost():
    # g = 1/2, l = 1/4, t = 1/4; in 256ths: P(D=-4) = 1 (LLLL), P(D=-3) = 4 (LLLT),
    # P(D=-2) = 6 (LLTT) + 8 (GLLL: 4 · 2 · 1) = 14, P(D=4) = 16 (GGGG), P(D=3) = 32 (GGGT: 4 · 8 · 1).
    dist = {k: round(v * 256, 9) for k, v in bootstrap_distribution(4, 2, 1).items()}
    assert dist[-4] == 1 and dist[-3] == 4 and dist[-2] == 14 and dist[3] == 32 and dist[4] == 16
    assert sum(dist.values()) == pytest.approx(256)
    # lower: cumulative 1, 5, 19 (of 256): 19/256 ≥ 0.025 first at D=-2 → -0.5;
    # upper: P(D ≤ 3) = 240/256 < 0.975 → D=4 → 1.0.
    assert bootstrap_interval(4, 2, 1) == (-0.5, 1.0)


def test_no_discordant_pair_is_a_point():
    assert bootstrap_distribution(5, 0, 0) == {0: 1.0}
    assert bootstrap_interval(5, 0, 0) == (0.0, 0.0)
    assert mcnemar_exact(0, 0) == 1.0


def test_every_task_gained():
    assert bootstrap_distribution(3, 3, 0) == pytest.approx({3: 1.0})
    assert bootstrap_interval(3, 3, 0) == (1.0, 1.0)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError):
        bootstrap_distribution(3, 2, 2)
    with pytest.raises(ValueError):
        bootstrap_distribution(0, 0, 0)
    with pytest.raises(ValueError):
        paired_gain({"a": True}, {"a": True}, confidence=1.0)


def test_mcnemar_by_hand():
    assert mcnemar_exact(5, 0) == pytest.approx(2 / 32)  # 2 · P(X = 0), X ~ Bin(5, 1/2)
    assert mcnemar_exact(1, 6) == pytest.approx(2 * (1 + 7) / 128)  # 2 · P(X ≤ 1), X ~ Bin(7, 1/2)
    assert mcnemar_exact(3, 3) == 1.0  # 2 · 42/64 > 1: capped


def test_paired_gain_pairs_by_task_and_skips_the_unpaired():
    before = {"a": False, "b": False, "c": True, "d": True, "only-before": True}
    after = {"a": True, "b": False, "c": True, "d": False, "e": True}
    g = paired_gain(before, after)
    assert (g.n, g.gained, g.lost) == (4, 1, 1)
    assert (g.rate_before, g.rate_after, g.gain) == (0.5, 0.5, 0.0)
    assert g.p_value == 1.0
    assert g.ci_low < 0 < g.ci_high


def test_paired_gain_figures():
    # 8 tasks: 3 gained, 0 lost, 1 solved by both, 4 by neither.
    before = dict.fromkeys("abcdefgh", False) | {"h": True}
    after = before | {"a": True, "b": True, "c": True}
    g = paired_gain(before, after)
    assert (g.n, g.gained, g.lost) == (8, 3, 0)
    assert (g.rate_before, g.rate_after, g.gain) == (1 / 8, 4 / 8, 3 / 8)
    assert g.p_value == pytest.approx(2 / 8)  # 2 · (1/2)^3
    # G ~ Bin(8, 3/8): P(G=0) = (5/8)^8 ≈ 0.023 < 0.025, P(G ≤ 1) ≈ 0.13 → lower 1/8;
    # P(G ≤ 5) = 1 − P(G ≥ 6) ≈ 0.964 < 0.975 and P(G ≤ 6) ≈ 0.994 → upper 6/8.
    assert (5 / 8) ** 8 < 0.025
    p6 = sum(math.comb(8, k) * (3 / 8) ** k * (5 / 8) ** (8 - k) for k in range(7))
    assert 0.975 <= p6 and p6 - math.comb(8, 6) * (3 / 8) ** 6 * (5 / 8) ** 2 < 0.975
    assert (g.ci_low, g.ci_high) == (1 / 8, 6 / 8)


def test_nothing_in_common():
    g = paired_gain({"a": True}, {"b": True})
    assert g.n == 0 and math.isnan(g.gain) and math.isnan(g.ci_low)


def test_matches_a_seeded_monte_carlo_bootstrap():
    """The exact interval is what drawing many resamples converges to (here within one task's step)."""
    d = [1] * 9 + [-1] * 3 + [0] * 28  # n = 40: 9 gained, 3 lost
    rng = random.Random(0)
    means = sorted(sum(rng.choice(d) for _ in d) / len(d) for _ in range(10_000))
    mc = (means[int(0.025 * len(means))], means[int(0.975 * len(means)) - 1])
    exact = bootstrap_interval(40, 9, 3)
    assert exact[0] == pytest.approx(mc[0], abs=1 / 40 + 1e-9)
    assert exact[1] == pytest.approx(mc[1], abs=1 / 40 + 1e-9)


def test_outcomes_leave_out_infra_faults_and_number_repeats():
    per_task = [
        {"task_id": "t1", "success": True},
        {"task_id": "t2", "success": True, "infra_fault": True},
        {"task_id": "t1", "success": False},
        {"task_id": "t3", "success": False},
    ]
    assert outcomes(per_task) == {"t1": True, "t1#2": False, "t3": False}


def test_group_success_counts_per_template_and_stage():
    base = [
        {"task_id": "1", "template": "pe_now", "complexity": "medium", "success": False},
        {"task_id": "2", "template": "pe_now", "complexity": "medium", "success": True},
        {"task_id": "3", "template": "close_simple", "complexity": "simple", "success": False},
        {"task_id": "4", "success": True},  # no template
    ]
    after = [
        {**base[0], "success": True},
        {**base[1], "infra_fault": True},
        {**base[2], "success": True},
        {**base[3], "success": False},
    ]
    rows = group_success({"base": base, "after": after})
    assert [(r.group, r.complexity, r.tasks) for r in rows] == [
        ("close_simple", "simple", 1),
        ("pe_now", "medium", 2),
        ("(none)", "–", 1),
    ]
    pe = rows[1]
    assert pe.successes == {"base": 1, "after": 1} and pe.scored == {"base": 2, "after": 1}
    assert rows[0].successes == {"base": 0, "after": 1}
    assert rows[2].successes == {"base": 1, "after": 0}
