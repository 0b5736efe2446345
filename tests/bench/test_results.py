"""bench/results.py: which rows the chart draws (the table keeps them all)."""

from __future__ import annotations

from pathlib import Path

from bench.results import Row, SuiteResult, chart, markdown, spread


def test_a_row_without_a_ratio_is_not_drawn(tmp_path: Path) -> None:
    # A reward of −0.4 against −0.2: divided by the baseline, the worse side would draw a bar twice as tall.
    reward = Row("reward", "mean", spread([-0.4, -0.4]), spread([-0.2, -0.2]), "TRL", "higher")
    assert reward.ratio is None
    assert not chart(SuiteResult("x", {}, [reward]), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    assert "-0.4" in markdown(SuiteResult("x", {}, [reward]), "2026-11-26", "here")

    step = Row("wall time per step", "s", spread([24.0, 23.0]), spread([30.0, 31.0]), "TRL", "lower")
    assert step.ratio is not None and step.ratio > 1
    assert chart(SuiteResult("x", {}, [reward, step]), tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0
