"""Suite `cplane` run as a user runs it: a fresh `python -m bench --suite cplane --quick` process (its own
embedded Ray, the real Serve tool pool, scripted engine and runner actors), then its files checked."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cplane_quick_writes_sensible_figures(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "bench", "--suite", "cplane", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "cplane.md").read_text().startswith("### Suite `cplane`")
    assert (out / "cplane.png").stat().st_size > 0
    doc = json.loads((out / "cplane.json").read_text())

    tp = doc["report"]["tool_pool"]
    assert tp["replicas"] == [1, 2]
    for values in tp["calls_per_s"].values():
        assert len(values) == 2 and all(math.isfinite(v) and v > 0 for v in values)

    cp = doc["report"]["control_plane"]
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
    for row in doc["rows"]:
        for side in ("ours", "baseline"):
            if row[side]:
                assert all(math.isfinite(v) and v > 0 for v in row[side]["values"])
    assert [c["log_x"] for c in doc["curves"]] == [False, True, True]
    assert any(n.startswith("Bend: per-call overhead") for n in doc["notes"])
