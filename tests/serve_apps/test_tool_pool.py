"""The tool pool on real local Ray Serve: handle and MCP-over-HTTP calls, errors, auth, failover."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastmcp import Client

from configs.loader import load_config
from serve_apps.tool_pool import LocalToolPool, ServeToolPool, check_http_security, deploy_pool, undeploy_pool
from tests.conftest import free_port

from .conftest import STDIO_SERVER
from .test_pool_episodes import assert_episodes_isolated

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

BUILTINS = ("polygon", "fmp", "tavily", "slack", "python")
# The MCP Inspector's CLI, installed by `make inspector` (part of `make test`).
INSPECTOR = Path(__file__).resolve().parents[2] / ".cache/inspector/node_modules/.bin/mcp-inspector"

# One valid call per built-in tool; a test checks that this covers every tool the pool lists.
SAMPLE_CALLS: dict[tuple[str, str], dict] = {
    ("polygon", "previous_close"): {"ticker": "AAPL"},
    ("polygon", "daily_aggregates"): {"ticker": "MSFT", "from_date": "2026-11-02", "to_date": "2026-11-06"},
    ("polygon", "ticker_details"): {"ticker": "NVDA"},
    ("fmp", "company_profile"): {"symbol": "AAPL"},
    ("fmp", "income_statement"): {"symbol": "AAPL", "period": "quarter", "limit": 2},
    ("fmp", "key_ratios"): {"symbol": "MSFT", "limit": 1},
    ("tavily", "search"): {"query": "Apple earnings", "max_results": 2},
    ("tavily", "extract"): {"urls": ["https://learn.simfinance.example/earnings-per-share"]},
    ("slack", "list_channels"): {},
    ("slack", "read_history"): {"channel": "general", "limit": 2},
    ("slack", "post_message"): {"channel": "random", "text": "hello from the pool test"},
    ("python", "run_python"): {"code": "print(6 * 7)"},
}


def stdio(name: str, **extra) -> dict:
    """The test's stdio MCP server as an external server."""
    return {"name": name, "command": [sys.executable, STDIO_SERVER], **extra}


def external(*servers: dict) -> str:
    """A `--set` of these external servers."""
    return "tools.external=" + json.dumps(list(servers))


def pool_config(port: int, builtins: bool = True, extra: list[str] = (), url_server: str | None = None):
    servers = [stdio("notes", replicas=2, tool_timeouts={"sleep": 1.0})]
    if url_server:  # a second stdio server and a URL one: several external servers at once
        servers += [stdio("clock"), {"name": "web", "url": url_server}]
    sets = [
        f"tools.http.port={port}",
        external(*servers),
        "tools.servers.python.sandbox.cpu_time_s=1",
        # the CPU limit must fire before any wall-clock one, even when a loaded machine gives the program little CPU
        "tools.servers.python.timeout_s=200",
        "tools.servers.python.sandbox.wall_time_s=120",
    ]
    if not builtins:
        sets += [f"tools.servers.{n}.enabled=false" for n in BUILTINS]
    return load_config(None, [*sets, *extra])


@pytest.fixture(scope="module")
def pool(ray_cluster, notes_url) -> ServeToolPool:
    cfg = pool_config(free_port(), url_server=notes_url)
    pool = deploy_pool(cfg.tools)
    yield pool
    undeploy_pool(pool)


async def test_lists_every_server_and_namespaces_external_tools(pool):
    tools = await pool.list_tools()
    assert set(tools) == {*BUILTINS, "notes", "clock", "web"}
    for name in ("notes", "clock", "web"):
        assert {t["name"] for t in tools[name]} == {f"{name}.{t}" for t in ("echo", "add", "sleep", "whoami")}
    for server, items in tools.items():
        for t in items:
            assert t["inputSchema"]["type"] == "object", (server, t["name"])
            assert t.get("description"), f"{server}.{t['name']} has no description for the model to read"


async def test_samples_cover_every_builtin_tool(pool):
    tools = await pool.list_tools()
    listed = {(server, t["name"]) for server in BUILTINS for t in tools[server]}
    assert listed == set(SAMPLE_CALLS)


@pytest.mark.parametrize(("server", "tool"), list(SAMPLE_CALLS), ids=lambda v: v)
async def test_every_builtin_tool_through_handle_and_http(pool, server, tool):
    args = SAMPLE_CALLS[server, tool]
    by_handle = await pool.call_tool(server, tool, args)
    assert by_handle.ok, by_handle
    assert by_handle.latency_ms > 0 and by_handle.attempts == 1
    async with Client(pool.url(server)) as client:
        by_http = await client.call_tool(tool, args)
    assert not by_http.is_error
    if tool == "post_message":  # not idempotent: each call posts a new message
        assert by_http.structured_content["message"]["text"] == by_handle.structured["message"]["text"]
    elif tool == "run_python":
        assert by_handle.structured["stdout"] == by_http.structured_content["stdout"] == "42\n"
    else:  # offline backends are deterministic: both doors must agree exactly
        assert by_http.structured_content == by_handle.structured


async def test_builtin_bad_arguments_name_the_field(pool):
    r = await pool.call_tool("polygon", "daily_aggregates", {"ticker": "AAPL", "from_date": "2026-11-06"})
    assert r.error_kind == "invalid_arguments" and "to_date" in r.error
    r = await pool.call_tool("fmp", "key_ratios", {"symbol": "AAPL", "limit": 500})
    assert r.error_kind == "invalid_arguments" and "limit" in r.error
    r = await pool.call_tool("polygon", "previous_close", {"ticker": "ZZZZ"})
    assert r.error_kind == "invalid_arguments" and "ZZZZ" in r.error and not r.infra_fault


async def test_sandbox_kill_is_a_named_fault_of_the_call(pool):
    r = await pool.call_tool("python", "run_python", {"code": "while True:\n    pass\n"})
    assert not r.ok and r.error_kind == "sandbox" and "CPU time 1 s" in r.error and not r.infra_fault
    r = await pool.call_tool("python", "run_python", {"code": "raise ValueError('mine')"})
    assert r.ok and r.structured["exit_code"] == 1 and "ValueError: mine" in r.structured["stderr"]


async def test_external_server_by_url(pool):
    """An external server reached over streamable HTTP: here, the pool's own `notes` app."""
    cfg = load_config(
        None,
        [f"tools.servers.{n}.enabled=false" for n in BUILTINS]
        + ["tools.external=" + json.dumps([{"name": "mirror", "url": pool.url("notes")}])],
    )
    local = await LocalToolPool.create(cfg.tools)
    try:
        tools = await local.list_tools()
        assert "mirror.notes.add" in {t["name"] for t in tools["mirror"]}  # namespaced once more
        r = await local.call("mirror.notes.add", {"a": 20, "b": 22})
        assert r.ok and r.structured == {"sum": 42}
        r = await local.call_tool("mirror", "notes.sleep", {"seconds": 5})
        assert not r.ok and "timed out" in r.error  # the remote pool's timeout, reported through the proxy
    finally:
        await local.close()


async def test_live_backend_without_key_is_an_infra_fault(ray_cluster, monkeypatch):
    """A live server with no API key answers `unavailable`: the infrastructure's fault, not the model's."""
    monkeypatch.delenv("TAVILY_API_KEY", raising=False)
    cfg = load_config(None, ["tools.servers.tavily.backend=live"])
    local = await LocalToolPool.create(cfg.tools)
    r = await local.call_tool("tavily", "search", {"query": "anything"})
    assert r.error_kind == "unavailable" and r.infra_fault and "TAVILY_API_KEY" in r.error
    await local.close()


async def test_external_stdio_server_through_handle(pool):
    r = await pool.call("notes.add", {"a": 2, "b": 40})
    assert r.ok and r.structured == {"sum": 42} and r.error_kind is None
    r = await pool.call_tool("notes", "echo", {"text": "héllo"})
    assert r.ok and r.text == "héllo"


async def test_two_stdio_servers_and_a_url_server_on_serve(pool):
    results = await asyncio.gather(
        *(pool.call(f"{s}.add", {"a": 40, "b": i}) for i, s in enumerate(("notes", "clock", "web")))
    )
    assert [r.structured for r in results] == [{"sum": 40}, {"sum": 41}, {"sum": 42}]
    for server in ("clock", "web"):
        async with Client(pool.url(server)) as client:
            res = await client.call_tool(f"{server}.echo", {"text": server})
        assert res.content[0].text == server


async def test_concurrent_episodes_on_serve_through_handles(pool):
    await assert_episodes_isolated(pool)


async def test_episodes_survive_a_pool_of_url_servers_pointing_at_this_pool(pool):
    """A client of the Serve pool over MCP HTTP sends the episode in _meta and ends it with the reserved tool."""
    cfg = load_config(
        None,
        [f"tools.servers.{n}.enabled=false" for n in BUILTINS]
        + ["tools.external=" + json.dumps([{"name": "team", "url": pool.url("slack")}])],
    )
    remote = await LocalToolPool.create(cfg.tools)
    try:

        async def post_then_read(episode: str | None, text: str) -> list[str]:
            await remote.call_tool("team", "post_message", {"channel": "general", "text": text}, episode_id=episode)
            await asyncio.sleep(0.01)
            r = await remote.call_tool("team", "read_history", {"channel": "general", "limit": 50}, episode_id=episode)
            return [m["text"] for m in r.structured["messages"]]

        a, b = await asyncio.gather(post_then_read("url-a", "a over http"), post_then_read("url-b", "b over http"))
        assert a[0] == "a over http" and "b over http" not in a
        assert b[0] == "b over http" and "a over http" not in b
        await remote.end_episode("url-a")
        again = await remote.call_tool("team", "read_history", {"channel": "general", "limit": 50}, episode_id="url-a")
        assert "a over http" not in [m["text"] for m in again.structured["messages"]]
        await remote.end_episode("url-b")
    finally:
        await remote.close()


async def test_timeout_fires_and_is_named(pool):
    r = await pool.call_tool("notes", "sleep", {"seconds": 5})
    assert not r.ok and r.error_kind == "timeout"
    assert 900 <= r.latency_ms < 4500, r.latency_ms  # cut at ~1 s, well before the tool's own 5 s
    assert not r.infra_fault  # a slow tool is the call's problem, not a fault to retry


async def test_unknown_tool_and_unknown_server(pool):
    r = await pool.call_tool("notes", "does_not_exist", {})
    assert not r.ok and r.error_kind == "unknown_tool"
    r = await pool.call_tool("nowhere", "x", {})
    assert not r.ok and r.error_kind == "unknown_tool" and "nowhere" in r.error


async def test_invalid_arguments_name_the_field(pool):
    r = await pool.call_tool("notes", "add", {"a": "three", "b": 1})
    assert not r.ok and r.error_kind == "invalid_arguments" and "a" in r.error
    r = await pool.call_tool("notes", "add", "not an object")  # type: ignore[arg-type]
    assert not r.ok and r.error_kind == "invalid_arguments"


@pytest.mark.parametrize("path", ["prefix/", "prefix", "prefix/mcp"])
async def test_mcp_over_http_with_a_plain_mcp_client(pool, path):
    url = {"prefix/": pool.url("notes"), "prefix": pool.url("notes").rstrip("/")}.get(path, pool.suffixed_url("notes"))
    async with Client(url) as client:
        names = {t.name for t in await client.list_tools()}
        assert "notes.add" in names
        res = await client.call_tool("notes.add", {"a": 1, "b": 2})
        assert res.structured_content == {"sum": 3}
        res = await client.call_tool("notes.sleep", {"seconds": 5}, raise_on_error=False)
        assert res.is_error and "timed out" in res.content[0].text
        assert res.meta["mcprl"]["error_kind"] == "timeout"


def inspector(url: str, *args: str) -> dict:
    """One MCP Inspector CLI call (`mcp-inspector --cli <url> --method ...`); the JSON it prints."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the MCP Inspector's CLI cannot run")
    if not INSPECTOR.exists():
        pytest.skip(f"the MCP Inspector's CLI is not installed at {INSPECTOR}: run `make inspector` (needs npm)")
    done = subprocess.run([str(INSPECTOR), "--cli", url, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"mcp-inspector {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


async def test_mcp_inspector_cli_lists_and_calls_tools(pool):
    """The Inspector's CLI, an outside client, replaces any URL path not ending in /mcp with /mcp, so it
    reaches a server only at `/mcp/<server>/mcp`."""
    url = pool.suffixed_url("polygon")
    assert url.endswith("/mcp/polygon/mcp")
    listed = await asyncio.to_thread(inspector, url, "--method", "tools/list")
    tools = {t["name"]: t for t in listed["tools"]}
    assert set(tools) == {"previous_close", "daily_aggregates", "ticker_details"}
    assert "ticker" in tools["previous_close"]["inputSchema"]["properties"]
    args = ["--method", "tools/call", "--tool-name", "previous_close", "--tool-arg", "ticker=AAPL"]
    called = await asyncio.to_thread(inspector, url, *args)
    direct = await pool.call_tool("polygon", "previous_close", {"ticker": "AAPL"})  # offline: deterministic
    assert direct.ok and not called.get("isError")
    assert called["content"] == [{"type": "text", "text": direct.text}]
    assert called["structuredContent"] == direct.structured


async def test_http_with_two_replicas_answers_every_request(pool):
    """Stateless HTTP: Serve may send each request to either replica; none may fail."""
    async with Client(pool.url("notes")) as client:
        results = await asyncio.gather(*(client.call_tool("notes.add", {"a": i, "b": i}) for i in range(40)))
    assert [r.structured_content["sum"] for r in results] == [2 * i for i in range(40)]


async def test_replica_killed_mid_load_calls_recover(pool):
    import ray

    async def one(i: int):
        return await pool.call_tool("notes", "add", {"a": i, "b": 1})

    tasks = [asyncio.create_task(one(i)) for i in range(60)]
    await asyncio.sleep(0.05)
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "mcp-notes" in a["name"]]
    assert len(replicas) == 2, replicas
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
    tasks += [asyncio.create_task(one(i)) for i in range(60, 120)]
    results = await asyncio.gather(*tasks)
    failed = [r for r in results if not r.ok]
    assert not failed, failed[:3]
    assert [r.structured["sum"] for r in results] == [i + 1 for i in range(120)]


def test_bearer_token_required_beyond_loopback(monkeypatch):
    cfg = pool_config(8000, builtins=False, extra=["tools.http.host=0.0.0.0"])
    with pytest.raises(ValueError, match="bearer token"):
        check_http_security(cfg.tools)
    cfg = pool_config(8000, builtins=False, extra=["tools.http.bearer_token_env=MCPRL_TEST_TOKEN"])
    with pytest.raises(ValueError, match="MCPRL_TEST_TOKEN"):
        check_http_security(cfg.tools)
    monkeypatch.setenv("MCPRL_TEST_TOKEN", "s3cret-token")
    assert check_http_security(cfg.tools) == "s3cret-token"


async def test_bearer_token_guards_http(ray_cluster, pool, monkeypatch):
    """A second pool app behind a token, on the same Serve proxy."""
    monkeypatch.setenv("MCPRL_TEST_TOKEN", "s3cret-token")
    port = int(pool.base_url.rsplit(":", 1)[1])
    cfg = load_config(
        None,
        [f"tools.servers.{n}.enabled=false" for n in BUILTINS]
        + [
            f"tools.http.port={port}",
            "tools.http.bearer_token_env=MCPRL_TEST_TOKEN",
            external(stdio("locked")),
        ],
    )
    locked = deploy_pool(cfg.tools)
    try:
        url = locked.url("locked")
        async with httpx.AsyncClient() as http:
            body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
            headers = {"accept": "application/json, text/event-stream"}
            assert (await http.post(url, json=body, headers=headers)).status_code == 401
            wrong = {**headers, "authorization": "Bearer nope"}
            assert (await http.post(url, json=body, headers=wrong)).status_code == 401
        async with Client(url, auth="s3cret-token") as client:
            assert "locked.echo" in {t.name for t in await client.list_tools()}
        r = await locked.call_tool("locked", "echo", {"text": "handles need no token"})
        assert r.ok
    finally:
        undeploy_pool(locked)


async def test_external_session_reconnects_after_the_server_process_dies():
    """The proxy's persistent stdio session: kill the server process, the next call reconnects."""
    import os
    import signal

    cfg = pool_config(8000, builtins=False)
    # The call after the kill starts a new server process (a Python importing FastMCP) inside its timeout:
    # on a crowded machine that took over 10 s (the call's default) and once 30 s (the open's). What is
    # tested is the reconnect, not its speed.
    notes = cfg.tools.external[0]
    notes.tool_timeouts["whoami"], notes.open_timeout_s = 120.0, 120.0
    local = await LocalToolPool.create(cfg.tools)
    try:
        first = (await local.call_tool("notes", "whoami", {})).structured["pid"]
        os.kill(first, signal.SIGKILL)
        await asyncio.sleep(0.2)
        r = await local.call_tool("notes", "whoami", {})
        assert r.ok, r
        assert r.structured["pid"] != first
    finally:
        await local.close()


def test_every_listener_of_the_embedded_ray_and_the_pool_is_on_loopback(pool) -> None:
    """The embedded default keeps every port on 127.0.0.1: Ray's own, the Serve proxy's, and each replica's
    inter-deployment gRPC server (Ray binds that one to every interface; cluster.ray_env narrows it)."""
    import psutil

    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert len(listening) > 10, listening  # the GCS, raylet, workers, proxy and replicas are all in there
    beyond = [
        (c.laddr, psutil.Process(c.pid).name())
        for c in listening
        if c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")
    ]
    assert not beyond, f"listening beyond loopback: {beyond}"
