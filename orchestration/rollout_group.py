"""Rollout engines and episode runners as Ray actors, driven as one group.

    group = RolloutGroup(cfg, deploy_pool(cfg.tools))
    await group.start()                          # E engine actors, then R runner actors
    trajs = await group.run(tasks, group_size)   # whole GRPO groups split across the runners
    await group.push_adapter(v, ray.put(adapter))
    await group.shutdown()

The actors (`EngineHost`, `RunnerHost`, and the `RemoteEngine` wrapper the runners use) are in
orchestration/rollout_actors.py, their CPU pinning in orchestration/cpu_pinning.py, and the policy pushes
(`push_adapter`, `push_weights`, through the object store) in orchestration/policy_push.py. This file
places, starts, restarts and stops them, and splits the rollouts across the runners.

Placement: each engine reserves `rollout.engine_resources` in a placement group of its own (named like
the actor): the group holds the engine's node and resources, so an engine restarted after a crash comes
back there, on the same core slice, and a multi-GPU engine can later take several bundles. Each runner
reserves `rollout.runner_resources`.

Faults: an engine actor that dies is marked dead here (and by each runner on its own failed
request); its episodes restart on another engine (see actors/episode_runner.py).

Restarts: at the end of every `run` (which pings each engine) and every push, and at the start of
each, a dead engine actor is started again under its name (`mcprl:<run>:engine-<i>`, free once
the old actor is killed), on the core slice of the engine it replaces, warmed up, and given the
current policy before any runner sees it: the group keeps the object ref(s) of the last successful
push (an adapter, or weight chunks: that pins one copy of the full weights in the object store)
and loads them into the new engine only, which must then report that version. Then every runner
swaps engine i's handle (`RunnerHost.replace_engine`) and routes to it again. Only engines whose
actor is gone are restarted (an engine a runner gave up on over a non-fatal error stays as it is).
A runner actor that dies during `run` is replaced the same way and its share of the tasks
re-run on the new one, whole, so each trajectory still comes back exactly once (its lost episodes
are played again from scratch). Both are bounded over the group's life by
`rollout.max_engine_restarts` and `rollout.max_runner_restarts`; each restart is logged, and once
the budget is spent an engine stays dead and a lost runner is a `RolloutGroupError` as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Sequence
from typing import Any

from actors.trajectory import Trajectory
from cluster.placement import wait_placed
from cluster.ray_env import actor_name, ensure_name_free, remote_class, start_named, wait_name_free
from configs.schema import Config, SamplingConfig
from orchestration.policy_push import PolicyPushes
from orchestration.rollout_actors import EngineHost, RolloutGroupError, RunnerHost, describe

log = logging.getLogger(__name__)

WARMUP_PROMPT = [1, 2, 3]  # valid ids in any vocabulary; the answer is thrown away
ENGINE_MAX_CONCURRENCY = 10_000  # generate calls in flight per engine actor (Ray's async default is 1000)
SHUTDOWN_TIMEOUT_S = 60.0
NAME_FREE_TIMEOUT_S = 30.0  # a killed actor's name is freed once the GCS has marked it dead
# Runner stats that add up across runners (rates too: the runners play their shares side by side).
SUMMED_RUNNER_STATS = (
    "episodes", "done", "running", "failed", "restarts", "generated_tokens", "tokens_per_s", "episodes_per_s",
)  # fmt: skip


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [start, end) ranges covering range(n), sizes differing by at most one."""
    return [(k * n // parts, (k + 1) * n // parts) for k in range(parts)]


class RolloutGroup(PolicyPushes):
    """`cfg.rollout.engines` engine actors and `cfg.rollout.runners` runner actors (see the module doc)."""

    def __init__(self, cfg: Config, tool_pool: Any, *, judge: Any = None, start_timeout_s: float = 900.0) -> None:
        """`tool_pool`: what `deploy_pool` returned; `judge`: what `deploy_judge` returned (a `JudgeHandle`, an
        `envs.judge.JudgeLike`; typed Any because orchestration/ may not import envs/), or None (both must
        pickle: they travel to the runner actors)."""
        self.cfg = cfg
        self.tool_pool = tool_pool
        self.judge = judge
        self.start_timeout_s = start_timeout_s
        self.engines: list[Any] = []  # actor handles, index = engine id in trajectories
        self.runners: list[Any] = []
        self.groups: list[Any] = []  # each engine's placement group
        self.dead: set[int] = set()  # engines known dead here
        self.ranks: list[tuple[int, int]] = []  # (rank, count) of each engine on its node: its core slice
        # The last successful push, loaded into a restarted engine: ("adapter" | "weights", version, ref(s)).
        self.policy: tuple[str, int, Any] | None = None
        self.engine_restarts = 0
        self.restarting: set[int] = set()  # engines being restarted now
        self.runner_restarts = 0
        self.placements: list[dict[str, Any]] = []
        self.turns_played = 0  # env steps of every episode returned so far (each is one judge call per turn)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, tools: Awaitable[tuple[Any, Any]] | None = None) -> None:
        """Start the engines and then the runners over them. `tools`: where the tool pool and the judge are
        still being deployed, an awaitable of (tool pool, judge), which replace those given to the constructor;
        the engines start meanwhile (they need neither), the runners once it is done."""
        if self.engines:
            raise RolloutGroupError("RolloutGroup.start() was already called")
        if tools is None:
            self._check_pickles()
        from ray.util.placement_group import placement_group

        r = self.cfg.rollout
        try:
            for i in range(r.engines):
                name = actor_name(self.cfg.run_name, "engine", i)
                ensure_name_free(name)  # another live run of this name: say so, rather than wait for its resources
                self.groups.append(placement_group([r.engine_resources.bundle()], strategy="PACK", name=name))
            what = (
                f"{r.engines} engine(s) of {r.engine_resources.describe()} (rollout.engines, rollout.engine_resources)"
            )
            await wait_placed(self.groups, what, self.start_timeout_s)
            for i in range(r.engines):  # one at a time: a failed start shuts down those already started
                name = actor_name(self.cfg.run_name, "engine", i)
                self.engines.append(start_named(remote_class(EngineHost), name, self._engine_options(i), self.cfg, i))
            # The runners boot (a process, its imports, the tokenizer) while the engines start: a runner calls no
            # engine before its first episode, and booting one after the other cost seconds of every start.
            both = [asyncio.ensure_future(self._start_engines()), asyncio.ensure_future(self._start_runners(tools))]
            try:
                await asyncio.gather(*both)  # the first failure, as it happens
            except BaseException:
                for f in both:
                    f.cancel()
                with contextlib.suppress(BaseException):  # their own failures are not the one to report
                    await asyncio.gather(*both)
                raise
        except BaseException:
            await self.shutdown()
            raise
        engines = "; ".join(
            p["backend"] + (f" on cores {p['cpu_bind']}" if "cpu_bind" in p else "") + f", up in {p['start_s']:.0f} s"
            for p in self.placements
        )
        log.info("rollout group: %d engine(s) (%s), %d runner(s)", len(self.engines), engines, len(self.runners))

    async def _start_runners(self, tools: Awaitable[tuple[Any, Any]] | None) -> None:
        """Start the runner actors (once `tools` gives the tool pool and the judge) and wait for them to be up."""
        r = self.cfg.rollout
        if tools is not None:
            self.tool_pool, self.judge = await tools
            self._check_pickles()
        for i in range(r.runners):
            name = actor_name(self.cfg.run_name, "runner", i)
            self.runners.append(
                start_named(remote_class(RunnerHost), name, self._runner_options(), *self._runner_args())
            )
        await self._within(
            asyncio.gather(*(h.stats.remote() for h in self.runners)),
            f"placing {r.runners} runner actor(s) ({r.runner_resources.describe()} each)",
        )

    def _check_pickles(self) -> None:
        """The tool pool and the judge travel to the runner actors: say which does not pickle, and why."""
        from ray import cloudpickle

        for what, obj, hint in (
            ("tool pool", self.tool_pool, "the ServeToolPool that deploy_pool returned"),
            ("judge", self.judge, "the JudgeHandle that deploy_judge returned, or None"),
        ):
            try:
                cloudpickle.dumps(obj)
            except Exception as e:
                raise TypeError(
                    f"the {what} ({type(obj).__name__}) does not pickle, so runner actors cannot use it: "
                    f"pass {hint} ({type(e).__name__}: {e})"
                ) from e

    async def _start_engines(self) -> None:
        """Start the engine actors created (ranked per node: engines sharing a node share its cores), then
        warm each up."""
        count = len(self.engines)
        nodes = await self._within(
            asyncio.gather(*(h.node.remote() for h in self.engines)), f"starting {count} engine actor(s)"
        )
        per_node, seen = Counter(nodes), Counter[str]()
        for node in nodes:
            self.ranks.append((seen[node], per_node[node]))
            seen[node] += 1
        self.placements = await self._within(
            asyncio.gather(*(h.start.remote(k, n) for h, (k, n) in zip(self.engines, self.ranks, strict=True))),
            f"starting {count} engine(s)",
        )
        await self._within(asyncio.gather(*(self._warm_up(h) for h in self.engines)), "warm-up requests")

    def _engine_options(self, i: int) -> dict[str, Any]:
        """Engine i's actor options: its resources, inside its own placement group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            **self.cfg.rollout.engine_resources.actor_options(),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.groups[i], placement_group_bundle_index=0),
            "max_concurrency": ENGINE_MAX_CONCURRENCY,
            # vLLM reads its level at import; Ray merges these env_vars into the job's runtime env
            "runtime_env": {"env_vars": {"VLLM_LOGGING_LEVEL": self.cfg.logging.engine_log_level}},
        }

    def _runner_options(self) -> dict[str, Any]:
        return {**self.cfg.rollout.runner_resources.actor_options(), "max_concurrency": 1000}

    def _runner_args(self) -> tuple[Any, ...]:
        return (self.cfg, list(self.engines), self.tool_pool, self.judge)

    @staticmethod
    async def _warm_up(handle: Any) -> None:
        await handle.generate.remote(WARMUP_PROMPT, SamplingConfig(temperature=0, max_new_tokens=2, stop=[]))

    async def _within(self, awaitable: Any, what: str) -> Any:
        import ray

        fut = asyncio.ensure_future(awaitable)
        # A cancelled wait_for cancels `fut` without reading its outcome, which asyncio would log as an error.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.wait_for(fut, self.start_timeout_s)
        except TimeoutError:
            raise RolloutGroupError(
                f"{what} did not finish within {self.start_timeout_s:.0f} s; the cluster has "
                f"{ray.available_resources()} available of {ray.cluster_resources()} (actors wait for resources)"
            ) from None

    async def shutdown(self) -> None:
        """Stop the runners, then each engine (engine.shutdown() in the actor first: vLLM leaks shared
        memory otherwise), then kill the actors. Safe to call twice and after engines died."""
        import ray

        runners, self.runners = self.runners, []
        for h in runners:
            ray.kill(h)
        engines, self.engines = self.engines, []

        async def stop(i: int, h: Any) -> None:
            if i not in self.dead:
                try:
                    await asyncio.wait_for(h.shutdown.remote(), SHUTDOWN_TIMEOUT_S)
                except Exception as e:  # dead already, or stuck: killing it is all that is left
                    log.warning("engine %d did not shut down cleanly: %s: %s", i, type(e).__name__, e)
            ray.kill(h)

        await asyncio.gather(*(stop(i, h) for i, h in enumerate(engines)))
        self.dead.clear()
        from ray.util.placement_group import remove_placement_group

        groups, self.groups = self.groups, []
        for pg in groups:
            remove_placement_group(pg)

    # ------------------------------------------------------------------ rollouts

    async def run(
        self, tasks: Sequence[dict[str, Any]], group_size: int, sampling: SamplingConfig | None = None
    ) -> list[Trajectory]:
        """`group_size` episodes of each task, whole groups split evenly across the runners; results in
        input order (task-major), `group_id` = the task's index in `tasks`. `sampling` overrides
        `cfg.rollout.sampling` for this call."""
        if not self.runners:
            raise RolloutGroupError("RolloutGroup is not started: await group.start() first")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        tasks = list(tasks)
        await self._restart_dead_engines()
        ranges = [(k, a, b) for k, (a, b) in enumerate(split_evenly(len(tasks), len(self.runners))) if b > a]
        results = await asyncio.gather(
            *(self._run_share(k, tasks[a:b], group_size, sampling) for k, a, b in ranges),
            return_exceptions=True,
        )
        # Engines that died during the run come back before the next one (the ping notices them).
        await self._versions([i for i in range(len(self.engines)) if i not in self.dead])
        await self._restart_dead_engines()
        failed = [(k, r) for (k, _, _), r in zip(ranges, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            detail = "; ".join(f"runner {k}: {describe(e)}" for k, e in failed)
            lost = sum(b - a for k, a, b in ranges if any(k == f for f, _ in failed))
            raise RolloutGroupError(f"{lost} task(s) lost with failed runner(s): {detail}") from failed[0][1]
        out: list[Trajectory] = []
        for (_, a, _), trajs in zip(ranges, results, strict=True):
            for t in trajs:
                t.group_id += a  # runners number groups from 0 within their share
                out.append(t)
        self.turns_played += sum(len(t.turn_rewards) for t in out)
        return out

    async def _run_share(
        self, k: int, tasks: list[dict[str, Any]], group_size: int, sampling: SamplingConfig | None
    ) -> list[Trajectory]:
        """Runner k's share; if its actor dies, a replacement runs the whole share again (within budget)."""
        from ray.exceptions import RayActorError

        while True:
            handle = self.runners[k]
            try:
                return await handle.run.remote(tasks, group_size, sampling)
            except RayActorError as e:
                if not self.runners:  # shut down while it played (Ctrl-C): nothing to replace
                    raise RolloutGroupError("the rollout group was shut down while it played") from e
                if self.runner_restarts >= self.cfg.rollout.max_runner_restarts:
                    raise
                if self.runners[k] is handle:  # not replaced yet by a concurrent share of the same runner
                    self.runner_restarts += 1
                    log.warning(
                        "runner %d died (%s): replacing it (%d of %d restarts) and re-running its %d task(s)",
                        k,
                        type(e).__name__,
                        self.runner_restarts,
                        self.cfg.rollout.max_runner_restarts,
                        len(tasks),
                    )
                    self.runners[k] = await self._start_again(
                        "runner", k, handle, RunnerHost, self._runner_options(), *self._runner_args()
                    )

    async def _start_again(
        self, role: str, index: int, old: Any, cls: type, options: dict[str, Any], *args: Any
    ) -> Any:
        """Kill `old` (if not gone already) and start `cls` under its name once the name is free."""
        import ray

        name = actor_name(self.cfg.run_name, role, index)
        ray.kill(old, no_restart=True)
        try:
            await wait_name_free(name, NAME_FREE_TIMEOUT_S)
        except RuntimeError as e:
            raise RolloutGroupError(str(e)) from None
        return start_named(remote_class(cls), name, options, *args)

    async def _restart_dead_engines(self) -> list[int]:
        """Restart each dead engine (within `rollout.max_engine_restarts`) with the current policy, then
        point every runner at it. Returns the engines restarted."""
        budget = self.cfg.rollout.max_engine_restarts
        todo = sorted(self.dead - self.restarting)[: max(0, budget - self.engine_restarts)]
        if not todo:
            return []
        self.engine_restarts += len(todo)
        self.restarting.update(todo)  # a push during a run must not restart the same engine twice
        try:
            results = await asyncio.gather(*(self._restart_engine(i) for i in todo), return_exceptions=True)
        finally:
            self.restarting.difference_update(todo)
        restarted = [i for i, r in zip(todo, results, strict=True) if not isinstance(r, BaseException)]
        for i, r in zip(todo, results, strict=True):
            if isinstance(r, BaseException):
                log.error("engine %d: restart failed, it stays dead: %s", i, describe(r))
        if len(self.dead) > len(restarted) and self.engine_restarts >= budget:
            log.warning("engine restarts spent (%d): engine(s) %s stay dead", budget, sorted(self.dead))
        return restarted

    async def _restart_engine(self, i: int) -> None:
        from ray.exceptions import RayActorError

        handle = await self._start_again("engine", i, self.engines[i], EngineHost, self._engine_options(i), self.cfg, i)
        try:
            k, n = self.ranks[i]
            placement = await self._within(handle.start.remote(k, n), f"restarting engine {i}")
            await self._within(self._warm_up(handle), f"warming up restarted engine {i}")
            loaded: tuple[str, int, Any] | None = None
            while True:
                while self.policy != loaded:  # a push skips this engine while it is dead: load what it missed
                    loaded = self.policy
                    what, version, ref = loaded
                    load = handle.load_adapter if what == "adapter" else handle.update_weights
                    await self._within(
                        load.remote(version, ref), f"loading {what} v{version} into restarted engine {i}"
                    )
                    reported = await handle.version.remote()
                    if reported != version:
                        raise RolloutGroupError(f"restarted engine {i} reports version {reported}, expected {version}")
                # Runners route to it only once it serves the current policy. A dead runner is skipped: its
                # replacement is built over self.engines, so that holds the new handle first.
                self.engines[i], self.placements[i] = handle, placement
                told = await asyncio.gather(
                    *(h.replace_engine.remote(i, handle) for h in self.runners), return_exceptions=True
                )
                for r in told:
                    if isinstance(r, BaseException) and not isinstance(r, RayActorError):
                        raise r
                if self.policy == loaded:  # no await from this check to marking it live
                    break
        except BaseException:
            import ray

            ray.kill(handle, no_restart=True)
            raise
        self.dead.discard(i)
        log.warning(
            "engine %d restarted (%d of %d restarts) at version %d: %s",
            i,
            self.engine_restarts,
            self.cfg.rollout.max_engine_restarts,
            loaded[1] if loaded else 0,
            placement,
        )

    # ------------------------------------------------------------------ introspection

    async def stats(self) -> dict[str, Any]:
        """Runner progress (summed, and per runner) and each engine's stats ({"dead": True} once gone)."""
        from ray.exceptions import RayActorError

        async def get(handle: Any) -> dict[str, Any] | None:
            try:
                return await handle.stats.remote()
            except RayActorError:
                return None

        async def engine(i: int, handle: Any) -> dict[str, Any] | None:
            return None if i in self.dead else await get(handle)

        runners, engines = await asyncio.gather(
            asyncio.gather(*(get(h) for h in self.runners)),
            asyncio.gather(*(engine(i, h) for i, h in enumerate(self.engines))),
        )
        for i, s in enumerate(engines):
            if s is None:
                self.dead.add(i)
        total = {k: sum(r.get(k, 0) for r in runners if r is not None) for k in SUMMED_RUNNER_STATS}
        total["turns_played"] = self.turns_played
        return {
            **total,
            "runners": [r if r is not None else {"dead": True} for r in runners],
            "engines": [s if s is not None else {"dead": True} for s in engines],
            "dead_engines": sorted(self.dead),
        }


__all__ = ["RolloutGroup", "RolloutGroupError"]
