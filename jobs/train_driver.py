"""The GRPO run's driver (`python -m jobs.train --run`, jobs/train.py, says what a run does): its phases,
each returning what the next one needs: open the run's records, start the rollout group (with the tool pool
and the judge) and the learner group, resume or evaluate the starting policy, warm-start, the GRPO steps,
the final checkpoint, evaluation and report; then close."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster import storage
from configs.schema import Config
from jobs.checkpoints import latest_checkpoint, prune_checkpoints
from jobs.held_out import eval_figures, play_held_out
from jobs.outcomes import judge_groups, ranked_scores, record_outcomes, succeeded
from jobs.train_services import Services, ToolsStart

if TYPE_CHECKING:
    from grpo.health import HealthMonitor
    from jobs.tracking import Tracker
    from orchestration.learner_group import LearnerGroup
    from orchestration.rollout_group import RolloutGroup
    from tasks.curriculum import CurriculumSampler, TaskSampler

log = logging.getLogger("mcprl.train")

INIT_STAGE = "initial adapter"  # the first stage of a run from finetune.init_adapter (instead of "base")
RESUME_HINT = "Resume the run from its newest checkpoint with:\n  "


# What the learners write into storage themselves; the driver's mirror leaves them be.
ACTOR_OUTPUTS = ("checkpoints", "sft", "final_adapter")


def driver_folder(run: str) -> Path:
    """The driver's local folder for `run`: the run folder itself on a path, else a cache folder."""
    if not storage.is_uri(run):
        return Path(run)
    return storage.default_cache_dir() / "runs" / f"{storage.name(run)}-{hashlib.sha1(run.encode()).hexdigest()[:12]}"


def resume_command(config: str | None, overrides: list[str]) -> str:
    """The command line that continues this run from its newest checkpoint."""
    args = ["python", "-m", "jobs.train"] + (["--config", config] if config else [])
    for item in overrides:
        args += ["--set", item]
    return shlex.join([*args, "--run", "--resume"])


class RunStopped(RuntimeError):
    """The run cannot go on in this process; the message says why and how to resume it."""


def actor_died(error: Exception) -> str:
    """'actor NAME died', from Ray's many-line error about an actor's death (its first line without a name)."""
    named = re.search(r"\bname: (\S+)", str(error))
    return f"actor {named.group(1)} died" if named else str(error).splitlines()[0]


def step_seed(cfg: Config, step: int, salt: int = 0) -> int | None:
    """Sampling seed of one step's rollouts: the runner derives one per episode and turn from it."""
    base = cfg.rollout.sampling.seed
    return None if base is None else (base * 1_000_003 + step * 7_919 + salt) % (2**31)


@dataclass
class Opened:
    """What `Driver._open` gives the later phases: the run's records and where it resumes from."""

    checkpoint: str | None  # None: a fresh start
    tracker: Tracker
    monitor: HealthMonitor
    sampler: TaskSampler | CurriculumSampler


class Driver:
    """Owns the run's actors and state; `run()` is the whole job. The parts below are set by `run()`, each from
    the phase that makes it; `services` holds what is up so far, for `close()`."""

    tracker: Tracker
    monitor: HealthMonitor
    sampler: TaskSampler | CurriculumSampler
    rollout: RolloutGroup
    learner: LearnerGroup

    def __init__(self, cfg: Config, pf: Any, run: str, resume: bool, resume_cmd: str | None = None) -> None:
        """`resume_cmd`: what the user runs to resume (printed when the run must stop; see resume_command)."""
        self.cfg = cfg
        self.pf = pf
        self.location = run
        self.run_dir = driver_folder(run)
        self.mirror = storage.Mirror(self.run_dir, run)
        self.resume = resume
        self.resume_cmd = resume_cmd or resume_command("<your config>", [])
        self.learner_restarts = 0
        self.version = 0
        self.step = 0
        self.evals: dict[str, dict[str, dict[str, Any]]] = {}  # held-out set → stage → result
        self.health: list[str] = []
        self.health_stop: Any = None  # grpo.health.HealthStop that ended the run
        self.step_success: dict[int, float] = {}  # success rate of the evaluations every eval_every steps
        self.protected: set[int] = set()  # checkpoints retention must keep: the ones resumed from
        self.cache_counts: dict[str, tuple[int, int]] = {}  # the engines' prefix-cache counters at the last step
        self.services = Services()

    # ------------------------------------------------------------------ the job

    async def run(self) -> dict[str, Any]:
        """The job, phase by phase."""
        from ray.exceptions import RayActorError

        t_start = time.perf_counter()
        opened = self._open()
        self.tracker, self.monitor, self.sampler = opened.tracker, opened.monitor, opened.sampler
        try:
            self.rollout, self.learner = await self._start_services()
        except RayActorError as e:  # killed while starting (a fault, a lost node): nothing to rebuild yet
            raise RunStopped(f"{actor_died(e)} while the run's services started. {RESUME_HINT}{self.resume_cmd}") from e
        if opened.checkpoint is not None:
            await self._resume(opened.checkpoint)
        else:
            if self.cfg.finetune.init_adapter and self.cfg.finetune.trains_adapter:
                await self._serve_init_adapter()
            else:
                if self.cfg.train.eval_base:
                    await self._evaluate("base")
            if self.cfg.sft_warmup.enabled and self.cfg.finetune.trains_adapter:
                await self._warm_start()
        await self._grpo_loop()
        return await self._finish(t_start)

    # ------------------------------------------------------------------ the phases

    def _open(self) -> Opened:
        """The run's local folder (pulled from storage on resume), its tracker, health monitor and task
        sampler, and the checkpoint to resume from."""
        from grpo.health import HealthMonitor
        from jobs.tracking import Tracker
        from tasks.curriculum import make_sampler

        cfg = self.cfg
        if not self.mirror.in_place:  # a fresh local copy: of the stored run's small files on resume
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self.resume:
                self.mirror.pull(skip=ACTOR_OUTPUTS)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = latest_checkpoint(self.location) if self.resume else None
        if self.resume and ckpt is None:
            log.warning(
                "--resume: no checkpoint under %s; starting from scratch", storage.join(self.location, "checkpoints")
            )
        if ckpt is not None:  # the steps after the checkpoint are redone: their old log lines go
            tracker = Tracker(cfg, self.run_dir, resume=True, start_step=int(storage.name(ckpt)[5:]) + 1)
        else:
            tracker = Tracker(cfg, self.run_dir)
        self.services.tracker = tracker  # close() finishes it whatever happens next
        (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
        return Opened(
            ckpt, tracker, HealthMonitor(**cfg.health.model_dump()), make_sampler(self.pf.train_rows, cfg.train)
        )

    async def _start_services(self) -> tuple[RolloutGroup, LearnerGroup]:
        """Serve, the tool pool and the judge, the rollout group and the learner group, each as soon as what it
        needs is up (`ToolsStart`): the engines at once, beside Serve; the runners once the pool's and the judge's
        applications are deployed; the learners once Serve holds its port, beside the rollout group where they may
        (orchestration/startup.py)."""
        from orchestration.startup import start_groups

        starting = ToolsStart(self.cfg, self.services)

        async def start_learner() -> LearnerGroup:
            await asyncio.shield(starting.serving)
            return await self._start_learner()

        rollout, learner = await start_groups(self.cfg, lambda: self._start_rollout(starting), start_learner)
        return rollout, learner

    async def _start_rollout(self, starting: ToolsStart) -> RolloutGroup:
        """The rollout group: its engines start now, its runners once `starting` has deployed the tools."""
        from actors.engine_api import weight_push
        from orchestration.rollout_group import RolloutGroup

        cfg, up = self.cfg, self.services
        print(
            f"starting {cfg.rollout.engines} rollout engine(s) and {cfg.rollout.runners} runner(s); "
            f"policy push: {weight_push(cfg)}",
            flush=True,
        )
        up.rollout = RolloutGroup(cfg, None)
        await up.rollout.start(starting.tools())
        return up.rollout

    async def _start_learner(self) -> LearnerGroup:
        from orchestration.learner_group import LearnerGroup

        print(f"starting the learner group ({self.cfg.learner.workers} worker(s))", flush=True)
        self.services.learner = learner = LearnerGroup(self.cfg)
        await learner.start()  # it logs what it set up
        return learner

    async def _resume(self, ckpt: str) -> None:
        """The learner's state, the step, the policy version and the evaluations from `ckpt`; the policy
        goes to the engines. After a warm start the checkpoint's adapters include the KL reference's (the
        warm-started policy; actors/learner/), so nothing is read from <run>/sft."""
        extra = await self.learner.load_checkpoint(ckpt)
        self.step, self.version = int(extra["step"]), int(extra["version"])
        self.evals = dict(extra.get("evals", {}))
        self.sampler.load_state(extra.get("sampler", {}))
        self._restore_step_success(extra)
        self.protected.add(self.step)
        print(f"resumed from {ckpt} at step {self.step} (policy v{self.version})", flush=True)
        if self.version > 0:
            await self._push(self.version)

    async def _serve_init_adapter(self) -> None:
        """`finetune.init_adapter`: the learner starts from it, so the engines must serve it too (policy v1)
        before the first rollout, or step 1 would sample from the bare base while the learner scores its
        tokens under the adapter. It is evaluated as the run's first stage."""
        await self._push_next()
        print(f"initial adapter {self.cfg.finetune.init_adapter}: policy v{self.version} on the engines", flush=True)
        await self._evaluate(INIT_STAGE)

    async def _grpo_loop(self) -> None:
        """GRPO steps up to train.steps: rollout, train, push, log, evaluate and checkpoint every k steps."""
        from orchestration.learner_group import LearnerDied

        cfg = self.cfg
        sampler = self.sampler
        pending = None  # overlap: the next step's rollout, running while this step trains
        while self.step < cfg.train.steps:
            step = self.step
            t0 = time.perf_counter()
            with self.tracker.phase("rollout"):
                tasks = sampler.batch(step)
                if pending is not None:
                    trajs = await pending
                else:
                    trajs = await self._rollout(tasks, step)
                pending = None
                trajs, tasks, refills = await self._refill(trajs, tasks, step)
                if cfg.rollout.overlap and step + 1 < cfg.train.steps:
                    pending = asyncio.ensure_future(self._rollout(sampler.batch(step + 1), step + 1))
            try:
                metrics = await self._train_on(trajs, tasks)
                if cfg.algorithm.refill_rounds:
                    metrics["rollout/refill_rounds"] = float(refills)
            except LearnerDied as e:
                await self._rebuild_learner(e, pending)
                pending = None
                continue
            metrics["timing/step_s"] = time.perf_counter() - t0
            findings = self.monitor.check(step + 1, {k.split("/", 1)[-1]: v for k, v in metrics.items()})
            for f in findings:
                log.warning("health: %s", f)
                self.health.append(f"step {step + 1}: [{f.name}] {f}")
            self.step = step + 1
            if cfg.data.validation and cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                if self.step < cfg.train.steps:
                    stage = f"step {self.step}"
                    metrics.update(await self._evaluate(stage, periodic=True))
                    self.step_success[self.step] = float(self.evals["validation"][stage]["success_rate"])
            self.tracker.log(self.step, metrics)
            if cfg.logging.sample_trajectories:
                from actors.rollout_metrics import sample_rows

                self.tracker.log_table(self.step, "trajectories", sample_rows(trajs, cfg.logging.sample_trajectories))
            self.tracker.write(self.tracker.summary_line(self.step, metrics))
            await asyncio.to_thread(self.mirror.push)
            if cfg.train.checkpoint_every and self.step % cfg.train.checkpoint_every == 0:
                try:
                    await self._checkpoint()
                except LearnerDied as e:
                    await self._rebuild_learner(e, pending)
                    pending = None
            self.health_stop = self.monitor.due()
            if self.health_stop is not None:  # _finish checkpoints and reports; main() exits HEALTH_STOP_EXIT
                log.warning("health.stop_on: %s; ending the run", self.health_stop.describe())
                self.health.append(f"step {self.step}: run stopped by health.stop_on: {self.health_stop.describe()}")
                break
        if pending is not None:
            pending.cancel()

    async def _finish(self, t_start: float) -> dict[str, Any]:
        """The final checkpoint and evaluation, the final adapter, the report; everything pushed to storage."""
        from jobs.report import write_report

        cfg = self.cfg
        if cfg.train.steps and (not cfg.train.checkpoint_every or self.step % cfg.train.checkpoint_every):
            await self._checkpoint()
        after_grpo = cfg.sft_warmup.enabled or any(INIT_STAGE in stages for stages in self.evals.values())
        if self.step > 0 or not self.evals:  # no GRPO step (train.steps 0): the last evaluation is the final one
            await self._evaluate("after GRPO" if after_grpo else "final")
        adapter = None
        if cfg.finetune.trains_adapter:
            stored = storage.join(self.location, "final_adapter")
            await self.learner.save_adapter(stored)
            adapter = await asyncio.to_thread(storage.fetch, stored)  # the report and W&B read it here
            self.tracker.log_artifact(adapter, f"{cfg.run_name}-adapter", "lora_adapter")

        wall = time.perf_counter() - t_start
        extra: dict[str, Any] = {"health": self.health, "wall_time_s": wall, "steps": self.step}
        extra.update(await self.services.judge_counts())
        # Nothing more runs on the services: they stop (an engine's exit takes seconds) while the report is drawn.
        stopping = asyncio.ensure_future(self.services.close())
        report = await asyncio.to_thread(
            write_report, self.run_dir, self.tracker.history(), self.evals, adapter=adapter, extra=extra
        )
        self.tracker.finish()  # W&B's files are complete only now
        await asyncio.to_thread(self.mirror.push)
        await stopping
        report_at = storage.join(self.location, storage.name(str(report))) if not self.mirror.in_place else str(report)
        result = {"report": report_at, "evals": self.evals, "wall_time_s": wall, "adapter": adapter}
        if self.health_stop is not None:
            result["health_stop"] = self.health_stop.describe()
            result["checkpoint"] = latest_checkpoint(self.location)
        return result

    # ------------------------------------------------------------------ shutdown

    async def close(self) -> None:
        from cluster.placement import release_request

        await self.services.close()
        release_request()  # preflight's request to the autoscaler: idle nodes may go now
        if self.services.tracker is not None:
            try:
                self.services.tracker.finish()
            except Exception as e:  # `ray job stop` signals W&B's service process too: it may be gone
                log.warning("closing the tracker failed (%s: %s); metrics.jsonl has every figure", type(e).__name__, e)
        try:  # whatever the driver wrote before a failure reaches storage too
            await asyncio.to_thread(self.mirror.push)
        except Exception as e:
            log.warning("pushing the driver's files to %s failed: %s", self.location, e)

    # ------------------------------------------------------------------ pieces

    async def _rebuild_learner(self, error: Exception, pending: asyncio.Future | None) -> None:
        """A learner worker died and the step failed: start the group again, load the newest checkpoint and
        rewind to its step (`pending`, an overlapped rollout of a later step, is cancelled). RunStopped, with
        the resume command, when `learner.max_restarts` is spent or there is no checkpoint yet."""
        if pending is not None:
            pending.cancel()
        budget = self.cfg.learner.max_restarts
        ckpt = latest_checkpoint(self.location)
        if ckpt is None or self.learner_restarts >= budget:
            why = "no checkpoint to rebuild it from yet" if ckpt is None else f"learner.max_restarts ({budget}) spent"
            raise RunStopped(f"{error}; {why}. {RESUME_HINT}{self.resume_cmd}")
        self.learner_restarts += 1
        log.warning("%s: rebuilding the learner group from %s (%d of %d)", error, ckpt, self.learner_restarts, budget)
        try:
            await self.learner.restart()
            extra = await self.learner.load_checkpoint(ckpt)
            self.step, self.evals = int(extra["step"]), dict(extra.get("evals", {}))
            self.sampler.load_state(extra.get("sampler", {}))
            self._restore_step_success(extra)
            self.protected.add(self.step)
            # Engines serve only newer versions: the checkpoint's policy comes back under a new one.
            await self._push_next()
        except Exception as e:
            raise RunStopped(
                f"{error}; rebuilding the learner group failed: {e}. {RESUME_HINT}{self.resume_cmd}"
            ) from e
        print(f"learner group rebuilt from {ckpt}: running again from step {self.step + 1}", flush=True)

    async def _rollout(self, tasks: list[dict[str, Any]], step: int, salt: int = 0) -> list[Any]:
        sampling = self.cfg.rollout.sampling.model_copy(update={"seed": step_seed(self.cfg, step, salt)})
        return await self.rollout.run(tasks, self.cfg.train.group_size, sampling=sampling)

    async def _refill(
        self, trajs: list[Any], tasks: list[dict[str, Any]], step: int
    ) -> tuple[list[Any], list[dict[str, Any]], int]:
        """`algorithm.refill_rounds`: while fewer than train.tasks_per_step groups hold both outcomes, play a round
        of new tasks (the sampler's `more`) and add its groups, numbered after the ones before. Returns the step's
        episodes, its tasks (indexed by group id) and the rounds played."""
        from grpo.groups import outcome_groups
        from tasks.dataset import task_id

        played = 0
        while played < self.cfg.algorithm.refill_rounds:
            scored = [t for t in trajs if not t.infra_fault]
            _, stats = outcome_groups([succeeded(t) for t in scored], [t.group_id for t in scored])
            if stats["groups_kept"] >= self.cfg.train.tasks_per_step:
                break
            more = self.sampler.more(step, played + 1, {task_id(row) for row in tasks})
            if not more:  # every task is in the step already
                break
            played += 1
            extra = await self._rollout(more, step, salt=played)
            for t in extra:
                t.group_id += len(tasks)
            trajs, tasks = trajs + extra, tasks + more
        return trajs, tasks, played

    async def _train_on(self, trajs: list[Any], tasks: list[dict[str, Any]]) -> dict[str, float]:
        from actors.rollout_metrics import prefix_cache_counts, prefix_cache_hit_rate, rollout_metrics
        from grpo.advantages import group_advantages
        from grpo.groups import outcome_groups

        cfg = self.cfg
        metrics: dict[str, float] = {f"rollout/{k}": v for k, v in rollout_metrics(trajs).items()}
        stats = await self.rollout.stats()
        for key in ("tokens_per_s", "episodes_per_s"):
            if key in stats:
                metrics[f"rollout/{key}"] = float(stats[key])
        counts = prefix_cache_counts(stats.get("engines", []))
        rate = prefix_cache_hit_rate(counts, self.cache_counts)
        self.cache_counts = counts
        if rate is not None:
            metrics["rollout/prefix_cache_hit_rate"] = rate
        kept = [t for t in trajs if not t.infra_fault]
        metrics["rollout/dropped_infra"] = float(len(trajs) - len(kept))
        if cfg.reward.backend == "group_judge":
            kept = await judge_groups(kept, tasks, self.services.judge)
        if not kept:
            log.warning("step %d: every episode failed for infrastructure reasons; nothing to train on", self.step + 1)
            return metrics
        ppo = cfg.algorithm.name == "ppo"
        record_outcomes(self.sampler, self.step, kept, tasks, metrics)
        if cfg.algorithm.filter_groups == "outcome" and not ppo:
            keep, group_stats = outcome_groups([succeeded(t) for t in kept], [t.group_id for t in kept])
            kept = [t for t, k in zip(kept, keep, strict=True) if k]
            metrics["rollout/groups_kept"] = group_stats["groups_kept_frac"]
            metrics.update({f"groups/{k}": v for k, v in group_stats.items()})
            if not kept:
                log.info("step %d: no group has both outcomes; nothing to train on", self.step + 1)
                return metrics
        with self.tracker.phase("reward"):
            if ppo:  # per-token advantages come from GAE in the learner: groups play no part (nor their stats)
                adv, adv_stats = [0.0] * len(kept), {}
            else:
                advantages, adv_stats = group_advantages(
                    ranked_scores(cfg, kept),
                    [t.group_id for t in kept],
                    method=cfg.algorithm.advantage,
                    std_normalize=cfg.algorithm.std_normalize,
                )
                adv = advantages.tolist()
        metrics.update({f"adv/{k}": float(v) for k, v in adv_stats.items()})
        with self.tracker.phase("train"):
            samples = [t.to_sample(a, ppo=ppo) for t, a in zip(kept, adv, strict=True)]
            train = await self.learner.train_step(samples)
        metrics.update({f"train/{k}": float(v) for k, v in train.items()})
        with self.tracker.phase("sync"):
            push = await self._push_next()
        metrics["sync/latency_s"] = float(push.get("latency_s", math.nan))
        return metrics

    async def _push_next(self) -> dict[str, Any]:
        """The learner's policy onto every engine under the next version: engines serve only newer versions, and
        vLLM silently keeps serving the old adapter when an id is reused."""
        self.version += 1
        return await self._push(self.version)

    async def _push(self, version: int) -> dict[str, Any]:
        """The learner's policy onto every engine as `version`: the LoRA adapter, or (full fine-tune, and LoRA
        with rollout.weight_push merged) the weights, merged with the adapter for LoRA."""
        from actors.engine_api import weight_push

        if weight_push(self.cfg) == "adapter":
            ref = await self.learner.export_adapter_ref()
            return await self.rollout.push_adapter(version, ref)
        refs = await self.learner.export_weights_refs()
        return await self.rollout.push_weights(version, refs)

    async def _warm_start(self) -> None:
        """The supervised warm start, through the learner group: `sft_warmup.steps` sft_steps on batches of
        the tasks' expert trajectories (jobs/sft.py makes and orders them), one progress line each. Its
        adapter is saved to <run>/sft, becomes the KL reference (kl_coef > 0) and goes to the engines as
        policy v1; then it is evaluated."""
        from jobs.sft import batch_order, warm_start_samples

        cfg, sw = self.cfg, self.cfg.sft_warmup
        print(f"warm start: {sw.steps} SFT steps on expert trajectories", flush=True)
        samples, stats = await asyncio.to_thread(warm_start_samples, cfg, self.pf.train_rows)
        losses: list[float] = []
        tokens, train_s = 0, 0.0
        with self.tracker.phase("sft", total=sw.steps) as bar:
            for k, batch in enumerate(batch_order(len(samples), sw.batch_size, sw.steps, cfg.train.seed), 1):
                chosen = [samples[i] for i in batch]
                t0 = time.perf_counter()
                out = await self.learner.sft_step(chosen)
                train_s += time.perf_counter() - t0
                tokens += sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in chosen)
                losses.append(float(out["sft_loss"]))
                self.tracker.log(0, {"sft/step": k, "sft/loss": losses[-1], "sft/grad_norm": out["grad_norm"]})
                self.tracker.write(
                    f"warm start {k}/{sw.steps} | sft_loss {losses[-1]:.4f} | grad {out['grad_norm']:.3g} | "
                    f"tok/s {out['tokens_per_s']:.0f}"
                )
                bar.update()
        warm = storage.join(self.location, "sft")
        await self.learner.save_adapter(warm)
        reference = await self.learner.reset_reference()
        self.tracker.log(0, {"sft/final_loss": losses[-1], "sft/tokens_per_s": tokens / train_s if train_s else 0.0})
        print(
            f"warm start done: loss {losses[0]:.3f} → {losses[-1]:.3f}, {len(samples)} expert trajectories "
            f"({stats['skipped']} skipped); adapter → {warm}; KL reference: {reference}",
            flush=True,
        )
        await self._push_next()  # the warm start's adapter: policy v1 (v2 after an initial adapter)
        versions = await self.rollout.versions()
        print(f"warm start: policy v{self.version} on the engines (versions {versions})", flush=True)
        await self._evaluate("after warm start")

    async def _evaluate(self, stage: str, periodic: bool = False) -> dict[str, float]:
        """Evaluate and keep the results under `stage` (evals.json beside the report). Returns their figures as
        eval/<set>/... metrics, logged here; a periodic evaluation's go into its step's record (the caller logs it)."""
        if not self.cfg.data.validation:
            return {}
        results = await play_held_out(self.cfg, self.pf, self.rollout, self.tracker, stage, self.step, periodic)
        figures: dict[str, float] = {}
        for name, result in results.items():
            self.evals.setdefault(name, {})[stage] = result
            figures.update(eval_figures(result, name))
        if not periodic:
            self.tracker.log(self.step, figures)
        (self.run_dir / "evals.json").write_text(json.dumps(self.evals, indent=1))
        return figures

    async def _checkpoint(self) -> None:
        folder = storage.join(self.location, "checkpoints", f"step_{self.step}")
        success = {str(s): v for s, v in self.step_success.items()}  # JSON: keys are strings
        extra = {"step": self.step, "version": self.version, "evals": self.evals, "step_success": success}
        extra["sampler"] = self.sampler.state()  # the curriculum's outcomes: the resumed run draws the same batches
        await self.learner.save_checkpoint(folder, extra)
        await asyncio.to_thread(self.mirror.push)  # the metrics that go with it
        log.info("checkpoint: %s", folder)
        keep = self.cfg.train.keep_checkpoints
        if keep:  # only after the new one is whole: it is the newest, which is never deleted
            await asyncio.to_thread(prune_checkpoints, self.location, keep, self.step_success, self.protected)

    def _restore_step_success(self, extra: dict[str, Any]) -> None:
        """The periodic evaluations' success rates up to the checkpoint's step (retention's "best")."""
        saved = {int(s): float(v) for s, v in extra.get("step_success", {}).items()}
        self.step_success = {s: v for s, v in saved.items() if s <= self.step}
