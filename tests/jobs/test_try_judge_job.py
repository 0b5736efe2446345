"""`python -m jobs.try_judge` as a user runs it, against the OpenAI stand-in in this test process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tasks.openai_standin import OpenAIStandin, messages_of

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
SCORES = {"tool_choice": 1.0, "arguments": 0.5, "progress": 0.5, "safety": 0}
OPENAI_VARS = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_MODEL", "OPENAI_BACKEND")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("try_judge") / "tasks.jsonl"
    subprocess.run(
        [sys.executable, "-m", "jobs.generate_tasks", "--method", "rule", "--n", "2", "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def run_job(args: list[str], env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in OPENAI_VARS}
    return subprocess.run(
        [sys.executable, "-m", "jobs.try_judge", *args],
        cwd=ROOT,
        env={**base, "MCPRL_CACHE": str(tmp / "cache"), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_scores_a_task_row_and_prints_the_breakdown(tasks: Path, tmp_path: Path):
    with OpenAIStandin(responder=lambda body: SCORES) as standin:
        proc = run_job(["--tasks", str(tasks), "--row", "1"], {"OPENAI_BASE_URL": standin.base_url}, tmp_path)
        assert proc.returncode == 0, proc.stderr
        row = json.loads(tasks.read_text().splitlines()[1])
        first = row["reward_spec"]["ground_truth"]["tool_sequence"][0]
        sent = messages_of(standin.requests[0].body)[-1]["content"]
    out = proc.stdout
    assert f"{first['server']}.{first['tool']}" in out and "<tool_call>" in out  # the default action
    assert row["prompt"][-1]["content"] in sent
    for name in SCORES:
        assert name in out
    total = 0.35 * 1.0 + 0.25 * 0.5 + 0.3 * 0.5
    assert re.search(rf"^total\s+{total:.3f}\s+\(range -0.40 .. 0.90\)", out, re.M), out
    assert "tokens: " in out and "requests 1" in out
    assert "Traceback" not in proc.stderr


def test_given_action_and_rubric_override(tasks: Path, tmp_path: Path):
    with OpenAIStandin(responder=lambda body: SCORES) as standin:
        proc = run_job(
            ["--tasks", str(tasks), "--action", "The answer is 42.", "--set", "reward.judge.rubric={progress: 1.0}"],
            {"OPENAI_BASE_URL": standin.base_url},
            tmp_path,
        )
        sent = messages_of(standin.requests[0].body)[-1]["content"]
    assert proc.returncode == 0, proc.stderr
    assert "The answer is 42." in sent
    assert re.search(r"^total\s+0.500\s", proc.stdout, re.M), proc.stdout


def test_judge_failure_and_bad_input_exit_cleanly(tasks: Path, tmp_path: Path):
    with OpenAIStandin(responder=lambda body: {"tool_choice": 3}) as standin:  # outside the schema
        failed = run_job(["--tasks", str(tasks)], {"OPENAI_BASE_URL": standin.base_url}, tmp_path)
    assert failed.returncode == 1 and "infrastructure fault" in failed.stdout

    no_key = run_job(["--tasks", str(tasks)], {"OPENAI_BASE_URL": "https://judge.example.invalid/v1"}, tmp_path)
    assert no_key.returncode == 2 and "OPENAI_API_KEY is not set" in no_key.stderr

    missing = run_job(["--tasks", str(tmp_path / "nope.jsonl")], {}, tmp_path)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    for proc in (failed, no_key, missing):
        assert "Traceback" not in proc.stderr
