"""What a job starts beside its own process (jobs/train.py, jobs/evaluate.py): the tool pool, the judge, the
rollout group and the learner group on Ray, and a training run's tracker; how the pool deploys while the engines
start; and how they stop."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from configs.schema import Config

if TYPE_CHECKING:
    from envs.judge import JudgeLike
    from envs.judge_serve import JudgeHandle
    from jobs.tracking import Tracker
    from orchestration.learner_group import LearnerGroup
    from orchestration.rollout_group import RolloutGroup
    from serve_apps.tool_pool import ServeAddress, ServeToolPool

log = logging.getLogger("mcprl.train")


def start_judge(cfg: Config) -> JudgeLike | None:
    """The judge the run scores with: none for heuristic rewards, else the deployment's handle, or an
    in-process client (source local). The runners' envs reach the deployment through its handle, passed to
    them; the driver itself scores whole groups (group_judge). An in-process judge stays in the driver."""
    if cfg.reward.backend == "heuristic":
        return None
    from envs.judge_serve import deploy_judge, judge_client

    return deploy_judge(cfg.reward) if cfg.reward.judge.source != "local" else judge_client(cfg.reward)


@dataclass
class Services:
    """The run's services, each set once it is up, so that `close()` stops exactly what started (a start that
    fails half-way leaves the rest None)."""

    pool: ServeToolPool | None = None
    judge: JudgeLike | None = None  # start_judge's: a JudgeHandle, an in-process Judge, or None
    rollout: RolloutGroup | None = None
    learner: LearnerGroup | None = None
    tracker: Tracker | None = None  # the driver finishes it last (close() leaves it)
    deploying: asyncio.Future[None] | None = None  # ToolsStart's deployment, which close() waits for
    closing: asyncio.Future[None] | None = None  # close()'s stop, once begun

    def runner_judge(self) -> JudgeHandle | None:
        """What the runner actors get: the deployment's handle; None makes each build its own from config."""
        from envs.judge_serve import JudgeHandle

        return self.judge if isinstance(self.judge, JudgeHandle) else None

    async def judge_counts(self) -> dict[str, int]:
        """Calls the judge served (per action, per group) beside the env steps played: with llm_judge or
        hybrid every step is one call, with group_judge every scored group is one. Only the deployment
        sees every call: an in-process judge (source local) lives in each runner."""
        if self.runner_judge() is None or self.rollout is None:
            return {}
        stats = await self.judge.stats()
        counts = {
            "judge_action_calls": int(stats["scored"] + stats["infra_faults"]),
            "judge_group_calls": int(stats["ranked"] + stats["group_failures"]),
            "turns_played": int(self.rollout.turns_played),
        }
        print("judge: " + ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
        return counts

    async def close(self) -> None:
        """Stop everything at once (the engines' stop takes seconds). Serve's apps are detached and outlive the
        driver, so an error removing them is raised once the groups have stopped; the actors die with the
        driver anyway, so stopping one group that fails is a warning and does not keep the others running.
        A second call waits for the first one's stop: a run's end starts it beside the report, and the
        driver's `finally` calls it again."""
        if self.closing is None:
            self.closing = asyncio.ensure_future(self._stop())
        await self.closing

    async def _stop(self) -> None:
        from serve_apps.tool_pool import undeploy_pool

        if self.deploying is not None:  # a thread cannot be cancelled: what it deploys is removed once it ends
            await asyncio.gather(asyncio.shield(self.deploying), return_exceptions=True)

        def undeploy() -> None:
            if self.runner_judge() is not None:
                from envs.judge_serve import undeploy_judge

                undeploy_judge(self.judge)
            if self.pool is not None:
                undeploy_pool(self.pool)

        async def stop(what: str, group: RolloutGroup | LearnerGroup | None) -> None:
            if group is None:
                return
            try:
                await group.shutdown()
            except Exception as e:
                log.warning("stopping the %s failed: %s", what, e)

        undeployed, *_ = await asyncio.gather(
            asyncio.to_thread(undeploy), stop("rollout", self.rollout), stop("learner", self.learner),
            return_exceptions=True,
        )  # fmt: skip
        if isinstance(undeployed, BaseException):
            raise undeployed


class ToolsStart:
    """Serve, then the tool pool's applications (and the judge's, with `judge`), deployed on threads (Serve's
    calls block) from the moment this is made, so that the engines start meanwhile: they need neither, and bind no
    port. `serving` is done once Serve's proxy holds its port: a learner, which chooses its rendezvous port free,
    waits for it. `tools()` is what `RolloutGroup.start` takes: its runners start once the pool is deployed. A
    thread cannot be cancelled: after a start that fails, or is cancelled (SIGTERM), `Services.close` waits for
    what is still deploying (seconds), then removes what it started."""

    def __init__(self, cfg: Config, up: Services, judge: bool = True) -> None:
        from cluster.metrics import metrics_run
        from serve_apps.tool_pool import deploy_pool, serve_pool_at

        def deploy(at: ServeAddress) -> None:
            up.pool = deploy_pool(cfg.tools, metrics_run(cfg), at)
            if judge:
                up.judge = start_judge(cfg)

        async def deploying() -> None:
            at = await asyncio.shield(self.serving)
            print("deploying the MCP tool pool on Ray Serve", flush=True)
            await asyncio.to_thread(deploy, at)

        self.up = up
        self.serving: asyncio.Future[ServeAddress] = asyncio.ensure_future(asyncio.to_thread(serve_pool_at, cfg.tools))
        self.deployed: asyncio.Future[None] = asyncio.ensure_future(deploying())
        up.deploying = self.deployed

    async def tools(self) -> tuple[Any, Any]:
        """(tool pool, the judge's handle for the runners) once both are deployed."""
        await asyncio.shield(self.deployed)
        return self.up.pool, self.up.runner_judge()
