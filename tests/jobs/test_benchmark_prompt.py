"""`python -m jobs.benchmark --suite prompt`, as a user runs it: a fresh process, a config file, a report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_prompt_suite_reports_compact_shorter_than_json(tmp_path: Path) -> None:
    out = tmp_path / "prompt.json"
    cmd = [sys.executable, "-m", "jobs.benchmark", "--suite", "prompt", "--config", "configs/ci-tiny.yaml"]
    done = subprocess.run(
        [*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["tasks"] > 0 and report["tool_prompt"] == "system"
    for fmt in ("json", "compact"):
        assert 0 < report[fmt]["min"] <= report[fmt]["mean"] <= report[fmt]["max"]
    assert report["compact"]["mean"] < report["json"]["mean"]
    assert report["compact_vs_json_mean"] == report["compact"]["mean"] / report["json"]["mean"]
    assert "compact / json" in done.stdout
