"""The slack server: the offline SQLite workspace and the live backend against a local stand-in."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastmcp import Client, FastMCP
from fastmcp.exceptions import ValidationError

from configs.schema import LiveService, SlackConfig
from mcp_servers import build_server
from mcp_servers.episodes import current_episode, end_episode_hook
from mcp_servers.errors import InvalidArguments, Unavailable, UpstreamError

from .standins import HTTP_FAULTS, assert_documented, call, fault

SERVER = "slack"
CONFIG = SlackConfig
KEY_ENV = "SLACK_BOT_TOKEN"
API_ROOT = "/api"
KEY = "xoxb-test-SECRET-0d0e"
TOOLS = {"list_channels", "read_history", "post_message"}
REFERENCE_NOW = 1795185000  # 2026-11-20 14:30 UTC: offline posts get timestamps after it


# --------------------------------------------------------------------------- offline


async def test_schemas_are_documented(offline):
    await assert_documented(offline, TOOLS)


async def test_every_tool_through_the_mcp_client(offline):
    async with Client(offline) as client:
        channels = await client.call_tool("list_channels", {})
        posted = await client.call_tool("post_message", {"channel": "#random", "text": "hello"})
        history = await client.call_tool("read_history", {"channel": "random", "limit": 1})
    names = [c["name"] for c in channels.structured_content["channels"]]
    assert names == ["general", "markets", "research", "random"]
    assert history.structured_content["messages"][0] == posted.structured_content["message"]


async def test_channel_by_name_hash_name_or_id(offline):
    channels = (await call(offline, "list_channels"))["channels"]
    markets = next(c for c in channels if c["name"] == "markets")
    assert markets["id"].startswith("C") and markets["is_member"] and markets["topic"]
    views = [await call(offline, "read_history", channel=c, limit=3) for c in ("markets", "#markets", markets["id"])]
    assert views[0] == views[1] == views[2]
    assert views[0]["channel"] == markets["id"] and views[0]["has_more"] is True
    ts = [m["ts"] for m in views[0]["messages"]]
    assert ts == sorted(ts, reverse=True) and len(ts) == 3


async def test_seeded_messages_quote_the_simulated_market(offline):
    polygon = build_server("polygon", LiveService())
    close = (await call(polygon, "previous_close", ticker="AAPL"))["results"][0]["c"]
    everything = await call(offline, "read_history", channel="markets", limit=100)
    assert any(m["text"] == f"AAPL closed at ${close:.2f} on 2026-11-19." for m in everything["messages"])
    assert everything["has_more"] is False


async def test_post_then_read_in_order_with_logical_timestamps(offline):
    first = await call(offline, "post_message", channel="research", text="one")
    second = await call(offline, "post_message", channel="general", text="two")
    assert REFERENCE_NOW < float(first["ts"]) < float(second["ts"])
    research = (await call(offline, "read_history", channel="research", limit=2))["messages"]
    assert research[0] == first["message"] == {"ts": first["ts"], "user": first["message"]["user"], "text": "one"}
    assert research[1]["ts"] < first["ts"]


async def test_in_memory_workspaces_are_fresh_and_deterministic():
    a, b = build_server("slack", SlackConfig()), build_server("slack", SlackConfig())
    assert await call(a, "post_message", channel="markets", text="x") == await call(
        b, "post_message", channel="markets", text="x"
    )
    assert await call(a, "read_history", channel="markets") == await call(b, "read_history", channel="markets")
    c = build_server("slack", SlackConfig())
    assert all(m["text"] != "x" for m in (await call(c, "read_history", channel="markets", limit=100))["messages"])


async def test_posts_survive_reopening_a_file_workspace(tmp_path):
    cfg = SlackConfig(db_path=str(tmp_path / "workspace.db"))
    posted = await call(build_server("slack", cfg), "post_message", channel="#markets", text="persist me")
    reopened = build_server("slack", cfg)  # must not re-seed over the existing workspace
    history = (await call(reopened, "read_history", channel="markets", limit=100))["messages"]
    assert history[0] == posted["message"]
    assert len(history) == len({m["ts"] for m in history})
    again = await call(reopened, "post_message", channel="markets", text="later")
    assert float(again["ts"]) > float(posted["ts"])


async def test_unknown_channel_names_the_known_ones(offline):
    error = await fault(offline, "read_history", channel="#nope")
    assert isinstance(error, InvalidArguments) and "'#nope'" in str(error) and "markets" in str(error)
    assert isinstance(await fault(offline, "post_message", channel="C0000000000", text="x"), InvalidArguments)


async def test_schema_violations_name_the_field(offline):
    with pytest.raises(ValidationError, match="text"):
        await offline.call_tool("post_message", {"channel": "markets", "text": ""})
    with pytest.raises(ValidationError, match="limit"):
        await offline.call_tool("read_history", {"channel": "markets", "limit": 1000})


# --------------------------------------------------------------------------- live


async def test_live_list_channels_request_and_trimming(live, api):
    result = await call(live, "list_channels")
    req = api.last
    assert (req.method, req.path) == ("GET", "/api/conversations.list")
    assert req.headers["authorization"] == f"Bearer {KEY}"
    assert req.query == {"limit": "200", "exclude_archived": "true", "types": "public_channel,private_channel"}
    assert result["channels"][1] == {
        "id": "C02MARKETS", "name": "markets", "topic": "prices", "purpose": "moves", "is_private": False,
        "is_archived": False, "is_member": True, "num_members": 3, "created": 1600000001,
    }  # fmt: skip


async def test_live_read_history_resolves_the_channel_name(live, api):
    result = await call(live, "read_history", channel="#markets", limit=2)
    assert [r.path for r in api.requests] == ["/api/conversations.list", "/api/conversations.history"]
    assert api.last.query == {"channel": "C02MARKETS", "limit": "2"}
    assert result == {
        "channel": "C02MARKETS",
        "messages": [
            {"ts": "179510.000100", "user": "U1", "text": "m0"},
            {"ts": "179511.000100", "user": "U1", "text": "m1"},
        ],
        "has_more": True,
    }
    await call(live, "read_history", channel="C02MARKETS", limit=1)  # an id needs no lookup
    assert api.requests[-1].path == "/api/conversations.history" and len(api.requests) == 3


async def test_live_post_message_request(live, api):
    result = await call(live, "post_message", channel="C01GENERAL", text="hi *there*")
    req = api.last
    assert (req.method, req.path) == ("POST", "/api/chat.postMessage")
    assert req.headers["authorization"] == f"Bearer {KEY}"
    assert req.headers["content-type"].startswith("application/json")
    assert req.body == {"channel": "C01GENERAL", "text": "hi *there*"}
    assert result == {
        "channel": "C01GENERAL",
        "ts": "1795185001.000200",
        "message": {"ts": "1795185001.000200", "user": "UBOT", "text": "hi *there*"},
    }


async def test_live_unknown_channel(live, api):
    error = await fault(live, "read_history", channel="C09UNKNOWN")  # Slack answers ok:false channel_not_found
    assert isinstance(error, InvalidArguments) and "channel_not_found" in str(error)
    error = await fault(live, "post_message", channel="#nope", text="x")  # not in conversations.list
    assert isinstance(error, InvalidArguments) and "general" in str(error)


@pytest.mark.parametrize(
    ("error", "kind", "retryable"),
    [
        ("ratelimited", UpstreamError, True),
        ("internal_error", UpstreamError, True),
        ("invalid_auth", Unavailable, False),
        ("missing_scope", Unavailable, False),
        ("not_in_channel", InvalidArguments, False),
        ("something_new", UpstreamError, False),
    ],
)
async def test_live_ok_false_errors_map_to_fault_kinds(live, api, error, kind, retryable):
    api.reply_next(200, {"ok": False, "error": error})
    fault_ = await fault(live, "list_channels")
    assert type(fault_) is kind and fault_.retryable is retryable and error in str(fault_)


@pytest.mark.parametrize(("status", "kind", "retryable"), HTTP_FAULTS)
async def test_live_http_failures_never_leak_the_token(live, api, status, kind, retryable):
    api.fail_next(status)  # the body echoes "Bearer <token>"
    error = await fault(live, "list_channels")
    assert type(error) is kind and error.retryable is retryable and KEY not in str(error)


async def test_live_without_token_is_unavailable(api, monkeypatch):
    monkeypatch.delenv("SLACK_BOT_TOKEN", raising=False)
    server = build_server("slack", SlackConfig(backend="live", base_url=f"{api.url}/api"))
    api.reset()
    error = await fault(server, "post_message", channel="C01GENERAL", text="x")
    assert isinstance(error, Unavailable) and "SLACK_BOT_TOKEN" in str(error)
    assert api.requests == []


async def test_live_and_offline_answers_have_the_same_keys(live, offline):
    live_channel = (await call(live, "list_channels"))["channels"][0]
    offline_channel = (await call(offline, "list_channels"))["channels"][0]
    assert live_channel.keys() == offline_channel.keys()
    for tool, args in [
        ("read_history", {"channel": "markets", "limit": 2}),
        ("post_message", {"channel": "markets", "text": "x"}),
    ]:
        live_answer, offline_answer = await call(live, tool, **args), await call(offline, tool, **args)
        assert live_answer.keys() == offline_answer.keys(), tool
        live_message = live_answer.get("message") or live_answer["messages"][0]
        offline_message = offline_answer.get("message") or offline_answer["messages"][0]
        assert live_message.keys() == offline_message.keys(), tool


# --------------------------------------------------------------------------- episodes


class EpisodeCaller:
    """Calls the server's tools as the pool does: inside an episode when one is given."""

    def __init__(self, server: FastMCP) -> None:
        self.server = server

    async def call(self, tool: str, arguments: dict[str, Any], episode_id: str | None = None) -> tuple[str, Any]:
        token = current_episode.set(episode_id)
        try:
            result = await self.server.call_tool(tool, arguments)
        finally:
            current_episode.reset(token)
        return "", result.structured_content


async def test_each_episode_has_its_own_workspace_dropped_at_its_end():
    server = build_server("slack", SlackConfig())
    backend = EpisodeCaller(server)
    for episode in ("a", "b"):
        await backend.call("post_message", {"channel": "random", "text": f"from {episode}"}, episode)

    async def texts(episode: str | None) -> list[str]:
        _, out = await backend.call("read_history", {"channel": "random", "limit": 100}, episode)
        return [m["text"] for m in out["messages"]]

    a, b, shared = await texts("a"), await texts("b"), await texts(None)
    assert a[0] == "from a" and b[0] == "from b" and a[1:] == b[1:] == shared
    await end_episode_hook(server)("a")
    await end_episode_hook(server)("a")  # idempotent
    assert await texts("a") == shared
    assert end_episode_hook(build_server("slack", SlackConfig(backend="live"))) is None  # live: nothing to isolate


async def test_live_slack_workspaces_are_bounded_oldest_evicted(caplog):
    backend = EpisodeCaller(build_server("slack", SlackConfig(max_live_episodes=2)))

    async def post(episode: str) -> None:
        await backend.call("post_message", {"channel": "random", "text": episode}, episode)

    async def newest(episode: str) -> str:
        _, out = await backend.call("read_history", {"channel": "random", "limit": 1}, episode)
        return out["messages"][0]["text"]

    with caplog.at_level(logging.WARNING, logger="mcp_servers.episodes"):
        for episode in ("e1", "e2", "e3"):
            await post(episode)
    assert "more than 2 live episodes" in caplog.text and "'e1'" in caplog.text
    assert [await newest(e) for e in ("e2", "e3")] == ["e2", "e3"]
    assert await newest("e1") == "Count me in."  # evicted: it starts over from the fixture


async def test_file_workspace_is_the_fixture_of_every_episode(tmp_path):
    cfg = SlackConfig(db_path=str(tmp_path / "ws.db"))
    await EpisodeCaller(build_server("slack", cfg)).call("post_message", {"channel": "general", "text": "seeded"})
    backend = EpisodeCaller(build_server("slack", cfg))
    await backend.call("post_message", {"channel": "general", "text": "shared later"})
    _, out = await backend.call("read_history", {"channel": "general", "limit": 1}, "ep")
    assert out["messages"][0]["text"] == "seeded"  # the file as it was when the server was built
