"""Suite `learning` run as a user runs it: `python -m bench --suite learning --quick` in a fresh process, which
itself runs jobs.train twice on configs/ci-tiny.yaml (seed 0; one GRPO step, 2 evaluation tasks): the recipe
(warm start, then GRPO) and the warm start alone, longer by GRPO's wall time. The tiny random model learns
nothing: only the figures' presence and consistency are checked, and that the second run trained more SFT steps
and no GRPO step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.bench.suite_run import run_suite


def records(run_dir: str) -> list[dict[str, Any]]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(900)
def test_learning_quick_compares_grpo_with_sft_for_the_same_time(tmp_path: Path) -> None:
    run_suite(tmp_path, "learning", timeout=880)
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"learning.{ext}").stat().st_size > 0
    table = (tmp_path / "learning.md").read_text()
    assert "validation: GRPO − warm start" in table and "Held-out set `validation`" in table

    report = json.loads((tmp_path / "learning.json").read_text())["report"]
    assert report["options"]["config"] == "configs/ci-tiny.yaml" and report["options"]["seeds"] == [0]
    assert report["options"]["sets"] == {"train.steps": 1, "train.eval_tasks": 2}  # --quick's, in both runs
    (seed,) = report["seeds"]
    grpo, more = seed["runs"]["grpo"], seed["runs"]["sft_more"]

    # Both runs' stage figures: the recipe's warm start and final stage, the SFT-only run's longer warm start.
    for run, stages in ((grpo, ("base", "after warm start", "after GRPO")), (more, ("base", "after warm start"))):
        figures = run["stages"]["validation"]
        assert set(stages) <= set(figures)
        assert all(0 <= figures[s]["success_rate"] <= 1 and figures[s]["tasks"] > 0 for s in stages)
    assert "after GRPO" not in more["stages"]["validation"]

    (set_name,) = seed["sets"]  # ci-tiny has no transfer set: validation alone
    figures = seed["sets"][set_name]
    assert set_name == "validation" and figures["tasks"] == 2  # train.eval_tasks
    assert all(0 <= figures[k] <= 1 for k in ("warm_start", "after_grpo", "sft_more"))
    for key in ("grpo_vs_warm", "sft_more_vs_warm", "grpo_vs_sft_more"):
        g = figures[key]
        assert 0 < g["n"] <= figures["tasks"] and g["ci_low"] <= g["gain"] <= g["ci_high"]
        assert g["gain"] == pytest.approx(g["rate_after"] - g["rate_before"])
    assert figures["grpo_vs_warm"]["rate_after"] == pytest.approx(figures["after_grpo"])
    assert seed["goals"]["transfer_kept"] is None and isinstance(seed["goals"]["validation_gain"], bool)
    assert report["goals_met"]["transfer_kept"] == {"met": 0, "of": 0}

    # The SFT-only run: the recipe's SFT steps plus the extra ones GRPO's time bought, and no GRPO step.
    g_rec, m_rec = records(grpo["run_dir"]), records(more["run_dir"])
    g_sft, m_sft = (sum("sft/step" in r for r in rs) for rs in (g_rec, m_rec))
    assert g_sft == grpo["sft_steps"] >= 1 and grpo["grpo_steps"] == 1  # train.steps
    assert m_sft == more["sft_steps"] == g_sft + seed["extra_sft_steps"] > g_sft
    assert not any("timing/step_s" in r for r in m_rec) and more["grpo_steps"] == 0
    assert grpo["grpo_s"] > 0 and seed["extra_sft_steps"] >= 1

    # Run again, as a user finishing the seeds one invocation at a time: the finished seed is read back, not rerun.
    before = (Path(grpo["run_dir"]) / "metrics.jsonl").stat().st_mtime_ns
    again = run_suite(tmp_path, "learning", timeout=300)
    assert "seed 0: finished " in again.stdout and "read from" in again.stdout, again.stdout[-3000:]
    assert (Path(grpo["run_dir"]) / "metrics.jsonl").stat().st_mtime_ns == before
    (reread,) = json.loads((tmp_path / "learning.json").read_text())["report"]["seeds"]
    assert reread["sets"] == seed["sets"] and reread["finished"] == seed["finished"]


def test_the_work_folder_is_kept_for_the_same_recipe_only(tmp_path: Path) -> None:
    """bench.learning.open_work: a seed's result survives a rerun of its recipe, and only of its recipe."""
    from bench.learning import open_work
    from bench.options import LearningOptions

    work = tmp_path / "learning-work"
    recipe = LearningOptions(config="configs/ci-tiny.yaml", seeds=[0], sets={"train.steps": 1})
    open_work(recipe, work)
    (work / "seed-0.json").write_text("{}")
    open_work(recipe, work)
    assert (work / "seed-0.json").is_file()
    open_work(recipe.model_copy(update={"reuse": False}), work)
    assert not (work / "seed-0.json").exists()
    (work / "seed-0.json").write_text("{}")
    open_work(recipe.model_copy(update={"sets": {"train.steps": 2}}), work)
    assert not (work / "seed-0.json").exists()
    assert json.loads((work / "recipe.json").read_text())["sets"] == {"train.steps": 2}
