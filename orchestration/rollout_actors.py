"""The rollout group's actors: plain classes that `RolloutGroup` (orchestration/rollout_group.py) runs as
Ray actors, and the handle wrapper that lets a runner use an engine actor like a local engine.

- `EngineHost` (one per engine): builds `make_engine(cfg)` inside the actor and starts it there, so the
  model (and vLLM's engine-core process) lives with the actor. On CPU, engines placed on the same node
  share its cores: vLLM engine k of n runs on its own slice (this process's affinity and OMP_NUM_THREADS,
  which the engine core inherits; orchestration/cpu_pinning.py); an HF engine sets
  `torch.set_num_threads(cores // n)` (Ray sets OMP_NUM_THREADS=1 for actors with fractional CPUs,
  which would leave torch on one thread).
- `RunnerHost` (one per runner): an `EpisodeRunner` over `RemoteEngine` wrappers of ALL engines, so each
  runner routes episodes least-loaded across every engine and fails over when one dies. Its
  environments reach the tools through the `ServeToolPool` given to the group and the judge through the
  judge deployment's handle (Serve handles pickle); both are passed to the runner explicitly, nothing is
  registered in module globals. With no judge given (an in-process judge does not pickle), each runner
  builds its own from `reward.judge`.
- `RemoteEngine`: an engine actor's handle, raising what a local engine would (see its doc).
"""

from __future__ import annotations

import os
import time
from typing import Any

from actors.engine_api import EngineError, EngineUnavailable, Generation, choose_backend
from actors.engines import make_engine
from actors.models import load_tokenizer
from actors.trajectory import Trajectory
from cluster.console import quiet_third_party
from cluster.metrics import ENGINE_POLICY_VERSION, metrics_run, record
from configs.schema import Config, SamplingConfig
from orchestration.cpu_pinning import core_slice, cpu_list, node_cores


class RolloutGroupError(RuntimeError):
    """A group operation failed on named engines or runners."""


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
        quiet_third_party()  # this actor's process: the libraries' routine output (cluster/console.py)
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
            # The engine core vLLM spawns from this process inherits its cores and its threads (actors/vllm_engine.py).
            if hasattr(os, "sched_setaffinity"):  # Linux; elsewhere the engines share every core
                os.sched_setaffinity(0, cores)
            os.environ["OMP_NUM_THREADS"] = str(len(cores))  # Ray's 1 (fractional CPUs) would leave it one core
            placement["cpu_bind"] = cpu_list(cores)
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

        quiet_third_party()  # this actor's process: Serve's lines about its handles (cluster/console.py)
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
