"""EpisodeRunner: plays many multi-turn MCPToolEnv episodes concurrently against rollout engines.

One episode: `env.ainit` → prompt ids from the chat template → generate → decode → `env.astep`
→ observation ids → generate … until the env says done, `max_turns`, or `max_total_tokens`.

How prompts, end-of-turn ids and observation deltas come from the chat template, token for token:
`actors/template_tokens.py`.

Routing: an episode sticks to one engine for its life, chosen least-loaded (fewest live episodes)
among engines not marked dead. `EngineError` is the request's fault (prompt too long, ...): the
episode ends as `engine_failed`, infra-flagged, and the engine stays in service. Any other
exception from `generate` means the engine died: it is marked dead (until `replace_engine`) and each
of its episodes restarts from scratch (a fresh env) on another engine, up to
`rollout.max_episode_restarts` times; then (or with no engine left) the episode comes back as
infra_fault / `engine_failed`. `TurnDoesNotFit` (an EngineError: a scripted engine will not start a
turn longer than the room left) ends the episode at the token budget, not as a failure. Every
episode comes back exactly once, in input order.

Modes (`rollout.mode`): `async` — each episode moves on as soon as its own generation and tools
return; `lockstep` — episodes go in waves (all of them, or `max_concurrent_episodes` at a time)
and every episode of a wave takes turn k before any takes turn k+1 (a barrier before each turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.engine_api import EngineError, Generation, TurnDoesNotFit
from actors.template_tokens import ChatTemplate, env_config_for
from actors.trajectory import Trajectory
from configs.schema import Config, SamplingConfig
from envs.mcp_tool_env import MCPToolEnv

if TYPE_CHECKING:
    from envs.judge import JudgeLike

log = logging.getLogger(__name__)


class EngineDied(RuntimeError):
    """Raised inside the runner when an episode's engine failed fatally; triggers a restart."""


# --------------------------------------------------------------------------- bookkeeping


@dataclass
class _Episode:
    task: dict[str, Any]
    group_id: int
    sample_index: int
    task_id: str
    sampling: SamplingConfig | None = None  # this run's override of cfg.rollout.sampling
    restarts: int = 0
    engine: int = -1
    result: Trajectory | None = None


@dataclass
class _Stats:
    total: int = 0
    done: int = 0
    running: int = 0
    failed: int = 0
    restarts: int = 0
    generated_tokens: int = 0
    started_at: float = 0.0
    finished_at: float | None = None
    by_finish: dict[str, int] = field(default_factory=dict)


class _Barrier:
    """Lockstep: every live episode of a wave arrives before any of them proceeds; finishers leave."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.arrived = 0
        self.event = asyncio.Event()

    async def wait(self) -> None:
        self.arrived += 1
        event = self.event
        if self.arrived >= self.parties:
            self._release()
        else:
            await event.wait()

    def leave(self) -> None:
        self.parties -= 1
        if self.arrived and self.arrived >= self.parties:
            self._release()

    def _release(self) -> None:
        event, self.event, self.arrived = self.event, asyncio.Event(), 0
        event.set()


class _NoBarrier:
    async def wait(self) -> None:
        return None

    def leave(self) -> None:
        return None


# --------------------------------------------------------------------------- the runner


class EpisodeRunner:
    """Plays episodes of `tasks` (SkyRL rows) on `engines` (RolloutEngine-likes, already started)."""

    def __init__(
        self,
        cfg: Config,
        engines: Sequence[Any],
        tokenizer: Any,
        *,
        max_concurrent_episodes: int | None = None,
        progress: bool | None = None,
        tool_client: Any = None,
        judge: JudgeLike | None = None,
    ) -> None:
        """`tool_client` / `judge`: what every episode's env uses (None = built from the config, per process)."""
        if not engines:
            raise ValueError("EpisodeRunner needs at least one engine")
        self.cfg = cfg
        self.engines = list(engines)
        self.template = ChatTemplate(tokenizer)
        self.tokenizer = tokenizer
        self.tool_client = tool_client
        self.judge = judge
        self.env_cfg = env_config_for(cfg.env, self.template)
        self.max_concurrent = max_concurrent_episodes
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.load = [0] * len(self.engines)  # live episodes per engine
        self.dead: set[int] = set()
        self._stats = _Stats()

    # ------------------------------------------------------------------ public

    async def run(
        self, tasks: Sequence[dict[str, Any]], group_size: int, sampling: SamplingConfig | None = None
    ) -> list[Trajectory]:
        """`group_size` episodes of each task; trajectories in input order (task-major).

        `sampling` replaces `cfg.rollout.sampling` for this call (e.g. greedy evaluation)."""
        if group_size < 1:
            raise ValueError("group_size must be >= 1")
        episodes = [
            _Episode(task=dict(task), group_id=g, sample_index=s, task_id=_task_id(task, g), sampling=sampling)
            for g, task in enumerate(tasks)
            for s in range(group_size)
        ]
        self._stats = _Stats(total=len(episodes), started_at=time.perf_counter())
        with self._progress_bar() as tick:
            if self.cfg.rollout.mode == "lockstep":
                size = self.max_concurrent or len(episodes) or 1
                for start in range(0, len(episodes), size):
                    wave = episodes[start : start + size]
                    barrier = _Barrier(len(wave))
                    await asyncio.gather(*(self._play(e, barrier, tick) for e in wave))
            else:
                limit = asyncio.Semaphore(self.max_concurrent or max(1, len(episodes)))

                async def bounded(e: _Episode) -> None:
                    async with limit:
                        await self._play(e, _NoBarrier(), tick)

                await asyncio.gather(*(bounded(e) for e in episodes))
        self._stats.finished_at = time.perf_counter()
        out = [e.result for e in episodes]
        assert all(t is not None for t in out)  # _play always sets a result
        return [t for t in out if t is not None]

    def stats(self) -> dict[str, Any]:
        s = self._stats
        end = s.finished_at if s.finished_at is not None else time.perf_counter()
        elapsed = max(end - s.started_at, 1e-9) if s.started_at else 0.0
        return {
            "episodes": s.total,
            "done": s.done,
            "running": s.running,
            "failed": s.failed,
            "restarts": s.restarts,
            "generated_tokens": s.generated_tokens,
            "tokens_per_s": s.generated_tokens / elapsed if elapsed else 0.0,
            "episodes_per_s": s.done / elapsed if elapsed else 0.0,
            "elapsed_s": elapsed,
            "finish_reasons": dict(s.by_finish),
            "engine_load": list(self.load),
            "dead_engines": sorted(self.dead),
            "delta_fallbacks": self.template.delta_fallbacks,
        }

    def replace_engine(self, index: int, engine: Any) -> None:
        """Engine `index` was restarted: route to `engine` from now on (episodes still on the old one
        fail over as before, without marking the new one dead)."""
        if not 0 <= index < len(self.engines):
            raise IndexError(f"engine {index} is out of range ({len(self.engines)} engines)")
        self.engines[index] = engine
        self.dead.discard(index)

    # ------------------------------------------------------------------ episodes

    async def _play(self, ep: _Episode, barrier: _Barrier | _NoBarrier, tick: Any) -> None:
        """Play `ep` to a result, restarting on another engine when its engine dies."""
        self._stats.running += 1
        try:
            while True:
                engine = self._pick_engine()
                if engine is None:
                    ep.result = self._failed(ep, ep.result, "no live engine left")
                    return
                ep.engine = engine
                self.load[engine] += 1
                handle = self.engines[engine]  # what _attempt uses: it reads it before its first await
                try:
                    ep.result = await self._attempt(ep, engine, barrier)
                    return
                except EngineDied as e:
                    if self.engines[engine] is handle:  # not already replaced by a restarted engine
                        self.dead.add(engine)
                    partial = e.args[1] if len(e.args) > 1 else None
                    if ep.restarts >= self.cfg.rollout.max_episode_restarts:
                        ep.result = self._failed(ep, partial, f"engine {engine} died; restarts exhausted")
                        return
                    ep.restarts += 1
                    self._stats.restarts += 1
                    log.warning("engine %d died (%s); restarting %s#%d", engine, e.args[0], ep.task_id, ep.sample_index)
                finally:
                    self.load[engine] -= 1
        finally:
            barrier.leave()
            self._stats.running -= 1
            traj = ep.result
            if traj is not None:
                traj.restarts = ep.restarts
                self._stats.done += 1
                self._stats.failed += traj.infra_fault
                self._stats.by_finish[traj.finish_reason] = self._stats.by_finish.get(traj.finish_reason, 0) + 1
            tick()

    def _pick_engine(self) -> int | None:
        alive = [i for i in range(len(self.engines)) if i not in self.dead]
        return min(alive, key=lambda i: (self.load[i], i)) if alive else None

    def _failed(self, ep: _Episode, partial: Trajectory | None, why: str) -> Trajectory:
        traj = partial or Trajectory(task_id=ep.task_id, group_id=ep.group_id, sample_index=ep.sample_index)
        traj.infra_fault = True
        traj.finish_reason = "engine_failed"
        traj.env_metadata = traj.env_metadata[: traj.turns]
        log.warning("episode %s#%d failed: %s", ep.task_id, ep.sample_index, why)
        return traj

    async def _attempt(self, ep: _Episode, engine_index: int, barrier: _Barrier | _NoBarrier) -> Trajectory:
        """One attempt of an episode on one engine. Raises EngineDied (with the partial trajectory)."""
        cfg = self.cfg
        budget = cfg.rollout.max_total_tokens
        engine = self.engines[engine_index]
        t0 = time.perf_counter()
        gen_s = env_s = wait_s = 0.0
        env_config = {"env": self.env_cfg, "reward": cfg.reward, "tools": cfg.tools}
        env = MCPToolEnv(env_config, extras=ep.task, tool_client=self.tool_client, judge=self.judge)
        messages, info = await env.ainit(None)
        tools = info["tool_definitions"]  # for the template's tools= (empty: they are in the system message)
        traj = Trajectory(task_id=ep.task_id, group_id=ep.group_id, sample_index=ep.sample_index, engine=engine_index)
        traj.messages = [dict(m) for m in messages]
        tmpl = self.template
        traj.prompt_ids = tmpl.prompt_ids(messages, tools)
        try:
            while True:
                used = len(traj.prompt_ids) + len(traj.response_ids)
                # Room for at least one token plus closing the turn, or the turn cannot be rendered whole.
                room = budget - used - len(tmpl.eot_ids)
                if room < 1:
                    traj.finish_reason = "token_budget"
                    break
                t = time.perf_counter()
                await barrier.wait()
                wait_s += time.perf_counter() - t
                sampling = _turn_sampling(_capped(ep.sampling or cfg.rollout.sampling, room), ep, traj.turns)
                t = time.perf_counter()
                try:
                    gen: Generation = await engine.generate(traj.prompt_ids + traj.response_ids, sampling)
                except TurnDoesNotFit:
                    traj.finish_reason = "token_budget"
                    break
                except EngineError as e:  # this request's fault, not the engine's: no restart
                    log.warning("engine %d refused a request of %s: %s", engine_index, ep.task_id, e)
                    traj.infra_fault = True
                    traj.finish_reason = "engine_failed"
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    raise EngineDied(f"{type(e).__name__}: {e}", traj) from e
                gen_s += time.perf_counter() - t
                ids = [int(i) for i in gen.token_ids][:room]
                logprobs, missing = self._logprobs(gen, len(ids))
                traj.missing_logprobs += missing
                self._stats.generated_tokens += len(ids)
                text = self.tokenizer.decode(ids, skip_special_tokens=True)

                t = time.perf_counter()
                out = await env.astep(text)
                env_s += time.perf_counter() - t
                # Stopped on a stop string or the length limit: close the turn as the template would.
                closing = [] if tmpl.ends_turn(ids) else tmpl.eot_ids
                traj.add_turn(ids, logprobs, text, out, closing=closing, version=gen.version, finish=gen.finish_reason)
                meta = traj.env_metadata[-1]
                if out["done"]:
                    traj.finish_reason = "max_turns" if meta.get("done_reason") == "max_turns" else "done"
                    break
                observations = [dict(m) for m in out["observations"]]
                delta = tmpl.observation_delta(traj.messages, observations, tools)
                if not traj.add_observations(observations, delta, budget):
                    break
        finally:
            await env.aclose()
            traj.reward = math.fsum(traj.turn_rewards)
            traj.tool_stats = env.get_metrics()
            traj.timings = {
                "generate_s": gen_s,
                "env_s": env_s,
                "wait_s": wait_s,
                "total_s": time.perf_counter() - t0,
            }
        return traj

    def _logprobs(self, gen: Generation, n: int) -> tuple[list[float], int]:
        """The engine's logprobs for n ids; absent or non-finite ones floored (and counted)."""
        floor = self.cfg.rollout.missing_logprob_floor
        raw = list(gen.logprobs)[:n]
        out: list[float] = []
        fixed = 0
        for i in range(n):
            value = raw[i] if i < len(raw) else None
            if value is None or not math.isfinite(float(value)):
                out.append(floor)
                fixed += 1
            else:
                out.append(min(float(value), 0.0))
        return out, max(fixed, int(gen.missing_logprobs or 0))

    # ------------------------------------------------------------------ progress

    @contextlib.contextmanager
    def _progress_bar(self) -> Iterator[Any]:
        if not self.progress:
            yield lambda: None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("episodes"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            transient=True,
        ) as bar:
            task = bar.add_task("episodes", total=self._stats.total, info="")

            def tick() -> None:
                s = self.stats()
                info = f"running {s['running']} failed {s['failed']} restarts {s['restarts']} "
                info += f"{s['tokens_per_s']:.0f} tok/s"
                bar.update(task, completed=s["done"], info=info)

            yield tick


def _capped(sampling: SamplingConfig, room: int) -> SamplingConfig:
    if sampling.max_new_tokens <= room:
        return sampling
    return sampling.model_copy(update={"max_new_tokens": room})


def _turn_sampling(sampling: SamplingConfig, ep: _Episode, turn: int) -> SamplingConfig:
    """With a seed, each generation gets its own, derived from (seed, episode, turn): the G samples of
    a group differ, and a rerun (a resumed training run) draws the same tokens. A restart on another
    engine reuses the seeds, so a restarted episode is the episode it replaces."""
    if sampling.seed is None:
        return sampling
    key = f"{sampling.seed}|{ep.group_id}|{ep.task_id}|{ep.sample_index}|{turn}".encode()
    return sampling.model_copy(update={"seed": int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big")})


def _task_id(task: dict[str, Any], index: int) -> str:
    spec = task.get("reward_spec") or {}
    gt = spec.get("ground_truth") if isinstance(spec, dict) else None
    tid = gt.get("task_id") if isinstance(gt, dict) else None
    return str(tid or task.get("task_id") or f"task-{index}")


__all__ = ["EngineDied", "EpisodeRunner"]
