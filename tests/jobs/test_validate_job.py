"""`python -m jobs.validate_tasks` as a user runs it: exit codes, messages, and never a traceback."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks.io import read_rows, write_rows

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "tasks" / "fixtures" / "gate_rows.jsonl"  # the gate's, shared with tests/tasks


@dataclass
class Run:
    rc: int
    out: str  # stdout and stderr together


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every invocation at once, in parallel: each pays for the Python and transformers start-up."""
    tmp = tmp_path_factory.mktemp("validate_job")
    rows = read_rows(FIXTURE)
    write_rows([rows[0], rows[22]], tmp / "good.parquet")
    (tmp / "broken.jsonl").write_text('{"data_source": "x"}\n{"data_source": \n')
    (tmp / "notes.csv").write_text("a,b\n")
    invocations = {
        "good": ["--in", str(tmp / "good.parquet")],
        "live": ["--in", str(tmp / "good.parquet"), "--set", "tools.servers.slack.backend=live"],
        "fixture": ["--in", str(FIXTURE)],
        "strict": ["--in", str(tmp / "good.parquet"), "--strict", "--max-tokens", "50"],
        "missing": ["--in", str(tmp / "missing.jsonl")],
        "broken": ["--in", str(tmp / "broken.jsonl")],
        "suffix": ["--in", str(tmp / "notes.csv")],
        "config": ["--in", str(FIXTURE), "--set", "tools.servers.polygon.bakend=live"],
        "model": ["--in", str(FIXTURE), "--model", "no-such-model-here"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "jobs.validate_tasks", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, args in invocations.items()
    }
    results = {}
    for name, proc in procs.items():
        out, _ = proc.communicate()
        results[name] = Run(proc.returncode, out)
    return results


def test_good_rows_pass(runs: dict[str, Run]) -> None:
    run = runs["good"]
    assert run.rc == 0, run.out
    assert "Validation passed" in run.out
    assert "valid rows: 2 of 2" in run.out
    assert "complexity: medium 1, simple 1" in run.out
    assert "prompt tokens (tiny-random, with tools): mean" in run.out
    assert "tool calls: fmp.key_ratios 1, polygon.previous_close 1, slack.post_message 1" in run.out
    assert "tools no task uses: fmp.company_profile" in run.out


def test_a_plan_writing_to_a_live_service_is_warned_about(runs: dict[str, Run]) -> None:
    run = runs["live"]
    assert run.rc == 0, run.out
    assert "1 warning:" in run.out and "Validation passed with 1 warning\n" in run.out
    assert (
        "row 1 (gate-good-1): reward_spec.ground_truth.tool_sequence[1]: "
        "slack.post_message writes to the live slack service" in run.out
    )
    assert "warning:" not in runs["good"].out  # the offline Slack is isolated: no warning


def test_fixture_fails_with_row_numbers_and_paths(runs: dict[str, Run]) -> None:
    run = runs["fixture"]
    assert run.rc == 1, run.out
    assert "Validation passed" not in run.out
    assert "Validation failed: 22 errors in 20 of 23 rows" in run.out
    assert "row 6 (gate-unknown-server): reward_spec.ground_truth.tool_sequence[0].server: unknown server" in run.out
    assert "row 8 (gate-bad-params): reward_spec.ground_truth.tool_sequence[1].params.limit: " in run.out
    assert "row 22 (gate-near-dup): prompt: near-duplicate of row 1" in run.out
    assert "1 warning:" in run.out


def test_strict_turns_long_prompts_into_errors(runs: dict[str, Run]) -> None:
    run = runs["strict"]
    assert run.rc == 1, run.out
    assert "the limit is 50" in run.out
    assert "Validation failed: 2 errors in 2 of 2 rows" in run.out


@pytest.mark.parametrize(
    ("name", "rc", "message"),
    [
        ("missing", 2, "missing.jsonl: no such file"),
        ("suffix", 2, "unknown task file type '.csv'"),
        ("config", 2, "tools.servers.polygon.bakend: unknown key"),
        ("model", 2, "model 'no-such-model-here' is not in the HF cache of node"),
        ("broken", 1, "broken.jsonl: line 2, column"),
    ],
)
def test_usage_and_file_errors(runs: dict[str, Run], name: str, rc: int, message: str) -> None:
    run = runs[name]
    assert run.rc == rc, run.out
    assert message in run.out


def test_no_tracebacks(runs: dict[str, Run]) -> None:
    for name, run in runs.items():
        assert "Traceback" not in run.out, f"{name}:\n{run.out}"
