"""Secrets reach the replicas that need them, set after Ray started, and never the dashboard's view."""

from __future__ import annotations

import json

import pytest

from configs.loader import load_config
from serve_apps.tool_pool import ServerSpec, deploy_pool, secrets_for, undeploy_pool
from tests.conftest import free_port
from tests.mcp_servers.standins import StandIn

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

KEY = "tvly-serve-SECRET-4242"


def test_secrets_for_names_only_what_a_server_uses(monkeypatch):
    monkeypatch.setenv("TAVILY_API_KEY", "t")
    monkeypatch.setenv("FMP_API_KEY", "f")
    monkeypatch.setenv("NOTES_TOKEN", "n")
    cfg = load_config(
        None,
        [
            "tools.external="
            + json.dumps([{"name": "notes", "url": "http://127.0.0.1:1/", "headers": {"X": "${NOTES_TOKEN}"}}])
        ],
    )
    assert secrets_for(ServerSpec("tavily", cfg.tools.servers.tavily)) == {"TAVILY_API_KEY": "t"}
    assert secrets_for(ServerSpec("python", cfg.tools.servers.python)) == {}
    assert secrets_for(ServerSpec("notes", cfg.tools.external[0], external=True)) == {"NOTES_TOKEN": "n"}


async def test_live_key_reaches_the_replica_and_the_api(ray_cluster, monkeypatch):
    from ray import serve

    monkeypatch.setenv("TAVILY_API_KEY", KEY)  # set after Ray started: must travel with the deployment
    with StandIn() as api:
        sets = [f"tools.servers.{n}.enabled=false" for n in ("polygon", "fmp", "slack", "python")]
        sets += [
            f"tools.http.port={free_port()}",
            "tools.servers.tavily.backend=live",
            f"tools.servers.tavily.base_url={api.url}",
        ]
        pool = deploy_pool(load_config(None, sets).tools)
        try:
            r = await pool.call_tool("tavily", "search", {"query": "NVDA earnings", "max_results": 2})
            assert r.ok, r
            assert api.requests[-1].headers["authorization"] == f"Bearer {KEY}"
            # What Serve reports of the app (and the dashboard shows) carries no secret: no runtime_env.
            assert KEY not in repr(serve.status().applications["mcp-tavily"])
        finally:
            undeploy_pool(pool)
