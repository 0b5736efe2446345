"""The MCP-over-HTTP face of a pool server: a FastMCP app whose every tool forwards to a `ToolHost`.

Forwarding (instead of serving the backend's own app) means HTTP clients get the same timeouts,
retries, rate limits and error kinds as handle callers, and external servers' tools can be renamed.

Episodes over MCP: a `tools/call` whose `_meta` holds `"mcprl/episode_id": "<id>"` runs in that
episode's state (see serve_apps.tool_pool); without it, in the shared state. To end an episode (drop
its state), call the reserved tool `mcprl.end_episode` with no arguments and the same `_meta`; it is
never listed, so models do not see it. Ending an unknown or already-ended episode succeeds.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastmcp import FastMCP
from fastmcp.server.dependencies import fastmcp_request_ctx
from fastmcp.server.middleware import Middleware
from fastmcp.tools.base import Tool, ToolResult
from mcp_types import TextContent
from pydantic import PrivateAttr

from mcp_servers import new_server
from mcp_servers.errors import InvalidArguments
from serve_apps.tool_host import END_EPISODE_TOOL, EPISODE_META, ToolHost


def request_episode_id() -> str | None:
    """The episode id in the current MCP request's `_meta`, if any."""
    ctx = fastmcp_request_ctx.get()
    value = (ctx.meta or {}).get(EPISODE_META) if ctx is not None else None
    if value is not None and not isinstance(value, str):
        raise InvalidArguments(f"_meta[{EPISODE_META!r}] must be a string, not {type(value).__name__}")
    return value


class ForwardingTool(Tool):
    """An MCP tool that runs by calling `host.call_tool(remote_name, ...)`."""

    _host: Any = PrivateAttr()
    _remote_name: str = PrivateAttr()

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        r = await self._host.call_tool(self._remote_name, arguments, episode_id=request_episode_id())
        structured = r.structured if isinstance(r.structured, dict) else None
        return ToolResult(
            content=[TextContent(type="text", text=r.text)],
            structured_content=structured,
            meta={"mcprl": {"error_kind": r.error_kind, "latency_ms": round(r.latency_ms, 3), "attempts": r.attempts}},
            is_error=not r.ok,
        )


class EndEpisode(Middleware):
    """Answers the reserved, unlisted END_EPISODE_TOOL: drops the `_meta` episode's state on the host."""

    def __init__(self, host: ToolHost) -> None:
        self.host = host

    async def on_call_tool(self, context: Any, call_next: Any) -> ToolResult:
        if context.message.name != END_EPISODE_TOOL:
            return await call_next(context)
        episode_id = request_episode_id()
        if episode_id is None:
            raise InvalidArguments(f"{END_EPISODE_TOOL} needs the episode id in _meta[{EPISODE_META!r}]")
        await self.host.end_episode(episode_id)
        return ToolResult(content=[TextContent(type="text", text=f"episode {episode_id!r} ended")])


def build_front(host: ToolHost, tools: list[dict[str, Any]], prefix: str = "") -> FastMCP:
    """A FastMCP server exposing `tools` (MCP dicts from the backend) as `<prefix><name>`, and END_EPISODE_TOOL."""
    front = new_server(host.name)
    front.add_middleware(EndEpisode(host))
    for t in tools:
        tool = ForwardingTool(
            name=prefix + t["name"],
            description=t.get("description"),
            parameters=t.get("inputSchema") or {"type": "object", "properties": {}},
        )
        tool._host = host
        tool._remote_name = t["name"]
        front.add_tool(tool)
    return front


# Each server also answers at its prefix + MCP_SUFFIX (`/mcp/x/mcp`): FastMCP's convention, and the MCP
# Inspector's CLI, which replaces any URL path not ending in `/mcp` with `/mcp` and so never reaches `/mcp/x/`.
MCP_SUFFIX = "/mcp"


class HttpGate:
    """ASGI wrapper: bearer-token check, and the bare prefix (`/mcp/x`) and `/mcp/x/mcp` served like `/mcp/x/`.

    Without the path fix every POST to the bare prefix is answered with a 307, which many MCP
    clients do not follow for POST.
    """

    def __init__(self, app: Any, token: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if self.expected is not None:
                given = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.expected):
                    await _reply(send, 401, b'{"error": "missing or wrong bearer token"}')
                    return
            root = scope.get("root_path", "")
            path = scope.get("path", "")
            if path in ("", root, root + MCP_SUFFIX, root + MCP_SUFFIX + "/"):
                scope = {**scope, "path": root + "/", "raw_path": (root + "/").encode()}
        await self.app(scope, receive, send)


async def _reply(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def http_app(front: FastMCP, token: str | None) -> Any:
    """Stateless streamable HTTP (any replica can answer any request), behind the gate."""
    app = front.http_app(path="/", stateless_http=True, json_response=True)
    return HttpGate(app, token)
