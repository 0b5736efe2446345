"""Training-health checks: turn a step's metrics into plain-English findings with likely causes.

Each check reads one metric when it is present (absent or non-numeric metrics are skipped) and never
changes anything; the caller decides whether to log, warn or stop.

| metric                | finding when                          | meaning                                     |
|-----------------------|---------------------------------------|---------------------------------------------|
| zero_variance_frac    | == 1                                  | no group had reward variance: no signal      |
| ratio_std_after_first | == 0 (≤ ratio_std_eps)                | the policy did not move between minibatches |
| logprob_gap           | > logprob_gap_limit, or not finite    | rollout engine and learner disagree         |
| kl                    | > kl_limit, ×kl_growth in 3 checks, nan | KL to the reference is blowing up         |
| grad_norm             | == 0, or not finite                   | no gradient / numerical blow-up             |
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

# How many earlier KL values the growth test looks back over.
KL_WINDOW = 3


class HealthMonitor:
    """Stateless checks plus a short KL history for the growth test.

    kl_floor keeps the growth test from firing on KL values that are tiny in absolute terms (the KL
    to the reference starts at exactly 0, so any growth from there is "infinite"): growth is measured
    against max(earlier KL, kl_floor).
    """

    def __init__(
        self,
        logprob_gap_limit: float = 0.5,
        kl_limit: float = 1.0,
        kl_growth: float = 10.0,
        *,
        kl_floor: float = 1e-3,
        ratio_std_eps: float = 1e-7,
    ) -> None:
        for name, value in (("logprob_gap_limit", logprob_gap_limit), ("kl_limit", kl_limit)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not kl_growth > 1:
            raise ValueError(f"kl_growth must be > 1, got {kl_growth}")
        self.logprob_gap_limit = logprob_gap_limit
        self.kl_limit = kl_limit
        self.kl_growth = kl_growth
        self.kl_floor = kl_floor
        self.ratio_std_eps = ratio_std_eps
        self.kl_history: deque[tuple[int, float]] = deque(maxlen=KL_WINDOW)

    def check(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """Findings for this step's metrics, each naming the metric and its value (no step prefix: the
        caller knows the step; `step` labels the KL history)."""
        findings: list[str] = []

        zv = _number(metrics, "zero_variance_frac")
        if zv is not None and zv >= 1.0:
            findings.append(
                f"zero_variance_frac={zv:g}: every group had equal rewards, so every advantage is 0 and "
                "this step has no learning signal. Likely causes: the tasks are too hard (or too easy) for the "
                "model, the reward is saturated or constant, or the model needs a supervised warm start first."
            )

        rs = _number(metrics, "ratio_std_after_first")
        if rs is not None and abs(rs) <= self.ratio_std_eps:
            findings.append(
                f"ratio_std_after_first={rs:g}: after the first optimizer step the policy/old ratio is "
                "still exactly 1 everywhere, so the policy did not change. Likely causes: learning rate 0 "
                "(or a warmup that starts at 0), frozen parameters, or a LoRA adapter that is not trainable."
            )

        gap = _number(metrics, "logprob_gap")
        if gap is not None and not gap <= self.logprob_gap_limit:
            findings.append(
                f"logprob_gap={gap:g} (limit {self.logprob_gap_limit:g}): the rollout engine and the learner "
                "disagree on the sampled tokens' logprobs. Likely causes: new weights or the adapter were not "
                "pushed to the engine, a dtype mismatch, a sampling temperature applied on one side only, or a "
                "different chat template or tokenizer."
            )

        kl = _number(metrics, "kl")
        if kl is not None:
            findings.extend(self._check_kl(step, kl))

        gn = _number(metrics, "grad_norm")
        if gn is not None and not math.isfinite(gn):
            findings.append(
                f"grad_norm={gn}: the gradient is not finite, a numerical blow-up. Lower the learning rate, "
                "check the loss inputs for inf/nan, and prefer bfloat16 over float16."
            )
        elif gn is not None and gn == 0.0:
            findings.append(
                f"grad_norm={gn:g}: no gradient reaches the trainable parameters. Likely causes: all advantages "
                "are 0, every loss mask is empty, or the trainable parameters are not in the graph."
            )
        return findings

    def _check_kl(self, step: int, kl: float) -> list[str]:
        if not math.isfinite(kl):
            return [f"kl={kl}: the KL to the reference is not finite. Lower the learning rate."]
        found: list[str] = []
        advice = "Lower the learning rate or raise kl_coef."
        if kl > self.kl_limit:
            found.append(f"kl={kl:.4g} exceeds the limit {self.kl_limit:g}: the policy drifts fast. {advice}")
        elif self.kl_history:
            first_step, first = self.kl_history[0]
            base = max(first, self.kl_floor)
            if kl >= self.kl_growth * base:
                found.append(
                    f"kl={kl:.4g} grew {kl / base:.1f}x since step {first_step} (kl={first:.4g}), more than "
                    f"{self.kl_growth:g}x within {KL_WINDOW} checks: KL is blowing up. {advice}"
                )
        self.kl_history.append((step, kl))
        return found


def _number(metrics: Mapping[str, float], key: str) -> float | None:
    if key not in metrics:
        return None
    try:
        return float(metrics[key])
    except (TypeError, ValueError):
        return None
