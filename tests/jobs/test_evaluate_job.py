"""`python -m jobs.evaluate` as a user runs it: what it says about bad input, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def evaluate(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jobs.evaluate", "--config", "configs/ci-tiny.yaml", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "nowhere/tasks.jsonl"], "nowhere/tasks.jsonl"),
        (["--tasks", "s3://bucket/tasks.jsonl"], "--tasks s3://bucket/tasks.jsonl: a URI"),
        (["--tasks", "tasks/examples/conversations.jsonl", "--out", "gs://b/r.json"], "--out gs://b/r.json: a URI"),
    ],
    ids=["missing", "tasks-uri", "out-uri"],
)
def test_bad_files_exit_2_naming_the_argument(args: list[str], message: str) -> None:
    proc = evaluate(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
