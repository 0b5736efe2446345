"""Suite `scale`'s smoke test: run as a user runs it, in a fresh process, at --quick sizes. The suite
includes the control-plane and tool-pool sweeps of bench/cplane.py (its own embedded Ray, the real Serve
tool pool, scripted engine and runner actors): they are checked here too."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.options import BenchOptions
from configs.loader import ConfigError
from tests.bench.suite_run import run_suite


def rows_by_figure(doc: dict) -> dict[str, dict]:
    return {r["figure"].split(" (")[0]: r for r in doc["rows"]}


def finite_values(spread: dict) -> list[float]:
    assert spread["n"] == len(spread["values"]) >= 1
    assert spread["min"] <= spread["median"] <= spread["max"]
    return spread["values"]


@pytest.mark.slow
@pytest.mark.bench
def test_scale_quick_writes_sensible_figures(tmp_path: Path) -> None:
    run_suite(tmp_path, "scale", timeout=900)
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"scale.{ext}").stat().st_size > 0
    doc = json.loads((tmp_path / "scale.json").read_text())

    # Sweep 1: both curves of seconds per step (step, rollout, train) and of episodes/s, at the smoke size's one
    # point (G=2, 1 task a step: one jobs.train process); curves of more points are test_step_figures'.
    curves = {c["title"].split(" (")[0]: c for c in doc["curves"]}
    for axis in ("group size G", "tasks per step"):
        seconds = curves[f"seconds per GRPO step against {axis}"]
        assert set(seconds["series"]) == {"step", "rollout", "train"}
        for name, points in seconds["series"].items():
            assert [x for x, _ in points] == [2 if axis == "group size G" else 1], (axis, name)
            assert all(v > 0 and math.isfinite(v) for _, s in points for v in finite_values(s))
        (step,), (rollout,) = seconds["series"]["step"], seconds["series"]["rollout"]
        assert rollout[1]["median"] < step[1]["median"]  # a phase of a step is shorter than the step
        eps = curves[f"episodes/s against {axis}"]["series"]["episodes/s"]
        assert all(v > 0 and math.isfinite(v) for _, s in eps for v in finite_values(s))
    assert doc["report"]["step_time"]["points"].keys() == {"G=2,tasks=1"}
    assert doc["report"]["step_time"]["points"]["G=2,tasks=1"]["episodes"] == [2.0]

    # Sweep 2: async against lockstep on vLLM, both modes repeated, the same episodes played by each.
    rows = rows_by_figure(doc)
    if "vllm_async_vs_lockstep" in doc["report"]:
        row = rows["episodes/s, async vs lockstep"]
        assert row["baseline_name"] == "lockstep" and row["ours"]["n"] == row["baseline"]["n"] == 2
        assert row["ratio"] > 0 and math.isfinite(row["ratio"])
        v = doc["report"]["vllm_async_vs_lockstep"]
        episodes = {r["episodes"] for rs in v["runs"].values() for r in rs}
        assert episodes == {v["tasks"] * v["group_size"]}
        assert all(r["real_tokens"] > 0 for rs in v["runs"].values() for r in rs)
        assert 1.0 <= v["ideal_ratio"] <= v["ideal_ratio_free_generation"]
    md = (tmp_path / "scale.md").read_text()
    assert "episodes/s" in md and "| figure |" in md
    check_cplane(doc)


def check_cplane(doc: dict) -> None:
    tp = doc["report"]["cplane"]["tool_pool"]
    assert tp["replicas"] == [1, 2]
    for values in tp["calls_per_s"].values():
        assert len(values) == 2 and all(math.isfinite(v) and v > 0 for v in values)

    cp = doc["report"]["cplane"]["control_plane"]
    assert cp["points"] == [1, 10, 50]
    for n, runs in cp["runs"].items():
        assert len(runs) == 2
        for r in runs:
            assert r["episodes"] == (cp["reference_episodes"] if int(n) == 1 else int(n))
            assert r["calls"] >= r["episodes"] and r["turns"] >= 2 * r["episodes"]  # a call and an answer each
            assert math.isfinite(r["episodes_per_s"]) and r["episodes_per_s"] > 0
            # Overhead is wall minus the replica's own time: positive, and below the whole run's wall.
            assert 0 < r["overhead_ms"]["median"] < r["wall_s"] * 1e3
            assert r["generate_ms"]["median"] >= cp["gen_ms"]  # never faster than the stand-in's delay
            assert r["cores_used"]["runner"] > 0 and r["cores_used"]["tool replicas"] > 0
            assert max(r["peak_calls_per_server"].values()) <= int(n)
        if int(n) == 1:
            assert all(max(r["peak_calls_per_server"].values()) == 1 for r in runs)

    figures = {r["figure"] for r in doc["rows"]}
    assert {"per-call overhead, 50 vs 10 in flight", "python tool calls/s, 2 vs 1 replica(s)"} <= figures
    assert [c["log_x"] for c in doc["curves"]][-3:] == [False, True, True]
    assert any(n.startswith("Bend: per-call overhead") for n in doc["notes"])


def test_scale_options_name_the_bad_key() -> None:
    with pytest.raises(ConfigError, match=r"scale\.vllm_tokens"):
        BenchOptions.parse({"suite": "scale"}, ["scale.vllm_tokens=[9,3]"])
    with pytest.raises(ConfigError, match=r"scale\.group_sizes"):
        BenchOptions.parse({"suite": "scale"}, ["scale.group_sizes=[]"])
    quick = BenchOptions.parse({"suite": "scale", "quick": True}).scale.smoke()
    assert quick.group_sizes == [2] and quick.tasks_per_step == [1]


def test_step_figures_read_each_curve_from_its_line_and_compare_its_ends() -> None:
    """Sweep 1's figures over more points than the smoke run has: the G line at the sweep's tasks a step, the
    tasks line at the sweep's G (the point both share measured once), and a row for each line of two points
    or more, its largest point against its smallest."""
    from bench.scale import step_figures

    s = BenchOptions.parse({"suite": "scale"}, ["scale.group_sizes=[2,8,4]", "scale.tasks_per_step=[1,2]"]).scale
    s = s.model_copy(update={"sweep_tasks": 1, "sweep_group": 4})

    def figures(g: int, b: int) -> dict[str, list[float]]:
        step = 0.1 * g * b
        return {"step": [step], "rollout": [step / 2], "train": [step / 4], "episodes_per_s": [g * b / step - g]}

    measured = {p: figures(*p) for p in [(2, 1), (8, 1), (4, 1), (4, 2)]}
    rows, curves = step_figures(s, measured)
    by_title = {c.title.split(" (")[0]: c for c in curves}
    g_curve = by_title["seconds per GRPO step against group size G"].series
    assert [x for x, _ in g_curve["step"]] == [2, 4, 8]  # sorted by x
    assert [sp.median for _, sp in g_curve["rollout"]] == pytest.approx([0.1, 0.2, 0.4])
    b_curve = by_title["episodes/s against tasks per step"].series["episodes/s"]
    assert [(x, sp.median) for x, sp in b_curve] == [(1, pytest.approx(6.0)), (2, pytest.approx(6.0))]
    by_figure = {r.figure.split(" (")[0]: r for r in rows}
    assert set(by_figure) == {"episodes/s, group size G 8 vs 2", "episodes/s, tasks per step 2 vs 1"}
    g_row = by_figure["episodes/s, group size G 8 vs 2"]
    assert g_row.baseline_name == "group size G 2"
    assert g_row.ours.median == pytest.approx(2.0) and g_row.baseline.median == pytest.approx(8.0)
