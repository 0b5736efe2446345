"""`python -m jobs.evaluate` as a user runs it: bad input named before anything starts, a finished evaluation's report
and Ctrl-C while it plays."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from tests.conftest import ctrl_c_after

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]


def evaluate(*args: str, timeout: float = 120, terminal: bool = False) -> subprocess.CompletedProcess:
    """`python -m jobs.evaluate --config configs/ci-tiny.yaml ARGS`; `terminal`: its stderr is a pseudo-terminal,
    as in a user's shell (what it shows there, \\r-redrawn lines included, comes back as stderr)."""
    cmd = [sys.executable, "-m", "jobs.evaluate", "--config", "configs/ci-tiny.yaml", *args]
    if not terminal:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    main, tty = pty.openpty()
    fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal's size (tqdm fits it)
    shown: list[bytes] = []

    def drain() -> None:  # the terminal's side: read until the process closes it
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:
                return
            if not data:
                return
            shown.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=tty, text=True, timeout=timeout)
    finally:
        os.close(tty)
        reader.join(timeout=10)
        os.close(main)
    return subprocess.CompletedProcess(cmd, proc.returncode, proc.stdout, b"".join(shown).decode(errors="replace"))


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


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four rule tasks on ci-tiny's tools, as `python -m jobs.generate_tasks` writes them (its train split)."""
    folder = tmp_path_factory.mktemp("tasks")
    gen = [sys.executable, "-m", "jobs.generate_tasks", "--config", "configs/ci-tiny.yaml", "--method", "rule"]
    gen += ["--n", "4", "--seed", "1", "--out", str(folder / "tasks.jsonl")]
    proc = subprocess.run(gen, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folder / "tasks.train.jsonl"  # the config splits the rows


def check_the_report(proc: subprocess.CompletedProcess, out: Path, tasks: Path) -> None:
    """What a finished `python -m jobs.evaluate --limit 2` shows: the figures, and per task where it failed (its
    calls as the env saw them, the conversation after the prompt), in the file --out names."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"evaluate: 100%.*2/2", proc.stderr), proc.stderr[-3000:]  # the progress bar, finished
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
    # The per-template table, in the console and the JSON (from the same per_task entries).
    templates = {t["template"] for t in result["per_task"]}
    assert "| template | complexity | tasks | answer right | calls right |" in proc.stdout, proc.stdout
    assert {r["template"] for r in result["per_template"]} == templates
    for r in result["per_template"]:
        mine = [t for t in result["per_task"] if t["template"] == r["template"]]
        assert r["tasks"] == len(mine) and r["success"] == sum(t["success"] for t in mine)
        assert r["calls_right"] == sum(t["calls_right"] for t in mine)
        assert f"| {r['template']} |" in proc.stdout
    # The worst failures: expected beside done, lowest reward first, in the console and the JSON.
    failed = sorted(
        (t for t in result["per_task"] if not t["success"] and not t["infra_fault"]), key=lambda t: t["reward"]
    )
    worst = result["worst_failures"]
    assert [w["task_id"] for w in worst] == [t["task_id"] for t in failed][:3]
    assert failed, "8 new tokens of tiny-random solve nothing: the failures part must show"
    for w in worst:
        task = next(t for t in result["per_task"] if t["task_id"] == w["task_id"])
        assert w["expected_calls"] == task["expected_calls"] and w["expected_answer"] == task["expected_answer"]
        assert [c["name"] for c in w["calls"]] == [c["name"] for c in task["calls"]]
        assert f"  {w['task_id']} [" in proc.stdout
        assert f"    expected: {', '.join(w['expected_calls'])}; answer {w['expected_answer']!r}" in proc.stdout
    assert "worst failures (" in proc.stdout


def test_an_adapter_on_a_cpu_vllm_engine_is_merged_and_the_report_shows_each_task(tmp_path: Path, tasks: Path) -> None:
    """The CPU engine's fast path: with --adapter, a vLLM engine on CPU gets the adapter merged into its weights
    (rollout.weight_push auto) and plays the tasks; the report is `check_the_report`'s (the default HF engine's
    evaluation runs in every training run's tests). That merged weights generate as the adapter does is
    tests/actors/test_vllm_merged_push.py's, on an engine in-process."""
    from actors.adapter_io import write_adapter
    from tests.actors.test_engine_conformance import make_adapter

    adapter = tmp_path / "adapter"
    write_adapter(adapter, make_adapter(0))  # random non-zero B: the adapter changes what the model writes
    out = tmp_path / "eval.json"
    proc = evaluate(
        *("--tasks", str(tasks), "--limit", "2", "--adapter", str(adapter), "--out", str(out)),
        *("--set", "rollout.backend=vllm", "--set", "rollout.vllm_kv_cache_gb=1"),
        *("--set", "rollout.max_model_len=2048", "--set", "rollout.sampling.max_new_tokens=8"),
        timeout=400,
        terminal=True,
    )
    check_the_report(proc, out, tasks)
    assert "adapter merged into the base weights on the engines" in proc.stdout, proc.stdout


def test_ctrl_c_while_it_plays_ends_it_in_one_line(tmp_path: Path, tasks: Path) -> None:
    """SIGINT (a terminal's Ctrl-C) once the engines play: exit 130, one line, no traceback, nothing written."""
    # Long enough to be interrupted on any machine: the fixture's tasks 20 times over (under new ids), one episode at a
    # time, each turn up to 1,024 tokens (3 tasks done in under a second once, before the signal came).
    many = tmp_path / "many.jsonl"
    with many.open("w") as f:
        for k in range(20):
            for line in tasks.read_text().splitlines():
                row = json.loads(line)
                row["reward_spec"]["ground_truth"]["task_id"] += f"-{k}"
                f.write(json.dumps(row) + "\n")
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "jobs.evaluate", "--config", "configs/ci-tiny.yaml", "--tasks", str(many)]
    cmd += ["--out", str(out), "--set", "rollout.sampling.max_new_tokens=1024"]
    cmd += ["--set", "rollout.max_concurrent_episodes=1", "--set", "rollout.hf_max_batch_size=1"]
    # Started with SIGINT ignored, as a script's background job is, and as a test run started in the background
    # hands down: Ctrl-C must end it all the same (it went on playing for 13 min once).
    code, output = ctrl_c_after(cmd, "rollout group:", cwd=ROOT)  # then a second for the episodes to be under way
    assert code == 130, output
    after = output.split("rollout group:", 1)[1]
    assert after.splitlines()[1:] == ["interrupted: nothing was written"], after
    assert not out.exists()
