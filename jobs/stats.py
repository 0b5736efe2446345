"""Paired comparison of two evaluation stages on the same tasks: is the gain more than noise?

Each stage plays every held-out task once (greedy), so a task has a pair of outcomes (before, after).
`paired_gain(before, after)` gives, over the tasks both stages scored:

- the success rates and the gain `after − before` (a difference of proportions, in [-1, 1]);
- `gained` (failed before, succeeded after) and `lost` (the reverse): the discordant pairs, the only
  tasks that move the gain: gain = (gained − lost) / n;
- a 95% confidence interval for the gain: the **paired bootstrap percentile interval**, resampling
  tasks (with their pair of outcomes) with replacement. It is computed exactly, not by drawing
  resamples: a resample of n tasks holds G gained and L lost ones with the multinomial probability
  n!/(G! L! T!) · g^G · l^L · t^T (g, l, t: the observed fractions of gained, lost and unchanged tasks),
  and its gain is (G − L)/n; the interval's ends are the 2.5% and 97.5% quantiles of that
  distribution (the smallest value whose cumulative probability reaches the level). That is the
  limit of a Monte Carlo bootstrap as its resamples go to infinity: no sampling error, no seed, and
  a rerun gives the same figures by construction. Cost: O(n²) terms (n = 256: ~33,000).
- `p_value`: the exact two-sided McNemar test (a binomial test on the discordant pairs:
  under "no change" each is a gain or a loss with probability 1/2).

Caveats, as with any percentile bootstrap: with no discordant pair the interval is [0, 0] (nothing
varied; p = 1 says as much), and with few tasks it is too narrow; read it with n beside it.

`group_success(per_task_by_stage, key)`: successes per group (e.g. template) and stage, for the
per-template table.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CONFIDENCE = 0.95
_EPS = 1e-12  # cumulative probabilities that reach a level up to rounding count as reaching it


@dataclass(frozen=True)
class PairedGain:
    """`after` − `before` on the `n` tasks both scored (see the module docstring)."""

    n: int
    rate_before: float
    rate_after: float
    gain: float
    ci_low: float
    ci_high: float
    gained: int
    lost: int
    p_value: float
    confidence: float = CONFIDENCE


def paired_gain(before: Mapping[str, bool], after: Mapping[str, bool], confidence: float = CONFIDENCE) -> PairedGain:
    """Compare two stages' outcomes, task id → success; tasks missing from either are left out."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    common = [k for k in before if k in after]
    n = len(common)
    if n == 0:
        nan = math.nan
        return PairedGain(0, nan, nan, nan, nan, nan, 0, 0, nan, confidence)
    b = [bool(before[k]) for k in common]
    a = [bool(after[k]) for k in common]
    gained = sum(x and not y for x, y in zip(a, b, strict=True))
    lost = sum(y and not x for x, y in zip(a, b, strict=True))
    low, high = bootstrap_interval(n, gained, lost, confidence)
    return PairedGain(
        n=n,
        rate_before=sum(b) / n,
        rate_after=sum(a) / n,
        gain=(gained - lost) / n,
        ci_low=low,
        ci_high=high,
        gained=gained,
        lost=lost,
        p_value=mcnemar_exact(gained, lost),
        confidence=confidence,
    )


def bootstrap_distribution(n: int, gained: int, lost: int) -> dict[int, float]:
    """G − L → probability, over bootstrap resamples of n tasks of which `gained` and `lost` are discordant."""
    if n < 1 or gained < 0 or lost < 0 or gained + lost > n:
        raise ValueError(f"need n >= 1 and 0 <= gained + lost <= n; got n={n}, gained={gained}, lost={lost}")
    g, ll, t = gained / n, lost / n, (n - gained - lost) / n
    log_g, log_l, log_t = (math.log(p) if p > 0 else None for p in (g, ll, t))
    log_n = math.lgamma(n + 1)
    dist: dict[int, float] = {}
    for big_g in range(n + 1 if gained else 1):
        for big_l in range(n - big_g + 1 if lost else 1):
            rest = n - big_g - big_l
            if rest and log_t is None:
                continue  # every task is discordant: the resample has no unchanged one
            logp = log_n - math.lgamma(big_g + 1) - math.lgamma(big_l + 1) - math.lgamma(rest + 1)
            logp += (big_g * log_g if big_g else 0.0) + (big_l * log_l if big_l else 0.0)
            logp += rest * log_t if rest else 0.0
            dist[big_g - big_l] = dist.get(big_g - big_l, 0.0) + math.exp(logp)
    return dict(sorted(dist.items()))


def bootstrap_interval(n: int, gained: int, lost: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The exact paired bootstrap percentile interval of the gain (G − L)/n."""
    dist = bootstrap_distribution(n, gained, lost)
    alpha = 1 - confidence
    return _quantile(dist, alpha / 2) / n, _quantile(dist, 1 - alpha / 2) / n


def _quantile(dist: Mapping[int, float], level: float) -> int:
    total = 0.0
    for value, p in dist.items():  # ascending
        total += p
        if total >= level - _EPS:
            return value
    return max(dist)


def mcnemar_exact(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: 2 · P(Binomial(gained + lost, 1/2) ≤ min(gained, lost)), at most 1."""
    m = gained + lost
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, k) for k in range(min(gained, lost) + 1)) / 2**m
    return min(1.0, 2 * tail)


def outcomes(per_task: Sequence[Mapping[str, Any]]) -> dict[str, bool]:
    """An evaluation's `per_task` entries → task key → success, leaving out infrastructure-spoiled episodes.

    The key is the task id; a repeated id gets `#2`, `#3`, ... in order, so two stages that played the
    same task list pair up even then."""
    seen: Counter[str] = Counter()
    out: dict[str, bool] = {}
    for entry in per_task:
        tid = str(entry.get("task_id"))
        seen[tid] += 1
        if entry.get("infra_fault"):
            continue
        out[tid if seen[tid] == 1 else f"{tid}#{seen[tid]}"] = bool(entry.get("success"))
    return out


@dataclass(frozen=True)
class GroupRow:
    """One group (e.g. a template) of the per-group table: its `successes` and `scored` counts per stage."""

    group: str
    complexity: str
    tasks: int
    successes: dict[str, int]
    scored: dict[str, int]


def group_success(
    per_task_by_stage: Mapping[str, Sequence[Mapping[str, Any]]],
    key: Callable[[Mapping[str, Any]], str] = lambda e: str(e.get("template") or "(none)"),
) -> list[GroupRow]:
    """Successes per group and stage from each stage's `per_task`; groups sorted by (complexity, name).

    `tasks`: the most entries the group has in any stage; `scored`: those not spoiled by the
    infrastructure. A group's complexity is its entries' `complexity` ("–" when none, "mixed")."""
    tasks: dict[str, int] = {}
    kinds: dict[str, set[str]] = {}
    successes: dict[str, dict[str, int]] = {}
    scored: dict[str, dict[str, int]] = {}
    for stage, entries in per_task_by_stage.items():
        count: Counter[str] = Counter()
        for e in entries:
            g = key(e)
            count[g] += 1
            kinds.setdefault(g, set()).add(str(e.get("complexity") or "–"))
            successes.setdefault(g, {})
            scored.setdefault(g, {})
            if not e.get("infra_fault"):
                scored[g][stage] = scored[g].get(stage, 0) + 1
                successes[g][stage] = successes[g].get(stage, 0) + bool(e.get("success"))
        for g, c in count.items():
            tasks[g] = max(tasks.get(g, 0), c)
    order = {"simple": 0, "medium": 1, "hard": 2}
    rows = [
        GroupRow(g, next(iter(kinds[g])) if len(kinds[g]) == 1 else "mixed", tasks[g], successes[g], scored[g])
        for g in tasks
    ]
    return sorted(rows, key=lambda r: (order.get(r.complexity, 9), r.complexity, r.group))


__all__ = [
    "CONFIDENCE",
    "GroupRow",
    "PairedGain",
    "bootstrap_distribution",
    "bootstrap_interval",
    "group_success",
    "mcnemar_exact",
    "outcomes",
    "paired_gain",
]
