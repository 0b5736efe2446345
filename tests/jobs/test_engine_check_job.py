"""`python -m jobs.engine_check` end to end, in a subprocess, on the HF backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]


def test_engine_check_hf_generates_with_logprobs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.engine_check", "--set", "rollout.backend=hf", "--set", "model.name=tiny-random"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend:        hf" in proc.stdout
    assert "tokens:         16" in proc.stdout
    assert "logprobs:       yes" in proc.stdout


def test_engine_check_bad_config_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.engine_check", "--set", "rollout.backend=nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "rollout.backend" in proc.stderr
