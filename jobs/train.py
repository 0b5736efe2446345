"""The GRPO job driver: one iteration after another across Ray actors.

    python -m jobs.train --config configs/X.yaml [--set k=v ...]          # preflight only: checks + plan
    python -m jobs.train --config configs/X.yaml --run [--resume]        # train

An iteration: sample B tasks → G episodes each (the runners, on the engines, with the tool pool on
Serve) → drop and count infrastructure-failed episodes → advantages per group (grpo/) → the learner
group trains → the new adapter (or weights) goes through the object store once and every engine
confirms the new version → log → evaluate every k steps → checkpoint every k steps.

With `sft_warmup.enabled` the run first evaluates the base model, trains the warm start (in the learner
group: its adapter is kept at <run>/sft, served as policy v1 and, with kl_coef > 0, the KL reference), evaluates
again, then runs GRPO and evaluates at the end: the report shows the three stages side by side and
compares them on the same tasks (the gain with its 95% CI, tasks gained and lost, success per
template: jobs/stats.py), and the console's last lines say the same.

Outputs go to <train.storage>/<run_name>/ (cluster/storage.py: a folder or an s3:// / gs:// URI):
checkpoints, the warm-start and final adapters, metrics, the report and W&B files. The driver keeps
its own small files in a local folder and pushes them there after every step.

`--resume` continues from the newest checkpoint under <train.storage>/<run_name>/checkpoints: the
learner's state, the step, the policy version and the evaluations so far; batches are a function of
(seed, step), so the resumed run sees the data an unbroken one would.

A learner worker that dies fails its step: the driver rebuilds the learner group from the newest
checkpoint and runs the steps after it again (at most `learner.max_restarts` times); with no checkpoint
yet, or the tries spent, it stops (exit 1) and prints the command that resumes the run.

Health (grpo/health.py, the `health` section): every step's findings are logged and reported. One named in
`health.stop_on` that holds at `health.patience` consecutive steps ends the run: a checkpoint, the final
evaluation and the report, then exit status 3 (HEALTH_STOP_EXIT) with the finding, its values and the
resume command. A resumed run counts the consecutive steps afresh.

`train.keep_checkpoints` K > 0: after each checkpoint only the newest K, the best by the evaluations every
`train.eval_every` steps and the one the run resumed from are kept (jobs/checkpoints.py).

Exit status: 0 done; 1 stopped by a fault (the message has the resume command); 2 bad invocation or config;
3 stopped by `health.stop_on`; 143 stopped by SIGTERM (`ray job stop`).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

from cluster import storage
from cluster.ray_env import ray_session, start_ray_early, stop_early
from configs.schema import Config
from jobs.checkpoints import latest_checkpoint
from jobs.cli import INTERRUPTED_EXIT, base_parser, interruptible, run_and_leave, setup, usage_error
from jobs.held_out import milestone_lines
from jobs.train_driver import RESUME_HINT, Driver, RunStopped, resume_command

HEALTH_STOP_EXIT = 3  # a run ended by health.stop_on (a crash exits 1)


def run_location(cfg: Config) -> str:
    """Where this run's outputs go: <train.storage>/<run_name>, an absolute path or a URI."""
    return storage.join(storage.resolve(cfg.train.storage), cfg.run_name)


# --------------------------------------------------------------------------- CLI


def print_preflight(pf: Any, cfg: Config) -> None:
    from jobs.preflight import plan_lines

    print("preflight:")
    for c in pf.checks:
        print(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
        if not c.ok and c.fix:
            print(f"         fix: {c.fix}")
    if pf.ok:
        print("plan:")
        for line in plan_lines(cfg):
            print(f"  {line}")


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--run", action="store_true", help="train (without it: preflight checks and the plan only)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of this run")
    p.add_argument("--fresh", action="store_true", help="start over: delete this run's folder (checkpoints included)")
    args = p.parse_args(argv)
    cfg = setup(args)
    if args.resume and not args.run:
        usage_error("--resume needs --run")
    if args.resume and args.fresh:
        usage_error("--resume and --fresh contradict each other")
    from jobs.preflight import run_preflight

    run = run_location(cfg)
    if args.run and latest_checkpoint(run) is not None and not (args.resume or args.fresh):
        usage_error(f"{run} already holds checkpoints: add --resume, or --fresh to start over")
    started = start_ray_early(cfg.cluster) if args.run else None  # beside preflight: the engines start sooner
    try:
        pf = run_preflight(cfg, write=args.run)  # a dry run writes nothing
    except BaseException:
        stop_early(started)
        raise
    print_preflight(pf, cfg)
    if not pf.ok:
        stop_early(started)
        print(f"preflight failed: {len(pf.failures())} check(s); the run did not start", file=sys.stderr)
        sys.exit(1)
    if not args.run:
        print("preflight passed; add --run to train")
        return
    from cluster.metrics import dashboard_line, metrics_run
    from orchestration.learner_group import LearnerDied

    if not args.resume and storage.exists(run):
        storage.delete(run)  # a fresh run leaves nothing from an earlier, checkpoint-less one
    print(f"outputs: {run}", flush=True)
    resume_cmd = resume_command(args.config, args.overrides)
    interruptible()
    try:  # Ctrl-C at any point, Ray's start included: one line and the resume command, no traceback
        with ray_session(cfg.cluster, started) as ray_handle:
            print(dashboard_line(ray_handle.dashboard_url, metrics_run(cfg)), flush=True)
            driver = Driver(cfg, pf, run, args.resume, resume_cmd)

            async def go() -> dict[str, Any]:
                # `ray job stop` sends SIGTERM: cancel the run, so that close() still removes its Serve apps;
                # the newest checkpoint is whole (written aside, then renamed or marked), the resume starts there.
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
                try:
                    return await driver.run()
                finally:
                    await driver.close()

            try:
                result = asyncio.run(go())
            except (RunStopped, LearnerDied) as e:  # LearnerDied here: outside the steps, nothing to rebuild
                message = str(e) if isinstance(e, RunStopped) else f"{e}. {RESUME_HINT}{resume_cmd}"
                print(f"error: {message}", file=sys.stderr)
                sys.exit(1)  # leaving the session stops the embedded Ray
            except asyncio.CancelledError:
                print(f"stopped by SIGTERM. {RESUME_HINT}{resume_cmd}", file=sys.stderr, flush=True)
                sys.exit(143)
    except KeyboardInterrupt:
        print(f"interrupted. {RESUME_HINT}{resume_cmd}", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_EXIT)
    if "health_stop" in result:
        print(
            f"error: the run was stopped by health.stop_on: {result['health_stop']}. Its checkpoint: "
            f"{result['checkpoint']}; report: {result['report']}. Fix the cause (or change health.stop_on). "
            f"{RESUME_HINT}{resume_cmd}",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(HEALTH_STOP_EXIT)
    for line in milestone_lines(result["evals"]):
        print(line)
    if result["evals"]:
        from jobs.report import console_lines

        for line in console_lines(result["evals"]):
            print(line)
    print(f"report: {result['report']}  (wall time {result['wall_time_s'] / 60:.1f} min)")


if __name__ == "__main__":
    run_and_leave(main)
