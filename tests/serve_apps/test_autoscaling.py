"""A tool deployment under Serve autoscaling: load grows it, quiet shrinks it, and each replica's share of the
service's rate limit follows the number of replicas running (real Serve on the session's Ray)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from configs.loader import load_config
from serve_apps.tool_pool import REPLICA_COUNT_PERIOD_S, deploy_pool, running_replicas, undeploy_pool
from tests.conftest import free_port

from .conftest import STDIO_SERVER
from .test_tool_pool import BUILTINS, external, stdio

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

RATE = 1000.0  # calls/s for the whole service: far above the load, so it only shows the split
# Bounds, not timings: how long Serve may take to act on a sustained change in load (its delays are ~1 s here).
SCALE_DEADLINE_S = 60.0
SHARE_DEADLINE_S = REPLICA_COUNT_PERIOD_S * 3 + 10


def sleepy_config() -> Any:
    server = stdio(
        "sleepy",
        rate_limit_per_s=RATE,
        replica_resources={"num_cpus": 0.05},
        tool_timeouts={"sleep": 30},
        autoscaling={
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 1,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 1,
            "look_back_period_s": 1,
            "metrics_interval_s": 0.5,
        },
    )
    assert server["command"][1] == STDIO_SERVER
    sets = [f"tools.http.port={free_port()}", external(server), *[f"tools.servers.{n}.enabled=false" for n in BUILTINS]]
    return load_config(None, sets)


async def wait_for(what: str, check: Any, deadline_s: float) -> Any:
    """Poll `check()` (async) until it returns something truthy; fail naming `what` past the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < end, f"{what}: not within {deadline_s:.0f} s"
        await asyncio.sleep(0.3)


async def shares(handle: Any, replicas: int) -> dict[str, dict] | None:
    """Each running replica's view {replica id: {replicas, rate_per_s}}, once `replicas` distinct ones answered."""
    seen: dict[str, dict] = {}
    for _ in range(12 * replicas):  # Serve picks replicas at random: enough tries to meet them all
        answer = await handle.rate_limit_share.remote()
        seen[answer["replica"]] = answer
        if len(seen) == replicas:
            return seen
    return None


async def test_load_grows_the_deployment_quiet_shrinks_it_and_the_rate_share_follows(ray_cluster) -> None:
    cfg = sleepy_config()
    pool = deploy_pool(cfg.tools)
    handle = pool.handles["sleepy"]

    async def running() -> int:
        return await asyncio.to_thread(running_replicas, "mcp-sleepy", "sleepy")

    async def share_is(n: int) -> bool:
        seen = await shares(handle, n)
        return bool(seen) and all(s["replicas"] == n and s["rate_per_s"] == RATE / n for s in seen.values())

    stop = asyncio.Event()

    async def caller() -> None:
        while not stop.is_set():
            result = await pool.call("sleepy.sleep", {"seconds": 0.5})
            assert result.ok, result.error

    try:
        await wait_for("one replica, holding the whole limit", lambda: share_is(1), SHARE_DEADLINE_S)
        load = [asyncio.create_task(caller()) for _ in range(6)]  # 6 calls in flight, target 1 per replica
        try:
            await wait_for("load grows the deployment to 2", lambda: _equals(running, 2), SCALE_DEADLINE_S)
            await wait_for("each of 2 replicas holds half the limit", lambda: share_is(2), SHARE_DEADLINE_S)
            assert await running() == 2  # bounded by max_replicas, even under load
        finally:
            stop.set()
            await asyncio.gather(*load)
        await wait_for("quiet shrinks it back to 1", lambda: _equals(running, 1), SCALE_DEADLINE_S)
        await wait_for("the last replica holds the whole limit again", lambda: share_is(1), SHARE_DEADLINE_S)
    finally:
        undeploy_pool(pool)


async def _equals(get: Any, want: int) -> bool:
    return await get() == want
