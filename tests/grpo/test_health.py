"""HealthMonitor: each finding fires on its metric under its stable name, a healthy step gives none, and a
`stop_on` finding is due only after K consecutive checks."""

from __future__ import annotations

from types import MappingProxyType
from typing import get_args

import pytest

from configs.schema import FindingName, HealthConfig
from grpo.health import FINDINGS, HealthMonitor

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
    ("metric", "value", "name", "words"),
    [
        ("zero_variance_frac", 1.0, "zero_variance", ["zero_variance_frac=1", "no learning signal", "warm start"]),
        ("ratio_std_after_first", 0.0, "ratio_degenerate", ["ratio_std_after_first=0", "did not change"]),
        ("logprob_gap", 0.9, "logprob_gap", ["logprob_gap=0.9", "limit 0.5", "chat template"]),
        ("kl", 1.5, "kl_blowup", ["kl=1.5", "limit 1", "raise kl_coef"]),
        ("grad_norm", 0.0, "grad_norm", ["grad_norm=0", "no gradient"]),
        ("grad_norm", float("nan"), "grad_norm", ["grad_norm=nan", "not finite"]),
        ("grad_norm", float("inf"), "grad_norm", ["grad_norm=inf", "blow-up"]),
        ("logprob_gap", float("nan"), "logprob_gap", ["logprob_gap=nan"]),
        ("kl", float("nan"), "kl_blowup", ["kl=nan", "not finite"]),
    ],
)
def test_each_finding_names_its_metric_and_value(metric: str, value: float, name: str, words: list[str]) -> None:
    findings = HealthMonitor().check(3, HEALTHY | {metric: value})
    assert len(findings) == 1, findings
    assert findings[0].name == name
    assert str(findings[0]) == findings[0].message and findings[0].message.startswith(metric + "=")
    assert list(findings[0].values) == [metric]
    for w in words:
        assert w in findings[0].message


def test_kl_growth_over_the_last_three_checks() -> None:
    monitor = HealthMonitor(kl_growth=10.0)
    assert monitor.check(0, {"kl": 0.01}) == []
    assert monitor.check(1, {"kl": 0.03}) == []
    assert monitor.check(2, {"kl": 0.06}) == []
    (finding,) = monitor.check(3, {"kl": 0.12})  # 12x the value three checks back, below the limit
    assert "kl=0.12" in finding.message and "since step 0" in finding.message and "blowing up" in finding.message
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


def test_the_names_are_the_configs() -> None:
    assert get_args(FindingName) == FINDINGS
    # the config section's fields are the monitor's keyword arguments
    monitor = HealthMonitor(**HealthConfig(stop_on=["kl_blowup"], patience=2, kl_limit=0.3).model_dump())
    assert monitor.kl_limit == 0.3 and monitor.stop_on == ("kl_blowup",) and monitor.patience["kl_blowup"] == 2


def test_a_stop_on_finding_is_due_after_k_consecutive_checks() -> None:
    monitor = HealthMonitor(stop_on=["ratio_degenerate", "kl_blowup"], patience=3)
    degenerate = HEALTHY | {"ratio_std_after_first": 0.0}
    assert len(monitor.check(1, degenerate)) == 1 and monitor.due() is None
    assert len(monitor.check(2, degenerate)) == 1 and monitor.due() is None
    monitor.check(3, HEALTHY)  # it did not hold: the count starts again
    monitor.check(4, degenerate)
    monitor.check(5, degenerate | {"zero_variance_frac": 1.0})  # not in stop_on: never due
    assert monitor.due() is None
    monitor.check(6, degenerate)
    stop = monitor.due()
    assert stop is not None and stop.name == "ratio_degenerate" and stop.patience == 3
    assert [s for s, _ in stop.held] == [4, 5, 6]
    assert stop.describe() == (
        "ratio_degenerate held for 3 consecutive steps (steps 4-6): "
        "ratio_std_after_first=0 at step 4, 0 at step 5, 0 at step 6"
    )
    monitor.check(7, {})  # an absent metric does not hold either
    assert monitor.due() is None


def test_patience_per_finding_and_bad_names() -> None:
    monitor = HealthMonitor(stop_on=["zero_variance", "kl_blowup"], patience=5, patience_per_finding={"kl_blowup": 1})
    monitor.check(1, {"zero_variance_frac": 1.0})
    assert monitor.due() is None  # zero_variance needs 5
    monitor.check(2, {"zero_variance_frac": 1.0, "kl": 3.0})
    stop = monitor.due()
    assert stop is not None and stop.name == "kl_blowup" and stop.describe().endswith("(step 2): kl=3 at step 2")
    with pytest.raises(ValueError, match=r"unknown health finding 'kl'.*zero_variance, ratio_degenerate"):
        HealthMonitor(stop_on=["kl"])
    with pytest.raises(ValueError, match="patience of grad_norm must be >= 1"):
        HealthMonitor(patience_per_finding={"grad_norm": 0})
