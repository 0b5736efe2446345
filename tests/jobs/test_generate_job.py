"""`python -m jobs.generate_tasks` as a user runs it: files written, the gate's summary, exit codes, and
never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from configs.schema import Config
from serve_apps.tool_pool import LocalToolPool
from tasks.io import read_rows
from tasks.schema import TaskRow
from tests.tasks.replay import longest_shown

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "tasks" / "examples" / "conversations.jsonl"
SPLIT = "train=0.8,validation=0.1,test=0.1"
CUT = 1200  # characters: under the longest fiscal results, so the generator has draws to redo
CUT_ARGS = ["--domains", "polygon,fmp,python", "--complexities", "simple,medium"]
CUT_ARGS += ["--set", f"env.max_observation_chars={CUT}"]
# validation by instance (held-out tickers and phrasings of train's templates), transfer by template
INSTANCE_ARGS = ["--method", "rule", "--n", "20", "--seed", "1", "--domains", "polygon,fmp", "--complexities", "simple"]
INSTANCE_ARGS += ["--split", "train=0.5,validation=0.3,transfer=0.2", "--instance-splits", "validation"]
KNOB_VARS = ("N_SAMPLES", "DOMAINS", "COMPLEXITIES", "MAX_TOOLS", "MAX_TURNS", "OPENAI_MODEL", "OPENAI_BACKEND")


@dataclass
class Run:
    rc: int
    out: str  # stdout and stderr together


def _run(args: list[str], env: dict[str, str]) -> Run:
    base = {k: v for k, v in os.environ.items() if k not in KNOB_VARS}
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.generate_tasks", *args],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return Run(proc.returncode, proc.stdout + proc.stderr)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("generate_job")


@pytest.fixture(scope="module")
def runs(tmp: Path) -> dict[str, Run]:
    """Every invocation at once, in parallel: each pays for its own Python start-up."""
    specs = [json.loads(line) for line in EXAMPLE.read_text().splitlines()]
    failing = json.loads(json.dumps(specs[0]).replace('\\"NVDA\\"', '\\"ZZZZ\\"'))  # an unknown ticker offline
    failing["id"] = "example-unknown-ticker"
    (tmp / "mixed.jsonl").write_text(json.dumps(specs[0]) + "\n" + json.dumps(failing) + "\n")
    (tmp / "none.jsonl").write_text(json.dumps(failing) + "\n")
    (tmp / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    invocations: dict[str, tuple[list[str], dict[str, str]]] = {
        "rule": (["--method", "rule", "--n", "40", "--out", str(tmp / "x.jsonl")], {}),
        "split": (
            ["--method", "rule", "--n", "30", "--seed", "1", "--out", str(tmp / "s.parquet"), "--split", SPLIT],
            {},
        ),
        "instance": ([*INSTANCE_ARGS, "--out", str(tmp / "i.jsonl")], {}),
        "split_rows": (  # rows by count, set in the config beside its splits, as a config file sets them
            [
                *["--method", "rule", "--seed", "1", "--domains", "polygon,fmp", "--complexities", "simple"],
                "--out",
                str(tmp / "r.jsonl"),
                "--set",
                'generation.splits={"train": 0.5, "validation": 0.3, "transfer": 0.2}',
                "--set",
                "generation.instance_splits=[validation]",
                "--set",
                'generation.split_rows={"train": 12, "validation": 5, "transfer": 3}',
            ],
            {},
        ),
        "instance_bad": (["--method", "rule", "--split", SPLIT, "--instance-splits", "train"], {}),
        "env": (
            ["--method", "rule", "--n", "6", "--out", str(tmp / "e.json")],
            {"N_SAMPLES": "50", "COMPLEXITIES": "simple"},
        ),
        "dependent": (["--method", "dependent", "--in", str(tmp / "mixed.jsonl"), "--out", str(tmp / "d.jsonl")], {}),
        "none_kept": (["--method", "dependent", "--in", str(tmp / "none.jsonl"), "--out", str(tmp / "n.jsonl")], {}),
        "bad_spec": (["--method", "dependent", "--in", str(tmp / "bad.jsonl"), "--out", str(tmp / "b.jsonl")], {}),
        "n": (["--method", "rule", "--n", "0"], {}),
        "method": (["--method", "magic"], {}),
        "complexity": (["--method", "rule", "--complexities", "easy"], {}),
        "env_turns": (["--method", "rule"], {"MAX_TURNS": "abc"}),
        "split_sum": (["--method", "rule", "--split", "train=0.5,test=0.6"], {}),
        "suffix": (["--method", "rule", "--out", str(tmp / "x.csv")], {}),
        "no_in": (["--method", "dependent"], {}),
        "missing_in": (["--method", "dependent", "--in", str(tmp / "missing.jsonl")], {}),
        "domain": (["--method", "rule", "--domains", "weather", "--out", str(tmp / "w.jsonl")], {}),
        "config": (["--method", "rule", "--set", "generation.max_turns=99"], {}),
        "cut": (["--method", "rule", "--n", "16", "--seed", "3", *CUT_ARGS, "--out", str(tmp / "cut.jsonl")], {}),
        "uri_out": (["--method", "rule", "--out", "s3://bucket/tasks.jsonl"], {}),
        # a submitted Ray job: its working directory goes away, so a relative --out lands under ~/mcprl
        "in_job": (
            ["--method", "rule", "--n", "5", "--out", "data/job.jsonl"],
            {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}", "HOME": str(tmp / "home")},
        ),
    }
    with ThreadPoolExecutor(max_workers=len(invocations)) as ex:
        futures = {name: ex.submit(_run, args, env) for name, (args, env) in invocations.items()}
        return {name: f.result() for name, f in futures.items()}


def test_rule_writes_admitted_rows_and_prints_the_summary(runs: dict[str, Run], tmp: Path) -> None:
    run = runs["rule"]
    assert run.rc == 0, run.out
    assert "rule: kept 40 of 40" in run.out
    assert f"wrote 40 rows (21 templates) to {tmp / 'x.jsonl'}" in run.out
    rows = read_rows(tmp / "x.jsonl")
    assert len(rows) == 40
    for row in rows:
        TaskRow.model_validate(row)


def test_instance_splits_write_held_out_rows_of_the_train_templates(runs: dict[str, Run], tmp: Path) -> None:
    run = runs["instance"]
    assert run.rc == 0, run.out
    groups = {split: read_rows(tmp / f"i.{split}.jsonl") for split in ("train", "validation", "transfer")}
    assert {split: len(rows) for split, rows in groups.items()} == {"train": 10, "validation": 6, "transfer": 4}
    templates = {split: {r["extra_info"]["template"] for r in rows} for split, rows in groups.items()}
    assert templates["validation"] <= templates["train"] and not templates["transfer"] & templates["train"]
    for split, rows in groups.items():
        assert {r["extra_info"]["split"] for r in rows} == {split}
        assert {r["extra_info"].get("held_out", False) for r in rows} == {split == "validation"}


def test_split_rows_fill_each_split_to_its_count(runs: dict[str, Run], tmp: Path) -> None:
    run = runs["split_rows"]
    assert run.rc == 0, run.out
    counts = {split: len(read_rows(tmp / f"r.{split}.jsonl")) for split in ("train", "validation", "transfer")}
    assert counts == {"train": 12, "validation": 5, "transfer": 3}, run.out


async def test_every_expert_result_fits_the_cut_the_config_sets(runs: dict[str, Run], tmp: Path) -> None:
    """The rows' tool results, replayed and rendered as the env shows them, are never cut: the generator read
    env.max_observation_chars from --set and redrew the tasks whose expert would read past it."""
    run = runs["cut"]
    assert run.rc == 0, run.out
    assert "would be cut at env.max_observation_chars" in run.out  # some draws were redone
    rows = read_rows(tmp / "cut.jsonl")
    assert len(rows) == 16
    pool = await LocalToolPool.create(Config().tools)
    try:
        assert await longest_shown(pool, rows) <= CUT
    finally:
        await pool.close()


def test_split_writes_one_file_per_split_without_shared_templates(runs: dict[str, Run], tmp: Path) -> None:
    run = runs["split"]
    assert run.rc == 0, run.out
    templates = {}
    for split, count in (("train", 24), ("validation", 3), ("test", 3)):
        rows = read_rows(tmp / f"s.{split}.parquet")
        assert len(rows) == count and {r["extra_info"]["split"] for r in rows} == {split}
        templates[split] = {r["extra_info"]["template"] for r in rows}
    assert not templates["train"] & templates["validation"]
    assert not templates["train"] & templates["test"]
    assert not templates["validation"] & templates["test"]
    assert not (tmp / "s.parquet").exists()


def test_cli_beats_environment_beats_config(runs: dict[str, Run], tmp: Path) -> None:
    run = runs["env"]
    assert run.rc == 0, run.out
    rows = read_rows(tmp / "e.json")
    assert len(rows) == 6  # --n over N_SAMPLES
    assert {r["reward_spec"]["ground_truth"]["complexity"] for r in rows} == {"simple"}  # COMPLEXITIES over config


def test_rejected_rows_are_listed_with_their_reason(runs: dict[str, Run], tmp: Path) -> None:
    run = runs["dependent"]
    assert run.rc == 0, run.out
    assert "dependent: kept 1 of 2; rejected: 1 a tool call failed offline" in run.out
    assert "rejected example-unknown-ticker: a tool call failed offline (step 1 polygon.previous_close" in run.out
    assert [r["reward_spec"]["ground_truth"]["task_id"] for r in read_rows(tmp / "d.jsonl")] == ["example-nvda-close"]


def test_a_relative_out_in_a_submitted_job_lands_under_home_mcprl(runs: dict[str, Run], tmp: Path) -> None:
    run = runs["in_job"]
    assert run.rc == 0, run.out
    written = tmp / "home" / "mcprl" / "data" / "job.jsonl"
    assert f"to {written}" in run.out and len(read_rows(written)) == 5
    assert not (ROOT / "data" / "job.jsonl").exists()


def test_nothing_admitted_exits_1_without_a_file(runs: dict[str, Run], tmp: Path) -> None:
    run = runs["none_kept"]
    assert run.rc == 1, run.out
    assert "kept 0 of 1" in run.out and "no file written" in run.out
    assert not (tmp / "n.jsonl").exists()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("bad_spec", "spec[0]: no tool calls"),
        ("n", "argument --n: 0 must be at least 1"),
        ("method", "argument --method: invalid choice: 'magic'"),
        ("complexity", "--complexities=easy: Input should be 'simple', 'medium' or 'hard'"),
        ("env_turns", "environment MAX_TURNS=abc"),
        ("split_sum", "split fractions must sum to 1"),
        ("instance_bad", "generation.instance_splits: train cannot be an instance split"),
        ("suffix", "unknown file type '.csv'"),
        ("no_in", "--method dependent needs --in FILE"),
        ("missing_in", "no such file"),
        ("domain", "--domains/DOMAINS: no server weather"),
        ("config", "generation.max_turns"),
        ("uri_out", "--out s3://bucket/tasks.jsonl: a URI; this file is read and written on the driver's node"),
    ],
)
def test_bad_input_exits_2_without_a_traceback(runs: dict[str, Run], name: str, message: str) -> None:
    run = runs[name]
    assert run.rc == 2, run.out
    assert message in run.out, run.out
    assert "Traceback" not in run.out


def test_one_row_is_counted_in_the_singular(tmp_path: Path) -> None:
    run = _run(["--method", "rule", "--n", "1", "--out", str(tmp_path / "one.jsonl")], {})
    assert run.rc == 0, run.out
    assert f"wrote 1 row (1 template) to {tmp_path / 'one.jsonl'}" in run.out
