"""`python -m jobs.env_check` as a user runs it, on a freshly generated task file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tasks") / "rule.jsonl"
    proc = run("-m", "jobs.generate_tasks", "--method", "rule", "--n", "5", "--seed", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def test_default_action(tasks):
    proc = run("-m", "jobs.env_check", "--tasks", str(tasks))
    assert proc.returncode == 0, proc.stderr
    assert "reward: " in proc.stdout and "done: False" in proc.stdout
    assert "observation 0: keys ['content', 'role']; role tool" in proc.stdout
    assert "reward components: " in proc.stdout and "Traceback" not in proc.stderr


def test_given_action_and_overrides(tasks):
    proc = run(
        "-m", "jobs.env_check", "--tasks", str(tasks), "--row", "1",
        "--action", "<answer>nothing</answer>", "--set", "env.observation_role=user",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "reward: -0.500" in proc.stdout and "done: True (answer)" in proc.stdout  # a guess
    assert "observations: none" in proc.stdout


def test_usage_errors(tasks, tmp_path):
    proc = run("-m", "jobs.env_check", "--tasks", str(tasks), "--row", "99")
    assert proc.returncode == 2 and "no row 99" in proc.stderr
    proc = run("-m", "jobs.env_check", "--tasks", str(tmp_path / "nope.jsonl"))
    assert proc.returncode == 2 and "no such file" in proc.stderr
