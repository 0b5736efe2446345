"""Rollout engines and episode runners as Ray actors, driven as one group.

    group = RolloutGroup(cfg, deploy_pool(cfg.tools))
    await group.start()                          # E engine actors, then R runner actors
    trajs = await group.run(tasks, group_size)   # whole GRPO groups split across the runners
    await group.push_adapter(v, ray.put(adapter))
    await group.shutdown()

Actors:
- `EngineHost` (E of them): builds `make_engine(cfg)` inside the actor and starts it there, so the
  model (and vLLM's engine-core process) lives with the actor. Each engine reserves
  `rollout.engine_resources` in a placement group of its own (named like the actor): the group holds
  the engine's node and resources, so an engine restarted after a crash comes back there, on the same
  core slice, and a multi-GPU engine can later take several bundles. On CPU, engines placed on the
  same node share its cores: vLLM engine k of n gets its own slice in `VLLM_CPU_OMP_THREADS_BIND`
  (else every engine pins its worker to CPU 0); an HF engine sets `torch.set_num_threads(cores // n)`
  (Ray sets OMP_NUM_THREADS=1 for actors with fractional CPUs, which would leave torch on one thread).
- `RunnerHost` (R of them, each reserving `rollout.runner_resources`): an `EpisodeRunner` over
  `RemoteEngine` wrappers of ALL engines, so each runner routes episodes least-loaded across every
  engine and fails over when one dies. Its environments reach the tools through the `ServeToolPool`
  given to the group and the judge through the judge deployment's handle (Serve handles pickle);
  both are passed to the runner explicitly, nothing is registered in module globals. With no judge
  given (an in-process judge does not pickle), each runner builds its own from `reward.judge`.

Weights travel through the object store once: the driver `ray.put`s an adapter (or weight chunks)
and every engine reads the same object. `push_adapter` passes the ref as a top-level argument, so
Ray resolves it before the engine's method runs (an adapter is small and needed whole; the fetch
is part of the latency we measure from here). `push_weights` passes the chunk refs inside a list,
which Ray does not resolve: the engine awaits them one at a time (`update_weights` awaits
awaitable chunks), so a large model never sits in one engine twice.

Faults: an engine actor that dies is marked dead here (and by each runner on its own failed
request); its episodes restart on another engine (see actors/episode_runner.py). Pushes skip
engines known dead and report them; a live engine that fails to load, or reports another version
afterwards, is an error naming that engine.

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
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from actors.engine_api import EngineError, EngineUnavailable, Generation, choose_backend
from actors.engines import make_engine
from actors.models import load_tokenizer
from actors.trajectory import Trajectory
from cluster.metrics import ENGINE_POLICY_VERSION, metrics_run, record
from cluster.placement import wait_placed
from cluster.ray_env import actor_name, ensure_name_free, remote_class, start_named, wait_name_free
from configs.schema import Config, SamplingConfig

log = logging.getLogger(__name__)

WARMUP_PROMPT = [1, 2, 3]  # valid ids in any vocabulary; the answer is thrown away
ENGINE_MAX_CONCURRENCY = 10_000  # generate calls in flight per engine actor (Ray's async default is 1000)
SHUTDOWN_TIMEOUT_S = 60.0
NAME_FREE_TIMEOUT_S = 30.0  # a killed actor's name is freed once the GCS has marked it dead
# Runner stats that add up across runners (rates too: the runners play their shares side by side).
SUMMED_RUNNER_STATS = (
    "episodes", "done", "running", "failed", "restarts", "generated_tokens", "tokens_per_s", "episodes_per_s",
)  # fmt: skip


class RolloutGroupError(RuntimeError):
    """A group operation failed on named engines or runners."""


def node_cores() -> list[int]:
    """The CPU ids this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def core_slice(cores: Sequence[int], rank: int, count: int) -> list[int]:
    """Engine `rank` of `count` on one node gets a contiguous, disjoint slice of `cores`; with more
    engines than cores, engines share cores round-robin (one each)."""
    if count < 1 or not 0 <= rank < count:
        raise ValueError(f"rank {rank} of {count} engines is out of range")
    n = len(cores)
    if count > n:
        return [cores[rank % n]]
    return list(cores[rank * n // count : (rank + 1) * n // count])


def cpu_list(cores: Sequence[int]) -> str:
    """'0-3' for a contiguous run, '0,2,5' otherwise (the form VLLM_CPU_OMP_THREADS_BIND reads)."""
    cores = sorted(cores)
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))


def describe(error: BaseException) -> str:
    """'Type: message' of the error, of its cause for a RayTaskError (not the remote traceback)."""
    from ray.exceptions import RayTaskError

    cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
    return f"{type(cause).__name__}: {cause}"


# --------------------------------------------------------------------------- engine side


class EngineHost:
    """One rollout engine inside a Ray actor (plain class; `ray.remote` is applied in RolloutGroup)."""

    def __init__(self, cfg: Config, index: int = 0) -> None:
        """`index`: the engine's id in the group (its `engine` tag on the dashboard)."""
        self.cfg = cfg
        self.index = index
        self.engine: Any = None
        self.placement: dict[str, Any] = {}
        self.metrics_run = metrics_run(cfg)

    def _report_version(self) -> None:
        """The policy version gauge of this engine (the dashboard's per-engine view of weight syncs)."""
        if self.metrics_run is not None:
            record(ENGINE_POLICY_VERSION, self.version(), run=self.metrics_run, engine=str(self.index))

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def start(self, local_rank: int, local_count: int) -> dict[str, Any]:
        """Build and start the engine; `local_rank` of `local_count` engines on this node."""
        backend = choose_backend(self.cfg)
        on_cpu = self.cfg.rollout.engine_resources.num_gpus == 0
        cores = core_slice(node_cores(), local_rank, local_count)
        placement: dict[str, Any] = {"backend": backend, "pid": os.getpid()}
        if on_cpu and backend == "vllm":
            # Read by the engine-core process vLLM spawns from this one.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = placement["cpu_bind"] = cpu_list(cores)
        if on_cpu and backend == "hf":
            import torch

            torch.set_num_threads(len(cores))
            placement["torch_threads"] = torch.get_num_threads()
        t0 = time.monotonic()
        self.engine = make_engine(self.cfg)
        await self.engine.start()
        placement["start_s"] = time.monotonic() - t0
        self.placement = placement
        self._report_version()
        return placement

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Generation:
        if self.engine is None:
            raise EngineUnavailable("engine actor not started")
        return await self.engine.generate(prompt_token_ids, sampling)

    async def load_adapter(self, version: int, adapter: dict[str, Any]) -> float:
        """Load the adapter (resolved by Ray from the pushed object ref); seconds spent loading."""
        t0 = time.monotonic()
        await self.engine.load_adapter(version, adapter)
        elapsed = time.monotonic() - t0
        self._report_version()
        return elapsed

    async def update_weights(self, version: int, chunk_refs: list[Any]) -> float:
        """Replace the weights from object refs of {name: tensor} chunks, fetched one at a time."""
        t0 = time.monotonic()
        await self.engine.update_weights(version, chunk_refs)  # ObjectRefs are awaitable: awaited in turn
        elapsed = time.monotonic() - t0
        self._report_version()
        return elapsed

    def version(self) -> int:
        return self.engine.version() if self.engine is not None else -1

    def stats(self) -> dict[str, Any]:
        return {**(self.engine.stats() if self.engine is not None else {}), "placement": self.placement}

    async def shutdown(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await engine.shutdown()  # vLLM: stops the engine core, frees its shared memory


class RemoteEngine:
    """An engine actor handle that the EpisodeRunner can use like a local engine.

    Errors: an `EngineError` raised in the actor (the request's fault) comes back as that
    EngineError; anything else, and the actor's death, comes back as `EngineUnavailable` (not an
    EngineError), so the runner restarts the episode on another engine."""

    def __init__(self, handle: Any, index: int = -1) -> None:
        self.handle = handle
        self.index = index

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Generation:
        from ray.exceptions import RayActorError, RayError, RayTaskError

        try:
            return await self.handle.generate.remote(list(prompt_token_ids), sampling)
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, EngineError):
                raise cause from e
            raise EngineUnavailable(f"engine {self.index}: {describe(e)}") from e
        except RayActorError as e:  # ActorDiedError, ActorUnavailableError
            raise EngineUnavailable(f"engine actor {self.index} is gone: {type(e).__name__}") from e
        except RayError as e:
            raise EngineUnavailable(f"engine {self.index}: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------- runner side


class RunnerHost:
    """An EpisodeRunner inside a Ray actor, over every engine of the group."""

    def __init__(self, cfg: Config, engines: list[Any], tool_pool: Any, judge: Any = None) -> None:
        from actors.episode_runner import EpisodeRunner

        self.runner = EpisodeRunner(
            cfg,
            [RemoteEngine(h, i) for i, h in enumerate(engines)],
            load_tokenizer(cfg.model),
            max_concurrent_episodes=cfg.rollout.max_concurrent_episodes,
            progress=False,
            tool_client=tool_pool,
            judge=judge,
        )

    async def run(
        self, tasks: list[dict[str, Any]], group_size: int, sampling: SamplingConfig | None = None
    ) -> list[Trajectory]:
        return await self.runner.run(tasks, group_size, sampling)

    def stats(self) -> dict[str, Any]:
        return self.runner.stats()

    def replace_engine(self, index: int, handle: Any) -> None:
        """Engine `index` was restarted as actor `handle`."""
        self.runner.replace_engine(index, RemoteEngine(handle, index))


# --------------------------------------------------------------------------- the group


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [start, end) ranges covering range(n), sizes differing by at most one."""
    return [(k * n // parts, (k + 1) * n // parts) for k in range(parts)]


class RolloutGroup:
    """`cfg.rollout.engines` engine actors and `cfg.rollout.runners` runner actors (see the module doc)."""

    def __init__(self, cfg: Config, tool_pool: Any, *, judge: Any = None, start_timeout_s: float = 900.0) -> None:
        """`tool_pool`: what `deploy_pool` returned; `judge`: what `deploy_judge` returned, or None (both must
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

    async def start(self) -> None:
        from ray import cloudpickle

        if self.engines:
            raise RolloutGroupError("RolloutGroup.start() was already called")
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
            # Engines sharing a node share its cores: rank them per node before they start.
            nodes = await self._within(
                asyncio.gather(*(h.node.remote() for h in self.engines)), f"starting {r.engines} engine actor(s)"
            )
            per_node, seen = Counter(nodes), Counter[str]()
            for node in nodes:
                self.ranks.append((seen[node], per_node[node]))
                seen[node] += 1
            self.placements = await self._within(
                asyncio.gather(*(h.start.remote(k, n) for h, (k, n) in zip(self.engines, self.ranks, strict=True))),
                f"starting {r.engines} engine(s)",
            )
            await self._within(asyncio.gather(*(self._warm_up(h) for h in self.engines)), "warm-up requests")
            for i in range(r.runners):
                name = actor_name(self.cfg.run_name, "runner", i)
                self.runners.append(
                    start_named(remote_class(RunnerHost), name, self._runner_options(), *self._runner_args())
                )
            await self._within(
                asyncio.gather(*(h.stats.remote() for h in self.runners)),
                f"placing {r.runners} runner actor(s) ({r.runner_resources.describe()} each)",
            )
        except BaseException:
            await self.shutdown()
            raise
        log.info("rollout group: %d engine(s) %s, %d runner(s)", len(self.engines), self.placements, len(self.runners))

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

        try:
            return await asyncio.wait_for(awaitable, self.start_timeout_s)
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

    # ------------------------------------------------------------------ policy updates

    async def push_adapter(self, version: int, adapter_ref: Any) -> dict[str, Any]:
        """Every live engine loads LoRA `version` from the one object `adapter_ref` (from `ray.put`).

        Returns {"version", "latency_s" (the slowest engine, as seen from here: fetch + load),
        "per_engine_s" (aligned with "engines"), "load_s" (each engine's own timing of the load, the
        fetch excluded; aligned with "engines"), "engines", "restarted_engines" (found dead by this
        push and restarted at this version), "dead_engines"}. Raises naming each live engine that
        failed to load it or reports another version afterwards."""
        import ray

        if not isinstance(adapter_ref, ray.ObjectRef):
            raise TypeError(f"adapter_ref must be the ObjectRef of ray.put(adapter), got {type(adapter_ref).__name__}")
        return await self._push(version, "adapter", adapter_ref, lambda h: h.load_adapter.remote(version, adapter_ref))

    async def push_weights(self, version: int, chunk_refs: Sequence[Any]) -> dict[str, Any]:
        """Every live engine replaces its weights from the chunks' object refs (each a {name: tensor}
        dict from `ray.put`), fetching one chunk at a time. Same result and errors as push_adapter."""
        import ray

        refs = list(chunk_refs)
        bad = [i for i, r in enumerate(refs) if not isinstance(r, ray.ObjectRef)]
        if bad or not refs:
            raise TypeError(f"chunk_refs must be a non-empty list of ObjectRefs (ray.put); not refs at {bad[:5]}")
        return await self._push(version, "weights", refs, lambda h: h.update_weights.remote(version, refs))

    async def _push(self, version: int, what: str, refs: Any, call: Any) -> dict[str, Any]:
        from ray.exceptions import RayActorError

        if not self.engines:
            raise RolloutGroupError("RolloutGroup is not started: await group.start() first")
        await self._restart_dead_engines()  # at the old policy: then this push loads the new one
        live = [i for i in range(len(self.engines)) if i not in self.dead]

        async def one(i: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            load_s = await call(self.engines[i])  # the engine's own timing (EngineHost)
            return time.perf_counter() - t0, float(load_s)

        results = await asyncio.gather(*(one(i) for i in live), return_exceptions=True)
        errors: dict[int, str] = {}
        times: dict[int, tuple[float, float]] = {}
        for i, r in zip(live, results, strict=True):
            if isinstance(r, RayActorError):
                self._mark_dead(i, r)
            elif isinstance(r, BaseException):
                errors[i] = describe(r)
            else:
                times[i] = r
        reported = await self._versions([i for i in times])
        for i, v in reported.items():
            if v != version and i not in self.dead:
                errors[i] = f"reports version {v} after loading {what} v{version}"
        if errors:
            detail = "; ".join(f"engine {i}: {msg}" for i, msg in sorted(errors.items()))
            raise RolloutGroupError(f"push of {what} v{version} failed on {len(errors)} engine(s): {detail}")
        done = [i for i in live if i in times and i not in self.dead]
        if not done:
            raise RolloutGroupError(f"push of {what} v{version}: no live engine left (dead: {sorted(self.dead)})")
        self.policy = (what, version, refs)
        restarted = await self._restart_dead_engines()  # engines found dead by this push, at this version
        per_engine = [times[i][0] for i in done]
        return {
            "version": version,
            "latency_s": max(per_engine),
            "per_engine_s": per_engine,
            "load_s": [times[i][1] for i in done],
            "engines": done,
            "restarted_engines": restarted,
            "dead_engines": sorted(self.dead),
        }

    def _mark_dead(self, index: int, error: BaseException) -> None:
        if index not in self.dead:
            log.warning("engine %d is dead (%s): skipped from now on", index, type(error).__name__)
        self.dead.add(index)

    async def _versions(self, indices: Sequence[int]) -> dict[int, int]:
        from ray.exceptions import RayActorError

        results = await asyncio.gather(*(self.engines[i].version.remote() for i in indices), return_exceptions=True)
        out: dict[int, int] = {}
        for i, r in zip(indices, results, strict=True):
            if isinstance(r, RayActorError):
                self._mark_dead(i, r)
            elif isinstance(r, BaseException):
                raise RolloutGroupError(f"engine {i}: version() failed: {describe(r)}") from r
            else:
                out[i] = int(r)
        return out

    # ------------------------------------------------------------------ introspection

    async def versions(self) -> list[int]:
        """The version each engine gives new requests (-1 for a dead engine)."""
        from ray.exceptions import RayActorError

        live = [(i, h) for i, h in enumerate(self.engines) if i not in self.dead]
        results = await asyncio.gather(*(h.version.remote() for _, h in live), return_exceptions=True)
        out = [-1] * len(self.engines)
        for (i, _), r in zip(live, results, strict=True):
            if isinstance(r, RayActorError):
                self._mark_dead(i, r)
            elif isinstance(r, BaseException):
                raise r
            else:
                out[i] = int(r)
        return out

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


__all__ = ["EngineHost", "RemoteEngine", "RolloutGroup", "RolloutGroupError", "RunnerHost", "core_slice", "cpu_list"]
