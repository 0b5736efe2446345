"""Suite `e2e` run as a user runs it: `python -m bench --suite e2e --quick` in a fresh process, which
itself starts TRL's GRPOTrainer and `jobs.train` (tiny-random, 2 steps each, on their own embedded
processes; no Ray cluster of the test session is joined)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.local_cluster import ROOT, clean_env

pytest.importorskip("trl", reason="TRL is the baseline: pip install -e '.[bench]'")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_e2e_quick_writes_sensible_figures(tmp_path: Path) -> None:
    env = clean_env({"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")})
    cmd = [sys.executable, "-m", "bench", "--suite", "e2e", "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TRL / mcprl step time" in proc.stdout

    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert (tmp_path / "e2e.png").stat().st_size > 0
    table = (tmp_path / "e2e.md").read_text()
    assert "wall time per step" in table and "TRL 1.16 GRPOTrainer" in table

    rows = {r["figure"]: r for r in doc["rows"]}
    assert set(rows) == {
        "wall time per step",
        "episodes/s end to end",
        "tokens/s end to end",
        "reward after N steps (noisy)",
        "start-up + teardown",
    }
    for row in rows.values():
        for side in (row["ours"], row["baseline"]):
            assert side["n"] == 1 and all(math.isfinite(v) for v in side["values"])
    for name in ("wall time per step", "episodes/s end to end", "tokens/s end to end", "start-up + teardown"):
        assert rows[name]["ours"]["median"] > 0 and rows[name]["baseline"]["median"] > 0
        assert rows[name]["ratio"] > 0
    assert rows["reward after N steps (noisy)"]["ratio"] is None or rows["reward after N steps (noisy)"]["ratio"] > 0

    report = doc["report"]
    assert report["options"]["model"] == "tiny-random" and report["options"]["steps"] == 2
    for side in ("TRL", "mcprl"):
        (run,) = report["runs"][side]
        # Every step played tasks_per_step x group_size episodes, each with a prompt of hundreds of tokens.
        assert [s["episodes"] for s in run["steps"]] == [4 * 2, 4 * 2]
        assert all(s["tokens"] > 8 * 100 for s in run["steps"])
        assert all(-5 <= s["reward"] <= 5 for s in run["steps"])
    # The same prompts on both sides: per-episode tokens within a factor of each other (the episodes differ).
    per_step = report["tokens_per_step"]
    assert 0.25 < per_step["TRL"] / per_step["mcprl"] < 4
    assert "TRL" in " ".join(doc["notes"]) and doc["notes"]
