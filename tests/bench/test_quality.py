"""Suite `quality` run as a user runs it: `python -m bench --suite quality --quick` in a fresh process, which
itself writes the tasks, runs mcprl's warm start, trains both sides from it (tiny-random, 2 steps, an adapter
kept after each) and scores every adapter with `jobs.evaluate` on the held-out file. The tiny random model
learns nothing: the figures' presence and consistency are checked. How the figure is read (the first adapter
at the target, "not reached" otherwise) is checked on made-up curves."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.options import E2EOptions, QualityOptions
from bench.quality import result_of, scan
from cluster.local_cluster import ROOT, clean_env
from tests.bench.suite_run import run_suite


def point(step: int, minutes: float, success: float) -> dict[str, Any]:
    return {"step": step, "train_s": 60 * minutes, "adapter": f"a{step}", "success": success, "gain": 0.0, "ci": [0, 0]}


def test_the_figure_is_the_first_adapter_at_the_target_and_says_when_none_is() -> None:
    q = QualityOptions(steps=15, eval_every=5)
    curves = {
        # mcprl passes 0.50 at step 10 (not at 15's higher figure: the first pass counts); TRL never does.
        "mcprl": [point(5, 1.0, 0.45), point(10, 2.0, 0.50), point(15, 3.0, 0.60)],
        "TRL": [point(5, 2.5, 0.40), point(10, 5.0, 0.48), point(15, 7.5, 0.42)],
    }
    steps_s = {"mcprl": [12.0] * 15, "TRL": [30.0] * 15}
    result = result_of(E2EOptions(), q, 0.40, 0.50, curves, steps_s)

    rows = {r.figure: r for r in result.rows}
    first = rows["training minutes to warm start + 10 points"]
    assert first.ours.values == [2.0] and first.baseline is None  # TRL has no minutes to compare
    assert rows["best held-out success"].ours.values == [60.0] and rows["best held-out success"].baseline.values == [
        48.0
    ]
    assert rows["held-out success after step 15"].ours.values == [60.0]
    assert rows["held-out success after step 15"].baseline.values == [42.0]
    assert rows["training time per step"].ratio == pytest.approx(2.5)
    assert result.report["reached"]["mcprl"] == {"step": 10, "train_s": 120.0, "success": 0.50}
    assert result.report["reached"]["TRL"] is None
    notes = " ".join(result.notes)
    assert "mcprl: reached at step 10, 2.0 min of training" in notes
    assert "TRL: not reached in 15 steps (7.5 min of training); best 48.0% at step 10" in notes
    # The chart starts both sides at the warm start, at 0 minutes.
    (curve,) = result.curves
    assert [x for x, _ in curve.series["TRL"]] == [0.0, 2.5, 5.0, 7.5]
    assert curve.series["mcprl"][0][1].values == [40.0]

    # Where mcprl does not reach it either, no minutes are made up for it.
    curves["mcprl"] = [point(5, 1.0, 0.41)]
    result = result_of(E2EOptions(), q, 0.40, 0.50, curves, steps_s)
    assert "training minutes to warm start + 10 points" not in {r.figure for r in result.rows}


def test_scan_scores_every_nth_step_then_finds_the_first_pass_to_the_step() -> None:
    kept = [{"step": i, "train_s": 10.0 * i, "adapter": f"a{i}"} for i in range(1, 13)]
    success = {i: 0.3 for i in range(1, 13)} | {7: 0.5, 8: 0.45, 10: 0.55, 12: 0.2}
    asked: list[int] = []

    def score(a: dict[str, Any]) -> float:
        asked.append(a["step"])
        return success[a["step"]]

    # Every 5th and the last (5, 10, 12); 10 is the first at 0.5, so 6, 7 are scored until 7 passes.
    assert scan(kept, 5, 0.5, score) == [5, 6, 7, 10, 12]
    assert asked == [5, 10, 12, 6, 7]
    # A pass found at once ends the scan; no pass at all needs nothing more.
    asked.clear()
    assert scan(kept[:5], 5, 0.3, score) == [1, 5] and asked == [5, 1]  # 1 passes: the scan stops there
    asked.clear()
    assert scan(kept, 5, 0.9, score) == [5, 10, 12] and asked == [5, 10, 12]


def test_an_ablation_runs_mcprl_alone_and_says_what_it_varied() -> None:
    q = QualityOptions(steps=10, eval_every=5, trl=False, mcprl_sets={"algorithm.outcome_first": None})
    curves = {"mcprl": [point(5, 1.0, 0.45), point(10, 2.0, 0.52)]}
    result = result_of(E2EOptions(), q, 0.40, 0.50, curves, {"mcprl": [12.0] * 10})

    rows = {r.figure: r for r in result.rows}
    assert rows["training minutes to warm start + 10 points"].ours.values == [2.0]
    assert all(r.baseline is None and r.baseline_name == "" and r.goal == "" for r in result.rows)
    assert rows["held-out success after step 10"].ours.values == [52.0]
    assert set(result.report["reached"]) == {"mcprl"} and set(result.curves[0].series) == {"mcprl"}
    notes = " ".join(result.notes)
    assert "mcprl's GRPO run with ['algorithm.outcome_first=null']" in notes and "TRL's side not run" in notes
    assert "TRL:" not in notes


def test_a_bad_key_in_the_ablation_fails_before_anything_runs(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench", "--suite", "quality", "--out", str(tmp_path)]
    cmd += ["--set", "quality.trl=false", "--set", "quality.mcprl_sets={algorithm.outcome_frist: null}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env({}), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "quality.mcprl_sets" in proc.stderr and "algorithm.outcome_frist: unknown key" in proc.stderr
    assert "did you mean algorithm.outcome_first" in proc.stderr
    assert not list(tmp_path.iterdir())  # no warm start, no files


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(900)
def test_quality_quick_trains_both_sides_from_one_warm_start_and_scores_every_adapter(tmp_path: Path) -> None:
    run_suite(tmp_path, "quality", timeout=880)
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"quality.{ext}").stat().st_size > 0
    assert "TRL 1.16 GRPOTrainer" in (tmp_path / "quality.md").read_text()

    doc = json.loads((tmp_path / "quality.json").read_text())
    report = doc["report"]
    assert report["options"]["e2e"]["model"] == "tiny-random"
    assert report["options"]["quality"]["steps"] == 2 and report["options"]["quality"]["held_out_tasks"] == 4
    assert 0 <= report["warm_start_success"] <= 1
    assert report["target"] == pytest.approx(report["warm_start_success"] + 0.10)
    for side in ("TRL", "mcprl"):
        points = report["points"][side]
        assert [p["step"] for p in points] == [1, 2]  # eval_every 1: every step's adapter, each scored
        assert 0 < points[0]["train_s"] < points[1]["train_s"]
        for p in points:
            assert 0 <= p["success"] <= 1 and p["ci"][0] <= p["gain"] <= p["ci"][1]
            assert p["gain"] == pytest.approx(p["success"] - report["warm_start_success"])  # the same 4 tasks
        reached = report["reached"][side]
        assert reached is None or reached["step"] in (1, 2)
        assert report["trained_minutes"][side] == pytest.approx(points[-1]["train_s"] / 60)
    rows = {r["figure"]: r for r in doc["rows"]}
    per_step = rows["training time per step"]
    assert per_step["ours"]["n"] == 2 and per_step["baseline"]["n"] == 2
    assert all(math.isfinite(v) and v > 0 for v in per_step["ours"]["values"] + per_step["baseline"]["values"])


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(600)
def test_an_ablation_from_the_command_line_trains_mcprl_alone_with_its_sets(tmp_path: Path) -> None:
    sets = ["--set", "quality.trl=false", "--set", "quality.mcprl_sets={algorithm.outcome_first: null}"]
    proc = run_suite(tmp_path, "quality", *sets, timeout=580)
    assert "TRL:" not in proc.stdout  # TRL's side never started

    doc = json.loads((tmp_path / "quality.json").read_text())
    report = doc["report"]
    assert set(report["points"]) == {"mcprl"} and [p["step"] for p in report["points"]["mcprl"]] == [1, 2]
    assert report["options"]["quality"]["mcprl_sets"] == {"algorithm.outcome_first": None}
    assert all(r["baseline"] is None for r in doc["rows"])
    assert "mcprl's GRPO run with ['algorithm.outcome_first=null']" in " ".join(doc["notes"])
