"""The in-process pool with several external servers, its timeouts, and per-episode tool state."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
from fastmcp import FastMCP

from configs.loader import load_config
from configs.schema import ExternalServer, SlackConfig
from serve_apps.tool_pool import LocalToolPool, ToolPoolTimeout

from .conftest import STDIO_SERVER

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

BUILTINS = ("polygon", "fmp", "tavily", "slack", "python")


def tools_config(external: list[dict], builtins: tuple[str, ...] = (), extra: list[str] = ()):
    sets = [f"tools.servers.{n}.enabled=false" for n in BUILTINS if n not in builtins]
    return load_config(None, [*sets, "tools.external=" + json.dumps(external), *extra]).tools


def stdio(name: str, *args: str, **extra) -> dict:
    return {"name": name, "command": [sys.executable, STDIO_SERVER, *args], **extra}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --------------------------------------------------------------------------- several external servers


async def test_two_stdio_servers_and_a_url_server_in_one_pool(notes_url):
    cfg = tools_config([stdio("git"), stdio("time"), {"name": "web", "url": notes_url}])
    pool = await LocalToolPool.create(cfg)
    try:
        tools = await pool.list_tools()
        assert {s: sorted(t["name"] for t in ts) for s, ts in tools.items()} == {
            s: [f"{s}.add", f"{s}.echo", f"{s}.sleep", f"{s}.whoami"] for s in ("git", "time", "web")
        }
        results = await asyncio.gather(*(pool.call(f"{s}.add", {"a": i, "b": 40}) for i, s in enumerate(tools)))
        assert [r.structured for r in results] == [{"sum": 40}, {"sum": 41}, {"sum": 42}]
        pids = [(await pool.call_tool(s, "whoami", {})).structured["pid"] for s in ("git", "time")]
        assert len(set(pids)) == 2 and all(alive(p) for p in pids)
    finally:
        await pool.close()
    await asyncio.sleep(0.5)
    assert not any(alive(p) for p in pids), "closing the pool must end its stdio programs"


def test_a_process_with_two_stdio_servers_exits(notes_url):
    """The reported hang: asyncio.run of a pool with two stdio servers never returned (e.g. validate_tasks)."""
    code = (
        "import asyncio, json, sys\n"
        "from serve_apps.tool_pool import LocalToolPool\n"
        "from configs.schema import ToolsConfig\n"
        "async def main():\n"
        "    pool = await LocalToolPool.create(ToolsConfig.model_validate(json.loads(sys.argv[1])))\n"
        "    try:\n"
        "        print(sorted(await pool.list_tools()), (await pool.call('b.add', {'a': 1, 'b': 2})).structured)\n"
        "    finally:\n"
        "        await pool.close()\n"
        "asyncio.run(main())\n"
    )
    cfg = tools_config([stdio("a"), stdio("b"), {"name": "web", "url": notes_url}])
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code, cfg.model_dump_json()], capture_output=True, text=True, timeout=90, cwd=os.getcwd()
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['a', 'b', 'web'] {'sum': 3}"
    assert time.monotonic() - start < 60


async def test_a_server_that_never_answers_is_named_in_bounded_time():
    cfg = tools_config([stdio("notes"), stdio("mute", "--silent", open_timeout_s=1.5)])
    start = time.monotonic()
    with pytest.raises(ToolPoolTimeout, match=r"server 'mute' did not answer open within 1.5s"):
        await LocalToolPool.create(cfg)
    assert time.monotonic() - start < 15  # 1.5 s, plus stopping the silent program (a grace period, then a kill)

    from serve_apps.tool_pool import make_host, server_specs

    pool = LocalToolPool({s.name: await make_host(s) for s in server_specs(cfg)})
    try:
        r = await pool.call_tool("mute", "echo", {"text": "hi"})
        assert r.error_kind == "unavailable" and r.infra_fault and "'mute' did not answer open within 1.5s" in r.error
        with pytest.raises(ToolPoolTimeout, match="'mute' did not answer open"):
            await pool.list_tools()
        assert (await pool.call_tool("notes", "echo", {"text": "hi"})).text == "hi"  # the others still work
    finally:
        await pool.close()


# --------------------------------------------------------------------------- episodes


async def post_then_read(pool, episode_id: str | None, text: str) -> list[str]:
    posted = await pool.call_tool("slack", "post_message", {"channel": "random", "text": text}, episode_id=episode_id)
    assert posted.ok, posted
    await asyncio.sleep(0.01)  # let the other episode write in between
    history = await pool.call_tool("slack", "read_history", {"channel": "random", "limit": 100}, episode_id=episode_id)
    return [m["text"] for m in history.structured["messages"]]


async def assert_episodes_isolated(pool) -> None:
    """Two concurrent episodes each post and read; each sees only its own post; end_episode drops the state."""
    a, b = await asyncio.gather(post_then_read(pool, "ep-a", "from a"), post_then_read(pool, "ep-b", "from b"))
    assert a[0] == "from a" and "from b" not in a
    assert b[0] == "from b" and "from a" not in b
    assert a[1:] == b[1:]  # both started from the same fixture
    shared = await post_then_read(pool, None, "shared")  # no episode: the shared workspace, untouched by episodes
    assert shared[0] == "shared" and not {"from a", "from b"} & set(shared)
    await pool.end_episode("ep-a")
    await pool.end_episode("ep-a")  # idempotent
    r = await pool.call_tool("slack", "read_history", {"channel": "random", "limit": 100}, episode_id="ep-a")
    assert [m["text"] for m in r.structured["messages"]] == a[1:]  # the episode's post is gone: fixture again
    r = await pool.call_tool("slack", "read_history", {"channel": "random", "limit": 100}, episode_id="ep-b")
    assert r.structured["messages"][0]["text"] == "from b"  # ending one episode leaves the others
    await pool.end_episode("ep-a")
    await pool.end_episode("ep-b")


async def test_concurrent_episodes_see_only_their_own_slack_posts():
    pool = await LocalToolPool.create(tools_config([], builtins=("slack",)))
    try:
        await assert_episodes_isolated(pool)
    finally:
        await pool.close()


async def test_stateful_external_server_gets_one_process_per_episode():
    pool = await LocalToolPool.create(tools_config([stdio("notes", stateful=True)]))
    try:

        async def pid(episode: str | None) -> int:
            return (await pool.call_tool("notes", "whoami", {}, episode_id=episode)).structured["pid"]

        shared, a, b = await asyncio.gather(pid(None), pid("ep-a"), pid("ep-b"))
        assert len({shared, a, b}) == 3
        assert await pid("ep-a") == a  # the episode keeps its session
        await pool.end_episode("ep-a")
        await asyncio.sleep(0.5)
        assert not alive(a) and alive(b) and alive(shared)
        assert await pid("ep-a") not in (a, b, shared)  # a late call starts afresh
    finally:
        await pool.close()
    await asyncio.sleep(0.5)
    assert not alive(b) and not alive(shared)


async def test_a_stateless_external_server_shares_one_session():
    pool = await LocalToolPool.create(tools_config([stdio("notes")]))
    try:
        pids = {(await pool.call_tool("notes", "whoami", {}, episode_id=e)).structured["pid"] for e in ("a", "b", None)}
        assert len(pids) == 1
        await pool.end_episode("a")  # nothing to drop: fine
    finally:
        await pool.close()


def test_stateful_servers_run_one_replica():
    with pytest.raises(ValueError, match=r"stateful external server 'git' .* runs one replica"):
        ExternalServer(name="git", command=["git-mcp"], stateful=True, replicas=2)
    with pytest.raises(ValueError, match=r"offline slack workspace .* runs one replica"):
        SlackConfig(autoscaling={"max_replicas": 3})
    assert SlackConfig(backend="live", replicas=2).replicas == 2  # the live one has no state of its own


async def test_http_front_carries_the_episode_in_meta():
    """The front (what Serve serves over HTTP) reads the episode from `_meta` and ends it with the reserved tool."""
    from fastmcp import Client

    from serve_apps.mcp_front import build_front
    from serve_apps.tool_host import END_EPISODE_TOOL, EPISODE_META

    pool = await LocalToolPool.create(tools_config([], builtins=("slack",)))
    host = pool.hosts["slack"]
    front: FastMCP = build_front(host, await host.list_tools())
    async with Client(front) as client:
        assert END_EPISODE_TOOL not in {t.name for t in await client.list_tools()}  # models never see it
        meta = {EPISODE_META: "ep-x"}
        await client.call_tool("post_message", {"channel": "random", "text": "x"}, meta=meta)
        read = await client.call_tool("read_history", {"channel": "random", "limit": 1}, meta=meta)
        assert read.structured_content["messages"][0]["text"] == "x"
        shared = await client.call_tool("read_history", {"channel": "random", "limit": 1})
        assert shared.structured_content["messages"][0]["text"] != "x"
        ended = await client.call_tool(END_EPISODE_TOOL, {}, meta=meta)
        assert "ep-x" in ended.content[0].text
        read = await client.call_tool("read_history", {"channel": "random", "limit": 1}, meta=meta)
        assert read.structured_content["messages"][0]["text"] != "x"
        res = await client.call_tool(END_EPISODE_TOOL, {}, raise_on_error=False)
        assert res.is_error and EPISODE_META in res.content[0].text
    await pool.close()
