"""`health.stop_on` as a user runs it: `python -m jobs.train --config configs/ci-tiny.yaml --run` with --set
overrides, in its own process with its own embedded Ray. The tiny random model earns equal rewards in every
group, so zero_variance fires at every step: with patience 2 the run ends after step 2 of 4 with a checkpoint,
a report and exit status 3, naming the finding, its values and the resume command. train.keep_checkpoints=1
prunes the step-1 checkpoint on the way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from configs.loader import load_config
from jobs.preflight import plan_lines
from jobs.train import HEALTH_STOP_EXIT
from tests.jobs.test_train import history, train

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it


@pytest.mark.slow
def test_a_stop_on_finding_ends_the_run_with_a_checkpoint_and_the_resume_command(tmp_path: Path) -> None:
    stop = ("--set", "health.stop_on=[zero_variance]", "--set", "health.patience=2")
    # Fewer tasks, no warm start, no evaluation and no W&B: only the steps the finding is about.
    lean = ("--set", "generation.n_samples=12", "--set", "sft_warmup.enabled=false", "--set", "data.validation=")
    lean += ("--set", "logging.wandb='off'")  # quoted: YAML reads a bare off as false
    proc = train(
        tmp_path, "--run", "--set", "train.steps=4", "--set", "train.keep_checkpoints=1", *stop, *lean, check=False
    )
    tail = f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == HEALTH_STOP_EXIT == 3, tail
    run = tmp_path / "runs" / "ci-tiny"
    message = proc.stderr[proc.stderr.rindex("error: ") :]
    assert message.startswith(
        "error: the run was stopped by health.stop_on: zero_variance held for 2 consecutive steps (steps 1-2): "
        "zero_variance_frac=1 at step 1, 1 at step 2. "
        f"Its checkpoint: {run / 'checkpoints' / 'step_2'}; report: {run / 'report'}."
    ), tail
    resume = message.splitlines()[-1].strip()
    assert resume.startswith("python -m jobs.train --config ") and resume.endswith("--run --resume"), tail
    assert "--set 'health.stop_on=[zero_variance]' --set health.patience=2" in resume
    # Steps 1 and 2 trained, then it stopped; the checkpoint of step 2 is whole, step 1's was pruned.
    trained = sorted(r["step"] for r in history(run) if "train/policy_loss" in r)
    assert trained == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]
    assert json.loads((run / "checkpoints" / "step_2" / "meta.json").read_text())["extra"]["step"] == 2
    summary = (run / "report" / "summary.md").read_text()
    assert "step 2: run stopped by health.stop_on: zero_variance held for 2 consecutive steps" in summary
    assert "step 1: [zero_variance] zero_variance_frac=1" in summary


def test_the_plan_names_the_stop_rule_and_the_retention() -> None:
    overrides = ["health.stop_on=[kl_blowup, grad_norm]", "health.patience=4", "train.keep_checkpoints=2"]
    lines = plan_lines(load_config(None, [*overrides, "train.checkpoint_every=5"]))
    assert "health: stops on kl_blowup, grad_norm after 4 consecutive steps" in lines
    assert any(
        line.startswith("checkpoints: every 5 steps and at the end, keeping the newest 2 and the best by evaluation")
        for line in lines
    ), lines
    plain = plan_lines(load_config(None, []))
    assert not any(line.startswith("health:") or "keeping" in line for line in plain), plain
