"""Slack: list channels, read a channel's history, post a message.

Live: the Slack Web API (`conversations.list`, `conversations.history`, `chat.postMessage`), bearer
token SLACK_BOT_TOKEN. Slack answers HTTP 200 with `ok: false` and an error code; `slack_fault` maps
the codes to fault kinds. Offline: a workspace in SQLite (cfg.db_path, or a fresh in-memory one per
server), seeded with a few channels and deterministic messages; posts persist, and their timestamps
come from a logical clock (one second after the newest message), never the wall clock.

Episodes (offline only): a call made inside an episode (`mcp_servers.episodes.current_episode`) reads
and writes that episode's own in-memory workspace, copied on first use from the fixture (the shared
workspace as it was when the server was built), and dropped when the episode ends; at most
`cfg.max_live_episodes` live at once, the oldest evicted. Calls outside episodes use the shared
workspace. The live backend cannot be isolated: every episode posts to the one real workspace.
A channel is accepted by name ("markets" or "#markets") or by id ("C…"). Both backends return Slack's
shapes trimmed: channels → {id, name, topic, purpose, is_private, is_archived, is_member, num_members,
created}; messages → {ts, user, text}, newest first.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import threading
from datetime import UTC, datetime
from typing import Annotated, Any, Protocol

from fastmcp import FastMCP
from pydantic import Field

from configs.schema import SlackConfig
from mcp_servers import market_data as md
from mcp_servers import new_server
from mcp_servers.episodes import EpisodeStates, current_episode, on_end_episode
from mcp_servers.errors import InvalidArguments, ToolFault, Unavailable, UpstreamError
from mcp_servers.http_api import HttpApi

DEFAULT_BASE_URL = "https://slack.com/api"
_CHANNEL_ID = re.compile(r"^[CGD](?=[A-Z0-9]*\d)[A-Z0-9]{6,}$")  # C0123ABCD; a name is lower-case

Channel = Annotated[
    str,
    Field(min_length=1, max_length=81, description='Channel name ("markets" or "#markets") or channel id ("C…").'),
]

# Slack `error` codes by what they say about the call.
_CALLER_ERRORS = frozenset(
    "channel_not_found not_in_channel is_archived msg_too_long no_text invalid_limit invalid_cursor "
    "too_many_attachments restricted_action cannot_reply_to_message".split()
)
_AUTH_ERRORS = frozenset(
    "not_authed invalid_auth account_inactive token_revoked token_expired no_permission missing_scope "
    "not_allowed_token_type ekm_access_denied team_access_not_granted".split()
)
_TRANSIENT_ERRORS = frozenset("ratelimited internal_error fatal_error service_unavailable request_timeout".split())


def slack_fault(method: str, error: str) -> ToolFault:
    """The fault for a Slack `ok: false` answer."""
    message = f"slack {method}: {error}"
    if error in _CALLER_ERRORS:
        return InvalidArguments(message)
    if error in _AUTH_ERRORS:
        return Unavailable(f"{message} (check SLACK_BOT_TOKEN and the app's scopes)")
    return UpstreamError(message, retryable=error in _TRANSIENT_ERRORS)


def _channel_json(ch: dict[str, Any]) -> dict[str, Any]:
    def value(x: Any) -> str:  # Slack nests topic/purpose as {"value": ..., "creator": ..., "last_set": ...}
        return x.get("value", "") if isinstance(x, dict) else str(x or "")

    return {
        "id": ch.get("id"),
        "name": ch.get("name"),
        "topic": value(ch.get("topic")),
        "purpose": value(ch.get("purpose")),
        "is_private": bool(ch.get("is_private", False)),
        "is_archived": bool(ch.get("is_archived", False)),
        "is_member": bool(ch.get("is_member", False)),
        "num_members": ch.get("num_members", 0),
        "created": ch.get("created", 0),
    }


def _message_json(m: dict[str, Any]) -> dict[str, Any]:
    return {"ts": m.get("ts"), "user": m.get("user") or m.get("bot_id"), "text": m.get("text", "")}


class Backend(Protocol):
    async def list_channels(self) -> dict[str, Any]: ...
    async def read_history(self, channel: str, limit: int) -> dict[str, Any]: ...
    async def post_message(self, channel: str, text: str) -> dict[str, Any]: ...


# --------------------------------------------------------------------------- offline workspace


def _slack_id(prefix: str, name: str) -> str:
    return prefix + hashlib.sha256(name.encode()).hexdigest()[:10].upper()


BOT_USER = _slack_id("U", "mcprl-bot")
_PEOPLE = {name: _slack_id("U", name) for name in ("alice", "bob", "carol")}
_CHANNELS = (  # name, topic, purpose, members
    ("general", "Company-wide announcements", "Announcements and chatter for everyone", 42),
    ("markets", "Daily market moves", "Prices, closes and big moves in the stocks we follow", 17),
    ("research", "Fundamentals and earnings", "Earnings notes, ratios and company research", 9),
    ("random", "Anything goes", "Non-work banter", 38),
)
# Seed messages start after the close of the newest bar (so they can quote it), ten minutes apart; posts
# get timestamps after the offline "now", the reference day's open.
_SEED_EPOCH = int(datetime(2026, 11, 19, 21, 30, tzinfo=UTC).timestamp())
_NOW = int(datetime(2026, 11, 20, 14, 30, tzinfo=UTC).timestamp())


def _seed_messages() -> list[tuple[str, str, str]]:
    """(channel name, user id, text), oldest first; numbers come from market_data, so they agree with it."""
    a, b, c = _PEOPLE["alice"], _PEOPLE["bob"], _PEOPLE["carol"]
    out = [
        ("general", a, "Welcome to the team workspace! Market chat goes in #markets, research in #research."),
        ("general", b, "Reminder: the quarterly review is on Friday at 3pm."),
        ("random", c, "Anyone up for lunch at the noodle place?"),
        ("random", a, "Count me in."),
    ]
    for i, ticker in enumerate(("AAPL", "NVDA", "MSFT", "TSLA", "JPM")):
        bar = md.last_bar(ticker)
        out.append(("markets", (a, b, c)[i % 3], f"{ticker} closed at ${bar.c:.2f} on {bar.day.isoformat()}."))
    for i, ticker in enumerate(("AAPL", "NVDA", "KO")):
        p = md.statements(ticker, "quarter", 1)[0]
        out.append(
            ("research", (c, a, b)[i], f"{ticker} {p.period} {p.fiscal_year}: revenue ${p.revenue / 1e9:,.2f}B, "
             f"net income ${p.net_income / 1e9:,.2f}B, EPS ${p.eps:.2f}.")
        )  # fmt: skip
    return out


_SCHEMA = """
CREATE TABLE IF NOT EXISTS channels (
    id TEXT PRIMARY KEY, name TEXT UNIQUE NOT NULL, topic TEXT, purpose TEXT,
    is_private INTEGER NOT NULL DEFAULT 0, is_archived INTEGER NOT NULL DEFAULT 0,
    num_members INTEGER NOT NULL, created INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    channel_id TEXT NOT NULL REFERENCES channels(id), ts TEXT NOT NULL, user TEXT NOT NULL, text TEXT NOT NULL,
    PRIMARY KEY (channel_id, ts));
"""


class Offline:
    """One workspace: a SQLite database, seeded, or copied from `fixture` (another workspace's database)."""

    def __init__(self, db_path: str = "", fixture: sqlite3.Connection | None = None) -> None:
        # Autocommit mode + explicit BEGIN IMMEDIATE: replicas sharing one file serialize their writes.
        self.db = sqlite3.connect(db_path or ":memory:", isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.lock = threading.Lock()
        with self.lock:
            if fixture is not None:
                fixture.backup(self.db)
                return
            self.db.executescript(_SCHEMA)
            self.db.execute("BEGIN IMMEDIATE")
            if self.db.execute("SELECT COUNT(*) FROM channels").fetchone()[0] == 0:
                self._seed()
            self.db.execute("COMMIT")

    def _seed(self) -> None:
        for i, (name, topic, purpose, members) in enumerate(_CHANNELS):
            self.db.execute(
                "INSERT INTO channels (id, name, topic, purpose, num_members, created) VALUES (?, ?, ?, ?, ?, ?)",
                (_slack_id("C", name), name, topic, purpose, members, 1_600_000_000 + 86_400 * i),
            )
        for i, (name, user, text) in enumerate(_seed_messages()):
            ts = f"{_SEED_EPOCH + 600 * i}.000100"
            self.db.execute("INSERT INTO messages VALUES (?, ?, ?, ?)", (_slack_id("C", name), ts, user, text))

    def _channel(self, channel: str) -> sqlite3.Row:
        key = channel.strip().lstrip("#")
        row = self.db.execute("SELECT * FROM channels WHERE id = ? OR name = ?", (key.upper(), key.lower())).fetchone()
        if row is None:
            names = ", ".join(r["name"] for r in self.db.execute("SELECT name FROM channels ORDER BY name"))
            raise InvalidArguments(f"channel {channel!r} not found; channels: {names}")
        return row

    async def list_channels(self) -> dict[str, Any]:
        with self.lock:
            rows = self.db.execute("SELECT * FROM channels ORDER BY created").fetchall()
        return {"channels": [_channel_json({**dict(r), "is_member": True}) for r in rows]}

    async def read_history(self, channel: str, limit: int) -> dict[str, Any]:
        with self.lock:
            ch = self._channel(channel)
            rows = self.db.execute(
                "SELECT ts, user, text FROM messages WHERE channel_id = ? ORDER BY CAST(ts AS REAL) DESC LIMIT ?",
                (ch["id"], limit + 1),
            ).fetchall()
        return {
            "channel": ch["id"],
            "messages": [_message_json(dict(r)) for r in rows[:limit]],
            "has_more": len(rows) > limit,
        }

    async def post_message(self, channel: str, text: str) -> dict[str, Any]:
        with self.lock:
            ch = self._channel(channel)
            if ch["is_archived"]:
                raise InvalidArguments(f"channel {channel!r} is archived")
            self.db.execute("BEGIN IMMEDIATE")
            try:
                newest = self.db.execute("SELECT MAX(CAST(ts AS REAL)) FROM messages").fetchone()[0] or 0
                ts = f"{max(int(newest), _NOW) + 1}.000100"
                self.db.execute("INSERT INTO messages VALUES (?, ?, ?, ?)", (ch["id"], ts, BOT_USER, text))
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        return {"channel": ch["id"], "ts": ts, "message": {"ts": ts, "user": BOT_USER, "text": text}}


class Workspaces:
    """The offline backend: the shared workspace, and one workspace per live episode (see the docstring)."""

    def __init__(self, cfg: SlackConfig) -> None:
        self.shared = Offline(cfg.db_path)
        with self.shared.lock:  # the fixture every episode starts from, frozen before any episode writes
            self.fixture = Offline(fixture=self.shared.db).db
        self.episodes: EpisodeStates[Offline] = EpisodeStates("slack", cfg.max_live_episodes)

    def _workspace(self) -> Offline:
        episode_id = current_episode.get()
        if episode_id is None:
            return self.shared
        workspace = self.episodes.get(episode_id)
        if workspace is None:
            workspace = Offline(fixture=self.fixture)
            for old in self.episodes.add(episode_id, workspace):
                old.db.close()
        return workspace

    async def end_episode(self, episode_id: str) -> None:
        workspace = self.episodes.pop(episode_id)
        if workspace is not None:
            workspace.db.close()

    async def list_channels(self) -> dict[str, Any]:
        return await self._workspace().list_channels()

    async def read_history(self, channel: str, limit: int) -> dict[str, Any]:
        return await self._workspace().read_history(channel, limit)

    async def post_message(self, channel: str, text: str) -> dict[str, Any]:
        return await self._workspace().post_message(channel, text)


# --------------------------------------------------------------------------- live


class Live:
    def __init__(self, cfg: SlackConfig) -> None:
        self.api = HttpApi("slack", cfg.base_url or DEFAULT_BASE_URL, "SLACK_BOT_TOKEN", cfg.http_timeout_s)
        self._ids: dict[str, str] = {}  # channel name → id, learned from conversations.list

    async def _call(self, method: str, *, params: dict[str, Any] | None = None, json: Any = None) -> dict[str, Any]:
        payload = await self.api.call("POST" if json is not None else "GET", f"/{method}", params=params, json=json)
        if not payload.get("ok"):
            raise slack_fault(method, str(payload.get("error", "unknown_error")))
        return payload

    async def _all_channels(self) -> list[dict[str, Any]]:
        channels, cursor = [], ""
        for _ in range(5):  # at most 1000 channels
            params = {"limit": 200, "exclude_archived": "true", "types": "public_channel,private_channel"}
            if cursor:
                params["cursor"] = cursor
            payload = await self._call("conversations.list", params=params)
            channels += payload.get("channels", [])
            cursor = (payload.get("response_metadata") or {}).get("next_cursor", "")
            if not cursor:
                break
        self._ids = {c["name"]: c["id"] for c in channels if "name" in c and "id" in c}
        return channels

    async def _resolve(self, channel: str) -> str:
        key = channel.strip().lstrip("#")
        if _CHANNEL_ID.match(key):
            return key
        if key.lower() not in self._ids:
            await self._all_channels()
        if key.lower() not in self._ids:
            raise InvalidArguments(f"channel {channel!r} not found; channels: {', '.join(sorted(self._ids))}")
        return self._ids[key.lower()]

    async def list_channels(self) -> dict[str, Any]:
        return {"channels": [_channel_json(c) for c in await self._all_channels()]}

    async def read_history(self, channel: str, limit: int) -> dict[str, Any]:
        channel_id = await self._resolve(channel)
        payload = await self._call("conversations.history", params={"channel": channel_id, "limit": limit})
        messages = [_message_json(m) for m in payload.get("messages", [])][:limit]
        return {"channel": channel_id, "messages": messages, "has_more": bool(payload.get("has_more"))}

    async def post_message(self, channel: str, text: str) -> dict[str, Any]:
        channel_id = await self._resolve(channel)
        payload = await self._call("chat.postMessage", json={"channel": channel_id, "text": text})
        message = _message_json(payload.get("message") or {"ts": payload.get("ts"), "text": text})
        return {"channel": payload.get("channel", channel_id), "ts": payload.get("ts"), "message": message}


def build(cfg: SlackConfig | None = None) -> FastMCP:
    cfg = cfg or SlackConfig()
    backend: Backend = Live(cfg) if cfg.backend == "live" else Workspaces(cfg)
    mcp = new_server("slack", instructions="A Slack workspace: list channels, read messages, post messages.")
    if isinstance(backend, Workspaces):
        on_end_episode(mcp, backend.end_episode)
    read_only = {"readOnlyHint": True, "openWorldHint": cfg.backend == "live"}

    @mcp.tool(annotations=read_only)
    async def list_channels() -> dict[str, Any]:
        """The workspace's channels: id, name, topic, purpose, whether the bot is a member, and member count."""
        return await backend.list_channels()

    @mcp.tool(annotations=read_only)
    async def read_history(
        channel: Channel,
        limit: Annotated[
            int, Field(ge=1, le=100, description="How many messages to return, newest first (1-100).")
        ] = 20,
    ) -> dict[str, Any]:
        """A channel's most recent messages, newest first: ts (Slack timestamp), user id and text; has_more
        says whether older messages exist."""
        return await backend.read_history(channel, limit)

    @mcp.tool(annotations={"readOnlyHint": False, "destructiveHint": False, "openWorldHint": cfg.backend == "live"})
    async def post_message(
        channel: Channel,
        text: Annotated[str, Field(min_length=1, max_length=4000, description="The message text (Slack mrkdwn).")],
    ) -> dict[str, Any]:
        """Post a message to a channel as the bot. Returns the channel id, the new message's ts and the message."""
        return await backend.post_message(channel, text)

    return mcp
