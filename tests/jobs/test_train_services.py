"""How a job's tools come up while its engines start (`jobs.train_services.ToolsStart`), on real local Ray Serve:
Serve, then the pool, each on a thread; a failure reaches the rollout group's start, and nothing is left deployed."""

from __future__ import annotations

import pytest
from ray import serve

from configs.loader import load_config
from jobs.train_services import Services, ToolsStart
from serve_apps.tool_pool import APP_PREFIX, ServeToolPool
from tests.conftest import free_port

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

OFF = [f"tools.servers.{name}.enabled=false" for name in ("fmp", "tavily", "slack", "python")]


def apps() -> set[str]:
    return {name for name in serve.status().applications if name.startswith(APP_PREFIX)}


async def test_the_pool_deploys_on_its_own_and_close_removes_it(ray_cluster) -> None:
    cfg = load_config(None, [f"tools.http.port={free_port()}", "run_name=tools-start", *OFF])
    up = Services()
    starting = ToolsStart(cfg, up, judge=False)
    at = await starting.serving
    pool, judge = await starting.tools()
    assert isinstance(pool, ServeToolPool) and judge is None and up.pool is pool
    assert at.host == "127.0.0.1" and pool.base_url.startswith("http://127.0.0.1:")
    assert (await pool.call_tool("polygon", "previous_close", {"ticker": "AAPL"})).ok
    assert APP_PREFIX + "polygon" in apps()
    await up.close()
    assert APP_PREFIX + "polygon" not in apps()


async def test_a_serve_that_cannot_start_fails_the_tools_and_leaves_nothing(ray_cluster, monkeypatch) -> None:
    monkeypatch.delenv("MCPRL_UNSET_TOKEN", raising=False)
    cfg = load_config(None, ["tools.http.bearer_token_env=MCPRL_UNSET_TOKEN", *OFF])
    up = Services()
    starting = ToolsStart(cfg, up, judge=False)
    with pytest.raises(ValueError, match="bearer_token_env names MCPRL_UNSET_TOKEN, which is not set"):
        await starting.tools()
    await up.close()  # waits for the failed deployment; the caller's own error is the one reported
    assert up.pool is None and starting.deployed.done()
