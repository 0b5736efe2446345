"""The driver end to end on configs/ci-tiny.yaml, each run in its own process with its own embedded Ray
(as a user runs it): preflight, a 2-step run, kill-and-resume equal to an unbroken run, and runs that
must stop before any actor starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420


ENV = {**os.environ, "WANDB_MODE": "offline", "WANDB_API_KEY": ""}


def train_cmd(tmp: Path, data: Path, *extra: str, store: str | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jobs.train",
        "--config",
        str(ROOT / "configs" / "ci-tiny.yaml"),
        "--set",
        f"train.storage={store or tmp / 'runs'}",
        "--set",
        f"data.train={data / 'tasks.train.jsonl'}",
        "--set",
        f"data.validation={data / 'tasks.validation.jsonl'}",
        # one request per batch: tokens depend only on (weights, prompt, seed), so runs can be compared
        "--set",
        "rollout.hf_max_batch_size=1",
        *extra,
    ]


def train(
    tmp: Path,
    *extra: str,
    data: Path | None = None,
    check: bool = True,
    env: dict[str, str] | None = None,
    store: str | None = None,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess:
    cmd = train_cmd(tmp, data or tmp / "data", *extra, store=store)
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, env={**ENV, **(env or {})})
    if check and proc.returncode != 0:
        tail = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        raise AssertionError(f"exit {proc.returncode}\n{tail}")
    return proc


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_metrics(run_dir: Path, step: int) -> dict:
    rows = [r for r in history(run_dir) if r["step"] == step and "train/policy_loss" in r]
    assert len(rows) == 1, f"step {step}: {len(rows)} training rows in {run_dir / 'metrics.jsonl'}"
    return rows[0]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("unbroken")
    proc = train(tmp, "--run")
    (tmp / "stdout.txt").write_text(proc.stdout)
    (tmp / "stderr.txt").write_text(proc.stderr)
    return tmp / "runs" / "ci-tiny"


def test_preflight_prints_the_plan_and_starts_nothing(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The task files are missing: the dry run generates and checks them without writing them."""
    temp = tmp_path_factory.mktemp("preflight-tmpdir")  # its own TMPDIR: a temporary folder left is seen
    proc = train(tmp_path, env={"TMPDIR": str(temp)})
    assert "preflight passed" in proc.stdout
    for check in ("resources", "API keys", "MCP servers", "tools port", "model", "data", "chat template"):
        assert f"[ok] {check}" in proc.stdout
    assert "[ok] MCP servers: polygon (3 tools), fmp (3 tools)\n" in proc.stdout  # counted: "python (1 tool)"
    assert "fine-tune: lora" in proc.stdout and "rollout backend: hf" in proc.stdout
    data = tmp_path / "data"
    would = f"--run would generate rule tasks into {data / 'tasks.train.jsonl'}, {data / 'tasks.validation.jsonl'}"
    assert would in proc.stdout
    assert re.search(r"\[ok\] data: .*: \d+ training tasks, \d+ validation; all pass the gate", proc.stdout)
    assert "wrote" not in proc.stdout  # the generator's lines about its temporary files stay hidden
    assert list(tmp_path.iterdir()) == [], "the dry run wrote files (task files, the output dir)"
    assert not list(temp.glob("mcprl-preflight-*")), "the temporary task files were not deleted"


def test_two_steps_write_checkpoints_metrics_wandb_and_a_report(unbroken: Path) -> None:
    assert sorted(p.name for p in (unbroken / "checkpoints").iterdir()) == ["step_1", "step_2"]
    for step in (1, 2):
        m = step_metrics(unbroken, step)
        for key in ("train/policy_loss", "train/kl", "train/grad_norm", "train/lr", "rollout/episode_reward"):
            assert key in m and m[key] == m[key], key  # present and not NaN
        assert m["rollout/episodes_per_s"] > 0 and m["rollout/tokens_per_s"] > 0
    # Where to watch it, printed once at start: ci-tiny has no dashboard, but exports its metrics.
    stdout = (unbroken.parents[1] / "stdout.txt").read_text()
    assert stdout.count('no Ray dashboard in this session; metrics: ray_mcprl_*{run="ci-tiny"}') == 1
    evals = [r for r in history(unbroken) if "eval/validation/success_rate" in r]
    assert len(evals) == 3  # base, after the warm start, after GRPO
    # The warm start trains in the learner group: sft_loss falls over its steps, its adapter is kept at
    # <run>/sft and the engines serve it as policy v1 before GRPO starts.
    sft = sorted((r for r in history(unbroken) if "sft/loss" in r), key=lambda r: r["sft/step"])
    assert [r["sft/step"] for r in sft] == [1, 2]
    assert sft[-1]["sft/loss"] < sft[0]["sft/loss"]
    assert "warm start: policy v1 on the engines (versions [1])" in stdout
    assert (unbroken / "sft" / "adapter_model.safetensors").is_file()
    summary = (unbroken / "report" / "summary.md").read_text()
    for stage in ("base", "after warm start", "after GRPO"):
        assert f"| {stage} |" in summary, stage
    # the stages compared task by task (jobs/stats.py), in summary.md and on the console
    assert "| after GRPO − after warm start | 4 |" in summary and "| after warm start − base | 4 |" in summary
    assert "| template | complexity | tasks | base | after warm start | after GRPO |" in summary
    assert re.search(r"after GRPO − after warm start: [+-]\d+\.\d points, 95% CI \[", stdout)
    assert "success per template (answer right: solved / scored):" in stdout
    assert list((unbroken / "wandb").glob("offline-run-*")), "no offline W&B run written"
    assert (unbroken / "final_adapter" / "adapter_model.safetensors").is_file()


def test_the_console_says_what_mcprl_does_and_little_else(unbroken: Path) -> None:
    """The libraries' routine lines stay off the console (cluster/console.py); mcprl's own are there."""
    console = (unbroken.parents[1] / "stdout.txt").read_text() + (unbroken.parents[1] / "stderr.txt").read_text()
    for noise in (
        "Token authentication is enabled",  # Ray's notice on a new local Ray
        "Started a local Ray instance",
        "Connecting to existing Serve app",  # Serve, on every start of the tool pool
        "Started Serve in namespace",
        "is ready at http",
        "Deleting app",
        "SharedRouterLongPollClient",  # Serve, in the runner actor
        "Loading weights",  # transformers' bar, in each actor that loads the model
        "\nwandb: ",  # W&B's banner (and its Weave advert)
    ):
        assert noise not in console, noise
    assert "started an embedded Ray" in console and "deploying the MCP tool pool on Ray Serve" in console
    assert "W&B: offline; upload it with `wandb sync " in console  # where the W&B run is, said once by us


def test_kill_and_resume_ends_where_an_unbroken_run_ends(unbroken: Path, tmp_path: Path) -> None:
    """Outputs in S3 (a real S3 API on loopback): the run is killed after its first checkpoint and
    resumed from another working directory; nothing it needs was on the first one's disk."""
    from cluster import storage
    from tests.s3_server import BUCKET, s3_env

    data = unbroken.parent.parent / "data"  # same task files as the unbroken run
    store = f"s3://{BUCKET}/runs"
    run = storage.join(store, "ci-tiny")
    with s3_env() as s3:
        first, second = tmp_path / "first", tmp_path / "second"
        first.mkdir()
        second.mkdir()
        env = {**ENV, **s3, "MCPRL_CACHE": str(tmp_path / "cache-first"), "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            train_cmd(tmp_path, data, "--run", store=store),
            cwd=first,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not storage.exists(storage.join(run, "checkpoints", "step_1", "meta.json")):
                assert proc.poll() is None, "the run ended before its first checkpoint"
                assert time.monotonic() < deadline, "no checkpoint in time"
                time.sleep(0.5)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and the embedded Ray it started, all at once
            proc.wait()
        assert not storage.exists(storage.join(run, "checkpoints", "step_2")), "killed too late to test a resume"
        assert not list(first.iterdir()), "the run wrote into its working directory"

        env2 = {**s3, "MCPRL_CACHE": str(tmp_path / "cache-second"), "PYTHONPATH": str(ROOT)}
        train(tmp_path, "--run", "--resume", data=data, store=store, cwd=second, env=env2)
        run_dir = storage.download(run, tmp_path / "downloaded")
    assert (run_dir / "report" / "summary.md").is_file()
    for key in ("train/policy_loss", "rollout/episode_reward", "train/grad_norm"):
        assert step_metrics(run_dir, 2)[key] == pytest.approx(step_metrics(unbroken, 2)[key], rel=1e-5, abs=1e-7)
    a = load_file(str(unbroken / "final_adapter" / "adapter_model.safetensors"))
    b = load_file(str(run_dir / "final_adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)


def test_ctrl_c_in_a_run_started_with_sigint_ignored_stops_it_with_the_resume_command(
    unbroken: Path, tmp_path: Path
) -> None:
    """A run started as a script's background job (SIGINT ignored, which Python keeps): Ctrl-C must still end it,
    in one line that gives the resume command, and with no traceback."""
    from tests.conftest import ctrl_c_after

    data = unbroken.parent.parent / "data"
    code, out = ctrl_c_after(train_cmd(tmp_path, data, "--run"), "rollout group:", cwd=ROOT, env=ENV, wait_s=TIMEOUT_S)
    assert code == 130, out
    assert "interrupted. " in out and "--resume" in out, out
    assert "Traceback" not in out, out


def test_a_bad_config_stops_before_anything_starts(tmp_path: Path) -> None:
    proc = train(tmp_path, "--set", "train.group_size=1", "--run", check=False)
    assert proc.returncode == 2
    assert "train.group_size" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_bad_task_file_stops_before_anything_starts(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    bad = {"data_source": "x", "env_class": "mcp_tool_env", "prompt": [], "reward_spec": {}, "extra_info": {}}
    (data / "tasks.train.jsonl").write_text(json.dumps(bad) + "\n")
    (data / "tasks.validation.jsonl").write_text(json.dumps(bad) + "\n")
    proc = train(tmp_path, "--run", data=data, check=False)
    assert proc.returncode == 1
    assert "[FAIL] data" in proc.stdout and "row 1" in proc.stdout
    assert "the run did not start" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_overlap_generates_the_next_step_while_this_one_trains(tmp_path: Path, unbroken: Path) -> None:
    """Also rollout.weight_push=merged, with finetune.mode=qlora (a run of its own would cost ~2 min): each
    step's policy, the adapter over the 4-bit base, reaches the engine as dequantized merged weights;
    algorithm.name=ppo: the run trains a value head (its metrics logged, its weights in the checkpoints,
    not in the adapter); finetune.init_adapter (the unbroken run's warm start): the engines serve it
    before the first rollout, and it is the first stage evaluated; and train.eval_every=1: an evaluation
    after step 1, its figures in that step's metrics."""
    from torch.distributed.checkpoint import FileSystemReader

    data = unbroken.parent.parent / "data"
    overrides = (
        "rollout.overlap=true",
        "sft_warmup.enabled=false",
        "rollout.weight_push=merged",
        "finetune.mode=qlora",
        "algorithm.name=ppo",
        f"finetune.init_adapter={unbroken / 'sft'}",
        "train.eval_every=1",
    )
    proc = train(tmp_path, "--run", *(x for o in overrides for x in ("--set", o)), data=data)
    # Served before anything is sampled (the step lines go to stderr; these lines, in order, to stdout).
    lines = (
        f"initial adapter {unbroken / 'sft'}: policy v1 on the engines",
        "eval [initial adapter]",
        "eval [step 1]",
        "eval [after GRPO]",
    )
    at = [proc.stdout.find(line) for line in lines]
    assert -1 not in at and at == sorted(at), dict(zip(lines, at, strict=True))
    assert "eval [base]" not in proc.stdout
    assert "policy push: merged" in proc.stdout and "fine-tune: qlora (r=4, alpha=8)" in proc.stdout
    assert "policy push: adapter" in (unbroken.parents[1] / "stdout.txt").read_text()  # ci-tiny's HF engine: auto
    assert "2 PPO steps" in proc.stdout and "advantage GAE (gamma 0.99, lam 0.95) with a value head" in proc.stdout
    run_dir = tmp_path / "runs" / "ci-tiny"
    for step in (1, 2):
        m = step_metrics(run_dir, step)
        assert m["rollout/episodes"] == 4 and m["train/tokens"] > 0 and m["sync/latency_s"] > 0
        for key in ("train/value_loss", "train/value_mean", "train/explained_variance", "train/returns_mean"):
            assert key in m and m[key] == m[key], key  # present and not NaN
        assert not any(k.startswith("adv/") for k in m)  # no group advantages: the health checks never see them
    m = step_metrics(run_dir, 1)
    assert 0 <= m["eval/validation/success_rate"] <= 1 and "eval/validation/tasks" in m
    assert "train/value_loss" not in step_metrics(unbroken, 1)  # grpo (ci-tiny's default) has no value head
    saved = FileSystemReader(str(run_dir / "checkpoints" / "step_2" / "state")).read_metadata().state_dict_metadata
    assert {"model.value_head.weight", "model.value_head.bias"} <= set(saved)
    adapter = load_file(str(run_dir / "final_adapter" / "adapter_model.safetensors"))
    assert adapter and not any("value" in k for k in adapter)


def test_outcome_filter_curriculum_and_a_transfer_set(tmp_path: Path, unbroken: Path) -> None:
    """algorithm.filter_groups=outcome, train.curriculum and data.transfer, as a user sets them. The random
    model never answers right, so every group is all-wrong: each step plays its one refill round
    (algorithm.refill_rounds) of 2 more tasks, logs 0 of 4 groups kept and trains nothing (no learner update,
    no push), the per-template pass rates are logged, the curriculum's outcomes (both rounds) ride in
    the checkpoint, and both held-out sets are evaluated at each milestone (the transfer set here: the
    validation file again), with train.eval_base=false leaving the base stage out."""
    data = unbroken.parent.parent / "data"
    overrides = (
        "algorithm.filter_groups=outcome",
        "algorithm.refill_rounds=1",
        "train.curriculum.enabled=true",
        f"data.transfer={data / 'tasks.validation.jsonl'}",
        "train.eval_base=false",
        "train.eval_every=1",
    )
    proc = train(tmp_path, *(a for o in overrides for a in ("--set", o)), "--run", data=data)
    run_dir = tmp_path / "runs" / "ci-tiny"
    rows = history(run_dir)
    for step in (1, 2):
        merged = {k: v for r in rows if r["step"] == step for k, v in r.items()}
        assert merged["rollout/groups_kept"] == 0.0 and merged["groups/groups_all_wrong"] == 4.0
        assert merged["rollout/refill_rounds"] == 1.0
        assert merged["rollout/success_rate"] == 0.0
        assert any(k.startswith("pass_rate/") for k in merged)
        assert not any(k.startswith("train/") for k in merged), "a step with no kept group trained"
    assert "eval/validation/success_rate" in {k for r in rows if r["step"] == 1 for k in r}  # eval_every 1
    meta = json.loads((run_dir / "checkpoints" / "step_2" / "meta.json").read_text())
    recorded = meta["extra"]["sampler"]["outcomes"]
    assert sorted(recorded) == ["0", "1"] and all(len(v) == 4 for v in recorded.values())  # 2 + 2 tasks a step
    evals = json.loads((run_dir / "evals.json").read_text())
    assert list(evals) == ["validation", "transfer"]
    assert list(evals["validation"]) == ["after warm start", "step 1", "after GRPO"]
    assert list(evals["transfer"]) == ["after warm start", "after GRPO"]  # periodic evaluations: validation only
    assert evals["validation"]["step 1"]["periodic"] and evals["transfer"]["after GRPO"]["step"] == 2
    assert "groups without both outcomes left out (up to 1 more round(s) of 2 tasks to find them)" in proc.stdout
    assert "answer right on held-out transfer tasks" in proc.stdout and "== transfer:" in proc.stdout
