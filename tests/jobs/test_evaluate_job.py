"""`python -m jobs.evaluate` as a user runs it: what it says about bad input, before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def evaluate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jobs.evaluate", "--config", "configs/ci-tiny.yaml", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "nowhere/tasks.jsonl"], "nowhere/tasks.jsonl"),
        (["--tasks", "s3://bucket/tasks.jsonl"], "--tasks s3://bucket/tasks.jsonl: a URI"),
        (["--tasks", "tasks/examples/conversations.jsonl", "--out", "gs://b/r.json"], "--out gs://b/r.json: a URI"),
        (
            ["--tasks", "tasks/examples/conversations.jsonl", "--adapter", "runs/nowhere"],
            "runs/nowhere: no such folder",
        ),
        (["--tasks", "tasks/examples/conversations.jsonl", "--adapter", "tasks"], "tasks: not a PEFT adapter folder"),
    ],
    ids=["missing", "tasks-uri", "out-uri", "no-adapter", "not-an-adapter"],
)
def test_bad_files_exit_2_naming_the_argument(args: list[str], message: str) -> None:
    proc = evaluate(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_run_writes_each_tasks_calls_and_conversation(tmp_path: Path) -> None:
    """A fresh `python -m jobs.evaluate` on the tiny model: the figures, and per task where it failed (its
    calls as the env saw them, the conversation after the prompt), in the file --out names."""
    tasks, out = tmp_path / "tasks.train.jsonl", tmp_path / "eval.json"  # the config splits the rows
    gen = [sys.executable, "-m", "jobs.generate_tasks", "--config", "configs/ci-tiny.yaml", "--method", "rule"]
    gen += ["--n", "4", "--seed", "1", "--out", str(tmp_path / "tasks.jsonl")]
    proc = subprocess.run(gen, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = evaluate(
        "--tasks",
        str(tasks),
        "--limit",
        "2",
        "--out",
        str(out),
        "--set",
        "rollout.sampling.max_new_tokens=8",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tasks"] == 2 and result["episodes"] == 2
    rows = [json.loads(line) for line in tasks.read_text().splitlines()][:2]
    assert sorted(t["task_id"] for t in result["per_task"]) == sorted(
        r["reward_spec"]["ground_truth"]["task_id"] for r in rows
    )
    by_id = {r["reward_spec"]["ground_truth"]["task_id"]: r["reward_spec"]["ground_truth"] for r in rows}
    for task in result["per_task"]:
        assert isinstance(task["calls"], list)
        gt = by_id[task["task_id"]]  # what the task expects, beside what the model did
        assert task["expected_calls"] == [f"{s['server']}.{s['tool']}" for s in gt["tool_sequence"]]
        assert task["expected_answer"] == gt["final_answer"]["value"]
        assert isinstance(task["calls_right"], bool) and isinstance(task["success"], bool)
        conversation = task["conversation"]
        assert conversation and conversation[0]["role"] == "assistant", conversation  # the prompt is left out
        assert len([m for m in conversation if m["role"] == "assistant"]) == task["turns"]
