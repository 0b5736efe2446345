"""Suite `chaos`: its smoke run as a user runs it (a fresh process, --quick: one seed, every fault once), and its
schedule and counting in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.chaos import FAULTS, WINDOW, count_episodes, schedule
from bench.options import BenchOptions
from configs.loader import ConfigError
from tests.bench.suite_run import run_suite


@pytest.mark.slow
def test_chaos_quick_run_meets_every_fault_finishes_and_ends_where_the_unbroken_run_ends(tmp_path: Path) -> None:
    proc = run_suite(tmp_path, "chaos", timeout=900)
    doc = json.loads((tmp_path / "chaos.json").read_text())
    report = doc["report"]
    s = report["summary"]
    assert s["runs"] == s["finished"] == 1 and s["failed"] == 0, report["runs"]
    assert s["episodes_lost"] == 0 and s["episodes_duplicated"] == 0
    assert s["adapters_equal"] == 1, report["runs"]  # exact resume: the faults change nothing the run learns
    (run,) = report["runs"]
    assert set(run["struck"]) | set(run["not_struck"]) == set(FAULTS) == set(run["faults"])
    assert ("stop" in run["resumes"]) == ("stop" in run["struck"])
    unbroken = report["unbroken"]
    assert unbroken["struck"] == {} and unbroken["resumes"] == [] and unbroken["lost"] == unbroken["duplicated"] == 0
    up, wall = unbroken["services_up_s"], unbroken["wall_s"]
    assert 0 < up < wall and all(0 <= at <= WINDOW[1] * (wall - up) for at in run["faults"].values())
    assert all(run["services_up_s"] + run["faults"][k] <= at + 0.02 for k, at in run["struck"].items())  # not early
    assert "runs finished" in proc.stdout and (tmp_path / "chaos.md").stat().st_size > 0


def test_the_schedule_is_the_seeds_and_falls_in_the_training() -> None:
    a, b = schedule(3, 60.0), schedule(3, 60.0)
    assert a == b and set(a) == set(FAULTS)
    assert all(WINDOW[0] * 60 <= at <= WINDOW[1] * 60 for at in a.values())
    assert schedule(4, 60.0) != a


def test_episodes_lost_and_duplicated_are_counted_per_step(tmp_path: Path) -> None:
    rows = [
        {"step": 1, "rollout/episodes": 4.0},
        {"step": 1, "train/policy_loss": 0.1},  # a step's other rows do not count
        {"step": 2, "rollout/episodes": 3.0},  # one lost
        {"step": 3, "rollout/episodes": 4.0},
        {"step": 3, "rollout/episodes": 4.0},  # step 3 logged twice: 4 duplicated
        {"step": 5, "rollout/episodes": 4.0},  # beyond the run's steps: duplicated; step 4 missing: lost
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert count_episodes(tmp_path, steps=4, per_step=4) == {"lost": 5, "duplicated": 8, "steps_logged": 5}


def test_chaos_options_name_the_bad_key() -> None:
    with pytest.raises(ConfigError, match=r"chaos\.seeds"):
        BenchOptions.parse({"suite": "chaos"}, ["chaos.seeds=[1,1]"])
    with pytest.raises(ConfigError, match=r"chaos\.steps"):
        BenchOptions.parse({"suite": "chaos"}, ["chaos.steps=1"])
    quick = BenchOptions.parse({"suite": "chaos", "quick": True}, ["chaos.steps=4"]).chaos.smoke()
    assert quick.seeds == [0] and quick.steps == 4  # --quick keeps what --set chose
