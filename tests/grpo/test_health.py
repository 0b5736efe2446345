"""HealthMonitor: each finding fires on its metric, and a healthy step gives none."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from grpo.health import HealthMonitor

HEALTHY = {
    "zero_variance_frac": 0.25,
    "ratio_std_after_first": 0.03,
    "logprob_gap": 0.02,
    "kl": 0.01,
    "grad_norm": 0.7,
}


def test_healthy_steps_give_no_findings() -> None:
    monitor = HealthMonitor()
    for step in range(6):
        assert monitor.check(step, HEALTHY | {"kl": 0.01 * (1 + step)}) == []
    assert monitor.check(6, {}) == []  # absent metrics are skipped


@pytest.mark.parametrize(
    ("metric", "value", "words"),
    [
        ("zero_variance_frac", 1.0, ["zero_variance_frac=1", "no learning signal", "warm start"]),
        ("ratio_std_after_first", 0.0, ["ratio_std_after_first=0", "did not change", "not trainable"]),
        ("logprob_gap", 0.9, ["logprob_gap=0.9", "limit 0.5", "chat template"]),
        ("kl", 1.5, ["kl=1.5", "limit 1", "raise kl_coef"]),
        ("grad_norm", 0.0, ["grad_norm=0", "no gradient"]),
        ("grad_norm", float("nan"), ["grad_norm=nan", "not finite"]),
        ("grad_norm", float("inf"), ["grad_norm=inf", "blow-up"]),
        ("logprob_gap", float("nan"), ["logprob_gap=nan"]),
        ("kl", float("nan"), ["kl=nan", "not finite"]),
    ],
)
def test_each_finding_names_its_metric_and_value(metric: str, value: float, words: list[str]) -> None:
    findings = HealthMonitor().check(3, HEALTHY | {metric: value})
    assert len(findings) == 1, findings
    assert findings[0].startswith(metric + "=")
    for w in words:
        assert w in findings[0]


def test_kl_growth_over_the_last_three_checks() -> None:
    monitor = HealthMonitor(kl_growth=10.0)
    assert monitor.check(0, {"kl": 0.01}) == []
    assert monitor.check(1, {"kl": 0.03}) == []
    assert monitor.check(2, {"kl": 0.06}) == []
    (finding,) = monitor.check(3, {"kl": 0.12})  # 12x the value three checks back, below the limit
    assert "kl=0.12" in finding and "since step 0" in finding and "blowing up" in finding
    # the window slides: step 0 is forgotten, 0.2 is < 10x 0.03
    assert monitor.check(4, {"kl": 0.2}) == []


def test_kl_growth_from_zero_is_measured_against_the_floor() -> None:
    monitor = HealthMonitor(kl_floor=1e-3)
    assert monitor.check(0, {"kl": 0.0}) == []  # policy == reference at the start
    assert monitor.check(1, {"kl": 5e-3}) == []  # 5x the floor
    assert len(monitor.check(2, {"kl": 0.02})) == 1  # 20x the floor


def test_several_findings_at_once_and_metrics_untouched() -> None:
    metrics = MappingProxyType({"zero_variance_frac": 1.0, "grad_norm": 0.0, "kl": 2.0, "other": "text"})
    findings = HealthMonitor().check(7, metrics)
    assert len(findings) == 3
    assert dict(metrics) == {"zero_variance_frac": 1.0, "grad_norm": 0.0, "kl": 2.0, "other": "text"}


def test_limits_are_configurable_and_checked() -> None:
    assert HealthMonitor(logprob_gap_limit=1.0).check(0, {"logprob_gap": 0.9}) == []
    assert len(HealthMonitor(kl_limit=0.1).check(0, {"kl": 0.2})) == 1
    with pytest.raises(ValueError, match="kl_growth"):
        HealthMonitor(kl_growth=1.0)
    with pytest.raises(ValueError, match="kl_limit"):
        HealthMonitor(kl_limit=0.0)
