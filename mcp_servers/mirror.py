"""What the servers that mirror an outside API (polygon, fmp, tavily) build alike: the backend their
config picks (`live` calls the API, `offline` simulates it), the FastMCP server, and the annotations of
their tools (read-only; open-world only when they reach the live API)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastmcp import FastMCP

from configs.schema import LiveService
from mcp_servers import new_server

B = TypeVar("B")


def mirror_server(
    name: str,
    instructions: str,
    cfg: LiveService | None,
    live: Callable[[LiveService], B],
    offline: Callable[[], B],
) -> tuple[FastMCP, B, dict[str, Any]]:
    """The server `name` (tools still to add), its backend (`live(cfg)` or `offline()`; `cfg` None: the
    defaults, offline) and the annotations every one of its tools carries."""
    cfg = cfg or LiveService()
    backend = live(cfg) if cfg.backend == "live" else offline()
    read_only = {"readOnlyHint": True, "openWorldHint": cfg.backend == "live"}
    return new_server(name, instructions), backend, read_only
