"""Training-health checks: turn a step's metrics into plain-English findings with likely causes, and
say when one of them has lasted long enough to end the run.

Each check reads one metric when it is present (absent or non-numeric metrics are skipped) and never
changes anything. Every finding has a short stable name (what `health.stop_on` lists):

| name             | metric                | fires when                           | meaning                          |
|------------------|-----------------------|--------------------------------------|----------------------------------|
| zero_variance    | zero_variance_frac    | == 1                                 | no group had reward variance     |
| ratio_degenerate | ratio_std_after_first | == 0 (≤ ratio_std_eps)               | no move between minibatches      |
| logprob_gap      | logprob_gap           | > logprob_gap_limit, or not finite   | engine and learner disagree      |
| kl_blowup        | kl                    | > kl_limit, ×kl_growth in 3, or nan  | KL to the reference blows up     |
| grad_norm        | grad_norm             | == 0, or not finite                  | no gradient / numerical blow-up  |

A finding named in `stop_on` that fires at K consecutive checks (K = its patience) is `due()`: the
caller (jobs/train.py) then ends the run. A step where it does not fire, or its metric is absent,
starts the count again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# How many earlier KL values the growth test looks back over.
KL_WINDOW = 3

# The findings' names, in the order the checks run (configs/schema.py's FindingName spells the same).
FINDINGS = ("zero_variance", "ratio_degenerate", "logprob_gap", "kl_blowup", "grad_norm")


@dataclass(frozen=True)
class Finding:
    """One finding: its stable `name`, the `message` (metric, value, likely causes) and the metric
    `values` that raised it."""

    name: str
    message: str
    values: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class HealthStop:
    """A `stop_on` finding that held at `patience` consecutive checks: (step, finding) for each."""

    name: str
    patience: int
    held: tuple[tuple[int, Finding], ...]

    def describe(self) -> str:
        """One line: the finding, the steps, and its values at each, e.g.
        `zero_variance held for 2 consecutive steps (steps 1-2): zero_variance_frac=1 at step 1, 1 at step 2`."""
        first, last = self.held[0][0], self.held[-1][0]
        keys = list(self.held[-1][1].values)
        values = "; ".join(
            f"{k}=" + ", ".join(f"{f.values.get(k, math.nan):g} at step {s}" for s, f in self.held) for k in keys
        )
        steps = f"step {last}" if first == last else f"steps {first}-{last}"
        return f"{self.name} held for {self.patience} consecutive step{'s' * (self.patience > 1)} ({steps}): {values}"


class HealthMonitor:
    """Stateless checks plus a short KL history for the growth test, and per finding the run of
    consecutive checks at which it fired (for `stop_on`).

    kl_floor keeps the growth test from firing on KL values that are tiny in absolute terms (the KL
    to the reference starts at exactly 0, so any growth from there is "infinite"): growth is measured
    against max(earlier KL, kl_floor). patience: the consecutive checks a `stop_on` finding must hold;
    patience_per_finding overrides it by name.
    """

    def __init__(
        self,
        logprob_gap_limit: float = 0.5,
        kl_limit: float = 1.0,
        kl_growth: float = 10.0,
        *,
        kl_floor: float = 1e-3,
        ratio_std_eps: float = 1e-7,
        stop_on: Iterable[str] = (),
        patience: int = 3,
        patience_per_finding: Mapping[str, int] | None = None,
    ) -> None:
        for name, value in (("logprob_gap_limit", logprob_gap_limit), ("kl_limit", kl_limit)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not kl_growth > 1:
            raise ValueError(f"kl_growth must be > 1, got {kl_growth}")
        self.stop_on = tuple(stop_on)
        per = dict(patience_per_finding or {})
        for name in (*self.stop_on, *per):
            if name not in FINDINGS:
                raise ValueError(f"unknown health finding {name!r}; the findings are: {', '.join(FINDINGS)}")
        for name, k in {"patience": patience, **{f"patience of {n}": v for n, v in per.items()}}.items():
            if k < 1:
                raise ValueError(f"{name} must be >= 1 (consecutive checks), got {k}")
        self.logprob_gap_limit = logprob_gap_limit
        self.kl_limit = kl_limit
        self.kl_growth = kl_growth
        self.kl_floor = kl_floor
        self.ratio_std_eps = ratio_std_eps
        self.patience = {name: per.get(name, patience) for name in FINDINGS}
        self.kl_history: deque[tuple[int, float]] = deque(maxlen=KL_WINDOW)
        self.streaks: dict[str, deque[tuple[int, Finding]]] = {
            name: deque(maxlen=self.patience[name]) for name in FINDINGS
        }

    def due(self) -> HealthStop | None:
        """The first `stop_on` finding that fired at each of its last `patience` checks, else None."""
        for name in self.stop_on:
            streak = self.streaks[name]
            if len(streak) >= self.patience[name]:
                return HealthStop(name, self.patience[name], tuple(streak))
        return None

    def check(self, step: int, metrics: Mapping[str, float]) -> list[Finding]:
        """Findings for this step's metrics, each naming the metric and its value (no step prefix: the
        caller knows the step; `step` labels the KL history and the streaks `due()` reads)."""
        findings: list[Finding] = []

        zv = _number(metrics, "zero_variance_frac")
        if zv is not None and zv >= 1.0:
            findings.append(
                Finding(
                    "zero_variance",
                    f"zero_variance_frac={zv:g}: every group had equal rewards, so every advantage is 0 and this "
                    "step has no learning signal. Likely causes: the tasks are too hard (or too easy) for the "
                    "model, the reward is saturated or constant, or the model needs a supervised warm start first.",
                    {"zero_variance_frac": zv},
                )
            )

        rs = _number(metrics, "ratio_std_after_first")
        if rs is not None and abs(rs) <= self.ratio_std_eps:
            findings.append(
                Finding(
                    "ratio_degenerate",
                    f"ratio_std_after_first={rs:g}: after the first optimizer step the policy/old ratio is "
                    "still exactly 1 everywhere, so the policy did not change. Likely causes: learning rate 0 "
                    "(or a warmup that starts at 0), frozen parameters, or a LoRA adapter that is not trainable.",
                    {"ratio_std_after_first": rs},
                )
            )

        gap = _number(metrics, "logprob_gap")
        if gap is not None and not gap <= self.logprob_gap_limit:
            findings.append(
                Finding(
                    "logprob_gap",
                    f"logprob_gap={gap:g} (limit {self.logprob_gap_limit:g}): the rollout engine and the learner "
                    "disagree on the sampled tokens' logprobs. Likely causes: new weights or the adapter were not "
                    "pushed to the engine, a dtype mismatch, a sampling temperature applied on one side only, or "
                    "a different chat template or tokenizer.",
                    {"logprob_gap": gap},
                )
            )

        kl = _number(metrics, "kl")
        if kl is not None:
            findings.extend(self._check_kl(step, kl))

        gn = _number(metrics, "grad_norm")
        if gn is not None and not math.isfinite(gn):
            findings.append(
                Finding(
                    "grad_norm",
                    f"grad_norm={gn}: the gradient is not finite, a numerical blow-up. Lower the learning rate, "
                    "check the loss inputs for inf/nan, and prefer bfloat16 over float16.",
                    {"grad_norm": gn},
                )
            )
        elif gn is not None and gn == 0.0:
            findings.append(
                Finding(
                    "grad_norm",
                    f"grad_norm={gn:g}: no gradient reaches the trainable parameters. Likely causes: all "
                    "advantages are 0, every loss mask is empty, or the trainable parameters are not in the graph.",
                    {"grad_norm": gn},
                )
            )

        fired = {f.name: f for f in findings}
        for name, streak in self.streaks.items():
            if name in fired:
                streak.append((step, fired[name]))
            else:
                streak.clear()  # not consecutive any more
        return findings

    def _check_kl(self, step: int, kl: float) -> list[Finding]:
        if not math.isfinite(kl):
            return [
                Finding(
                    "kl_blowup", f"kl={kl}: the KL to the reference is not finite. Lower the learning rate.", {"kl": kl}
                )
            ]
        found: list[Finding] = []
        advice = "Lower the learning rate or raise kl_coef."
        if kl > self.kl_limit:
            message = f"kl={kl:.4g} exceeds the limit {self.kl_limit:g}: the policy drifts fast. {advice}"
            found.append(Finding("kl_blowup", message, {"kl": kl}))
        elif self.kl_history:
            first_step, first = self.kl_history[0]
            base = max(first, self.kl_floor)
            if kl >= self.kl_growth * base:
                message = (
                    f"kl={kl:.4g} grew {kl / base:.1f}x since step {first_step} (kl={first:.4g}), more than "
                    f"{self.kl_growth:g}x within {KL_WINDOW} checks: KL is blowing up. {advice}"
                )
                found.append(Finding("kl_blowup", message, {"kl": kl}))
        self.kl_history.append((step, kl))
        return found


def _number(metrics: Mapping[str, float], key: str) -> float | None:
    if key not in metrics:
        return None
    try:
        return float(metrics[key])
    except (TypeError, ValueError):
        return None
