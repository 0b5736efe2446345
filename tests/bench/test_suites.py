"""`python -m bench`, as a user runs it: a fresh process per suite at `--quick` sizes, then the files it
wrote (JSON, markdown table, chart) and the figures in them. Sizes are smoke sizes: no figure's value is
judged, only that it is there, finite and consistent with the rest."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster.local_cluster import ROOT
from tests.bench.suite_run import run_suite

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it


def bench(tmp_path: Path, suite: str, *args: str, timeout: int = 600) -> tuple[dict[str, Any], str]:
    """Run one suite in a fresh process; its JSON document and its stdout."""
    done = run_suite(tmp_path, suite, *args, timeout=timeout)
    doc = json.loads((tmp_path / f"{suite}.json").read_text())
    table = (tmp_path / f"{suite}.md").read_text()
    assert doc["suite"] == suite and doc["report"]["machine"]["cores"] >= 1 and doc["report"]["wall_s"] > 0
    for row in doc["rows"]:
        assert row["figure"] in table
        sides = [row["ours"], *([row["baseline"]] if row["baseline"] else [])]
        for side in sides:
            assert side["n"] == len(side["values"]) >= 1
            assert all(math.isfinite(v) for v in side["values"])
            assert side["min"] <= side["median"] <= side["max"]
        if row["baseline"]:
            b, o = row["baseline"]["median"], row["ours"]["median"]
            if b > 0 and o > 0:
                assert row["ratio"] == pytest.approx(b / o if row["better"] == "lower" else o / b)
    if any(row["baseline"] for row in doc["rows"]) or doc["curves"]:
        assert (tmp_path / f"{suite}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return doc, done.stdout


def rows_by_figure(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["figure"]: row for row in doc["rows"]}


def test_bad_options_are_usage_errors_naming_the_key(tmp_path: Path) -> None:
    for args, said in (
        (["--suite", "nope"], "suite: Input should be 'tools'"),
        (["--set", "e2e.steps=0"], "e2e.steps: Input should be greater than or equal to 2 (got 0)"),
        (["--set", "train.pushez=3"], "train.pushez: unknown key"),
        (["--config", "configs/none.yaml"], "config file not found: configs/none.yaml"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "bench", "--out", str(tmp_path), *args], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_env_suite(tmp_path: Path) -> None:
    doc, out = bench(tmp_path, "env", "--repeats", "2")
    r = doc["report"]
    assert len(r["tool_alone_ms"]) == len(r["env_astep_ms"]) == 2
    overhead = rows_by_figure(doc)["env overhead per step (astep − tool alone)"]
    assert overhead["ours"]["values"] == [e - t for e, t in zip(r["env_astep_ms"], r["tool_alone_ms"], strict=True)]
    assert "goal: < 0.2 ms" in out


def test_prompt_suite_compact_is_shorter_than_json(tmp_path: Path) -> None:
    doc, out = bench(tmp_path, "prompt", "--config", "configs/ci-tiny.yaml")
    r = doc["report"]
    assert r["tasks"] > 0 and r["tool_prompt"] == "system"
    for fmt in ("json", "compact"):
        assert 0 < r[fmt]["min"] <= r[fmt]["mean"] <= r[fmt]["max"]
    (row,) = doc["rows"]
    assert row["ours"]["median"] == r["compact"]["mean"] < row["baseline"]["median"] == r["json"]["mean"]
    assert row["ratio"] > 1 and "compact / json" in out


@pytest.mark.bench
def test_tools_suite(tmp_path: Path) -> None:
    doc, _ = bench(tmp_path, "tools", "--repeats", "1")
    r = doc["report"]
    assert set(r["doors"]) == {"in-process FastMCP client", "Serve handle", "MCP over HTTP (Serve proxy)"}
    assert all(d[0]["calls_per_s"] > 0 and d[0]["p50_ms"] <= d[0]["p99_ms"] for d in r["doors"].values())
    assert {k: len(v) for k, v in r["python_calls_per_s"].items()} == {"1": 1, "2": 1}
    assert len(doc["rows"]) == 4 and all(row["baseline"] for row in doc["rows"])


def test_rollout_suite(tmp_path: Path) -> None:
    doc, _ = bench(tmp_path, "rollout", "--repeats", "2")
    r = doc["report"]
    assert r["engines"]["model"] == "tiny-random" and "vllm" not in r["engines"]  # --quick: HF only
    assert len(r["engines"]["hf"]["tokens_per_s"]) == 2 and "push_modes" not in r
    assert set(r["modes"]) == {"scripted, all at once", "scripted, 16 in flight", "hf-tiny, 16 in flight"}
    assert r["modes"]["scripted, all at once"]["tasks"] == r["tasks"] > r["modes"]["hf-tiny, 16 in flight"]["tasks"]
    for m in r["modes"].values():
        assert len(m["ratio"]) == 2
        assert m["async"]["episodes"] == m["lockstep"]["episodes"] == [m["tasks"] * r["group_size"]] * 2
    episodes = [row for row in doc["rows"] if row["figure"].startswith("episodes/s")]
    assert len(episodes) == 3 and all(row["baseline_name"].startswith("lockstep") for row in episodes)


@pytest.mark.bench
def test_job_suite(tmp_path: Path) -> None:
    """A loopback cluster (`ray start`, its own session folder), then ci-tiny once locally and once through
    `ray job submit` (one step each): both runs' figures, and the submitted/local ratios from them."""
    doc, out = bench(tmp_path, "job")
    r = doc["report"]
    assert r["cluster_start_s"] > 0 and r["repeats"] == 1
    for kind in ("local", "submitted"):
        (run,) = r["runs"][kind]
        assert run["steps"] == 1 and 0 < run["steps_s"] < run["wall_s"]
        assert run["rest_s"] == pytest.approx(run["wall_s"] - run["steps_s"])
    for key, ratio in r["ratio"].items():
        assert ratio == pytest.approx(r["runs"]["submitted"][0][key] / r["runs"]["local"][0][key])
    assert len(doc["rows"]) == 3 and "submitted / local" in out


def test_gpu_suite_runs_without_ray_or_vllm(tmp_path: Path) -> None:
    """Suite gpu is for a GPU box that has neither Ray nor vLLM: here both imports fail, as they would
    there, and the suite runs its CPU fallback (the tiny shape) end to end."""
    blocked = (
        "import sys, runpy; sys.modules.update(ray=None, vllm=None); runpy.run_module('bench', run_name='__main__')"
    )
    cmd = [sys.executable, "-c", blocked, "--suite", "gpu", "--quick", "--repeats", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert doc["report"]["accelerator"]["device"] == "cpu" and "suite gpu on CPU" in done.stdout
    (shape,) = doc["report"]["shapes"]
    assert shape["shape"] == "tiny" and shape["params"] > 0
    rows = rows_by_figure(doc)
    learner = rows["tiny: learner tokens/s, LoRA"]
    assert learner["baseline_name"] == "LM head at every position, each episode whole" and learner["ratio"] > 0
    once = rows["tiny: learner tokens/s, a group's prompt once"]
    assert once["baseline_name"] == "each episode whole" and once["ours"] == learner["ours"]
    assert set(shape["learner"]) == {"ours", "unshared", "pad_mask", "full_logits"}
    causal = rows["tiny: learner tokens/s, episodes whole without the padding mask"]
    assert causal["baseline_name"] == "the padding mask passed to attention" and causal["ratio"] > 0
    engine = shape["engine"]["runs"][0]
    assert engine["generated"] == 4 * 8  # --quick: 4 requests x 8 new tokens, stop strings off
    for figure in (
        "tiny: HF engine generated tokens/s",
        "tiny: LoRA export + load",
        "tiny: full weights export + load",
    ):
        assert rows[figure]["ours"]["median"] > 0
    assert shape["adapter_sync"]["bytes"] > 0
