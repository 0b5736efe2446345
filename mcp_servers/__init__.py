"""FastMCP servers for the built-in tools. Each module `mcp_servers/<name>.py` has `build(cfg) -> FastMCP`,
and may have `async health(cfg) -> str | None` for the pool's health checks."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastmcp import FastMCP

BUILTIN_SERVERS = ("polygon", "fmp", "tavily", "slack", "python")


def mcprl_version() -> str:
    """The installed mcprl's version (pyproject.toml), which our servers report to MCP clients."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mcprl")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


def new_server(name: str, instructions: str | None = None) -> FastMCP:
    """A FastMCP server that tells clients it is mcprl's (serverInfo.version), not FastMCP's own version."""
    from fastmcp import FastMCP

    return FastMCP(name, instructions=instructions, version=mcprl_version())


def health_probe(name: str, cfg: Any) -> Callable[[], Awaitable[str | None]] | None:
    """A server module's optional `health(cfg)`: None when healthy, else the reason."""
    probe = getattr(importlib.import_module(f"mcp_servers.{name}"), "health", None)
    return (lambda: probe(cfg)) if probe else None


def build_server(name: str, cfg: Any) -> FastMCP:
    """Build the FastMCP server `name` from its config section (imported lazily: replicas build only theirs)."""
    if name not in BUILTIN_SERVERS:
        raise KeyError(f"unknown built-in MCP server {name!r}; known: {', '.join(BUILTIN_SERVERS)}")
    return importlib.import_module(f"mcp_servers.{name}").build(cfg)
