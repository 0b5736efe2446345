"""A learner worker killed with ray.kill during a ci-tiny-sized run (the driver in this process, on the
session's Ray): the step fails, the driver rebuilds the learner group from the newest checkpoint and runs
the steps after it again; once `learner.max_restarts` is spent, or with no checkpoint yet, the run stops
with an error that prints the command resuming it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from cluster.ray_env import actor_name
from configs.loader import load_config
from configs.schema import Config
from jobs.train_driver import Driver, RunStopped, resume_command
from orchestration.learner_group import LearnerDied
from tests.conftest import free_port
from tests.jobs.test_train import history

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
RESUME = "python -m jobs.train --config configs/ci-tiny.yaml --run --resume"
TIMEOUT_S = 300


def tiny(tmp: Path, *extra: str) -> Config:
    """ci-tiny, smaller still: no warm start, no evaluation, its own run name, ports and folders."""
    return load_config(
        ROOT / "configs" / "ci-tiny.yaml",
        [
            f"run_name=faults-{tmp.name}",  # actor names are unique per Ray namespace: the session's is shared
            f"train.storage={tmp / 'runs'}",
            f"data.train={tmp / 'data' / 'tasks.train.jsonl'}",
            "data.validation=",
            "generation.n_samples=12",
            "sft_warmup.enabled=false",
            "logging.wandb='off'",  # quoted: YAML reads a bare off as false
            f"tools.http.port={free_port()}",
            *extra,
        ],
    )


async def until(done: Callable[[], bool], run: asyncio.Future, what: str) -> None:
    """Wait for `done()`, failing with the run's own error if it ends first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    while not done():
        if run.done():
            run.result()  # its exception, if it failed
            raise AssertionError(f"the run ended before {what}")
        assert loop.time() < deadline, f"no {what} within {TIMEOUT_S} s"
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_a_killed_learner_is_rebuilt_from_the_checkpoint_and_the_run_goes_on(
    ray_cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from jobs.preflight import run_preflight

    cfg = tiny(tmp_path, "train.steps=2", "train.checkpoint_every=1", "learner.max_restarts=1")
    pf = await asyncio.to_thread(run_preflight, cfg, True)
    assert pf.ok, [f"{c.name}: {c.detail}" for c in pf.checks if not c.ok]
    run_dir = tmp_path / "runs" / cfg.run_name
    checkpoints = run_dir / "checkpoints"
    name = actor_name(cfg.run_name, "learner", 0)

    driver = Driver(cfg, pf, str(run_dir), resume=False, resume_cmd=RESUME)
    run = asyncio.ensure_future(driver.run())
    try:
        await until(lambda: (checkpoints / "step_1").is_dir(), run, "the first checkpoint")
        first = ray.get_actor(name)
        ray.kill(first)  # during step 2: its rollout is under way, its training step will fail

        def rebuilt() -> bool:  # looked for while the run goes on: its end stops its actors
            try:
                return ray.get_actor(name)._actor_id != first._actor_id
            except ValueError:  # the killed one is gone, and the new one is not up yet
                return False

        await until(rebuilt, run, "a new learner actor")
        result = await asyncio.wait_for(run, TIMEOUT_S)
    finally:
        if not run.done():
            run.cancel()
        await driver.close()

    assert driver.learner_restarts == 1
    out = capsys.readouterr().out
    assert f"learner group rebuilt from {checkpoints / 'step_1'}: running again from step 2" in out
    # The rebuilt group loaded step 1's state: its optimizer had taken 2 steps when it saved step 2.
    meta = json.loads((checkpoints / "step_2" / "meta.json").read_text())
    assert meta["step"] == 2 and meta["extra"]["step"] == 2
    trained = [r["step"] for r in history(run_dir) if "train/policy_loss" in r]
    assert trained == [1, 2]  # step 2 logged once: its first attempt failed before logging
    assert (result["adapter"] / "adapter_model.safetensors").is_file()  # and the run went on to its end


@pytest.mark.parametrize(
    ("checkpoint", "restarts", "why"),
    [(False, 0, "no checkpoint to rebuild it from yet"), (True, 2, "learner.max_restarts (2) spent")],
)
async def test_no_checkpoint_or_tries_spent_stops_with_the_resume_command(
    tmp_path: Path, checkpoint: bool, restarts: int, why: str
) -> None:
    """The decision alone (no Ray): nothing is restarted, and the error ends with the command to resume."""
    run_dir = tmp_path / "run"
    if checkpoint:
        (run_dir / "checkpoints" / "step_1").mkdir(parents=True)
        (run_dir / "checkpoints" / "step_1" / "meta.json").write_text("{}")  # complete: meta.json is written last
    driver = Driver(
        tiny(tmp_path, "learner.max_restarts=2"), pf=None, run=str(run_dir), resume=False, resume_cmd=RESUME
    )
    driver.learner_restarts = restarts
    died = LearnerDied("learner worker 0 (mcprl:x:learner-0) died during train_step: ActorDiedError", 0)
    with pytest.raises(RunStopped) as stopped:
        await driver._rebuild_learner(died, None)
    assert driver.learner_restarts == restarts
    assert str(stopped.value) == f"{died}; {why}. Resume the run from its newest checkpoint with:\n  {RESUME}"


def test_the_resume_command_repeats_the_config_and_overrides() -> None:
    cmd = resume_command("configs/ci-tiny.yaml", ["train.steps=3", "run_name=a b"])
    assert cmd == (
        "python -m jobs.train --config configs/ci-tiny.yaml --set train.steps=3 --set 'run_name=a b' --run --resume"
    )
    assert resume_command(None, []) == "python -m jobs.train --run --resume"
