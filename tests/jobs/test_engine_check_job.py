"""`python -m jobs.engine_check` end to end, in a subprocess, on the HF backend."""

from __future__ import annotations

import importlib.util
import re
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


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_engine_check_vllm_prints_ours_and_none_of_vllms_start_up_notices() -> None:
    """vLLM's engine core and worker run none of our code: the logging config the engine hands them
    (cluster.console.vllm_logging_config) keeps their notices and INFO lines off the console."""
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "jobs.engine_check", "--set", "rollout.backend=vllm"),
            *("--set", "model.name=tiny-random", "--set", "rollout.max_model_len=512"),
            *("--set", "rollout.vllm_kv_cache_gb=1"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    assert "backend:        vllm" in proc.stdout and "logprobs:       yes" in proc.stdout
    for notice in (
        "Model Runner V2 requires Triton",
        "Enforce eager set",
        "Inductor compilation was disabled",
        "Triton is not installed",
        "Reset SSM cache type",
        "not found in LD_PRELOAD",
        "torch.distributed.reduce_op",
    ):
        assert notice not in console, notice
    assert not re.search(r"pid=\d+\) INFO ", console), "vLLM's INFO lines (engine_log_level is WARNING)"
