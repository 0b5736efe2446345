"""Policy updates of the rollout group's engines: every live engine loads a new adapter or new weights.

Weights travel through the object store once: the driver `ray.put`s an adapter (or weight chunks)
and every engine reads the same object. `push_adapter` passes the ref as a top-level argument, so
Ray resolves it before the engine's method runs (an adapter is small and needed whole; the fetch
is part of the latency we measure from here). `push_weights` passes the chunk refs inside a list,
which Ray does not resolve: the engine awaits them one at a time (`update_weights` awaits
awaitable chunks), so a large model never sits in one engine twice.

Pushes skip engines known dead and report them; when every engine a push reached died under it, they are
restarted (within `rollout.max_engine_restarts`) and the push goes again. A live engine that fails to load,
or reports another version afterwards, is an error naming that engine. The last successful push is kept
(`policy`), so an engine restarted later loads it before it serves (orchestration/rollout_group.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from configs.schema import Config
from orchestration.rollout_actors import RolloutGroupError, describe

log = logging.getLogger(__name__)


class PolicyPushes:
    """The push side of `RolloutGroup` (its base class): the engines, which are dead, and the last push."""

    engines: list[Any]  # engine actor handles, index = engine id
    dead: set[int]  # engines known dead
    # The last successful push, loaded into a restarted engine: ("adapter" | "weights", version, ref(s)).
    policy: tuple[str, int, Any] | None
    cfg: Config
    engine_restarts: int  # restarts spent, of rollout.max_engine_restarts

    async def _restart_dead_engines(self) -> list[int]:
        """Restart the dead engines at the current policy (RolloutGroup's); the engines restarted."""
        raise NotImplementedError

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

        async def one(i: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            load_s = await call(self.engines[i])  # the engine's own timing (EngineHost)
            return time.perf_counter() - t0, float(load_s)

        while True:
            await self._restart_dead_engines()  # at the old policy: then this push loads the new one
            live = [i for i in range(len(self.engines)) if i not in self.dead]
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
            if done:
                break
            # Every engine this push reached died under it (killed just before, or while loading): restart
            # them, within rollout.max_engine_restarts, and push again; with none left, the push fails.
            if not live or self.engine_restarts >= self.cfg.rollout.max_engine_restarts:
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
