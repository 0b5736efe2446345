"""The tool inventory: which servers and tools the configured pool offers, and their input schemas.

Read in-process (`LocalToolPool`, no Ray): the same servers and schemas the Serve pool would offer.
Tool names are as `pool.call_tool(server, tool, ...)` takes them, which is how a task's
`tool_sequence` names them: the pool lists an external server's tools as `<server>.<tool>`, and that
prefix is removed here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from configs.schema import ToolsConfig

Inventory = dict[str, dict[str, dict[str, Any]]]  # {server: {tool: inputSchema}}
ToolListing = dict[str, list[dict[str, Any]]]  # {server: [MCP tool dicts]}, as the pool lists them


async def load_tool_listing(tools_cfg: ToolsConfig) -> ToolListing:
    """The MCP tool dicts (name, description, inputSchema) of every enabled server; the pool is closed after."""
    from serve_apps.tool_pool import LocalToolPool

    pool = await LocalToolPool.create(tools_cfg)
    try:
        return await pool.list_tools()
    finally:
        await pool.close()


def local_name(server: str, name: str) -> str:
    """A listed tool name without its `<server>.` prefix (external servers' tools carry one)."""
    prefix = f"{server}."
    return name[len(prefix) :] if name.startswith(prefix) else name


def inventory_from_listing(listing: ToolListing) -> Inventory:
    return {
        server: {local_name(server, t["name"]): t.get("inputSchema") or {"type": "object"} for t in tools}
        for server, tools in listing.items()
    }


def tool_writes(tool: dict[str, Any]) -> bool:
    """Whether a listed MCP tool may change state: it does not declare `readOnlyHint: true` (the MCP default
    is false, so a tool without annotations counts as writing)."""
    return (tool.get("annotations") or {}).get("readOnlyHint") is not True


def live_writing_tools(listing: ToolListing, tools_cfg: ToolsConfig) -> set[str]:
    """`server.tool` of every writing tool on a built-in server whose backend is `live` (a real outside
    service: its state is shared by every episode and cannot be reset). External servers have no backend
    setting and are not counted."""
    live = {name for name, server in tools_cfg.servers if getattr(server, "backend", None) == "live"}
    return {
        f"{server}.{local_name(server, t['name'])}"
        for server in live
        for t in listing.get(server, [])
        if tool_writes(t)
    }


async def load_inventory(tools_cfg: ToolsConfig) -> Inventory:
    """{server: {tool: inputSchema}} of the configured servers, read in-process."""
    return inventory_from_listing(await load_tool_listing(tools_cfg))


def inventory_tools_for_prompt(listing: ToolListing, servers: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Tool definitions for a prompt: {name: "server.tool", description, parameters}, servers in listing order.

    `servers`: only these (unknown names are skipped); None = all.
    """
    wanted = None if servers is None else set(servers)
    return [
        {
            "name": f"{server}.{local_name(server, t['name'])}",
            "description": t.get("description") or "",
            "parameters": t.get("inputSchema") or {"type": "object", "properties": {}},
        }
        for server, tools in listing.items()
        if wanted is None or server in wanted
        for t in tools
    ]
