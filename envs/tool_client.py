"""How the environment reaches tools: any object with `call_tool` and `list_tools`.

The Serve pool (`serve_apps.tool_pool.ServeToolPool`) and the in-process pool (`LocalToolPool`)
both fit. envs/ does not import them (it sits below serve_apps/): whoever builds environments —
the episode runner, a test, SkyRL's generator through `skyrl_gym.make` — registers a client first
with `set_tool_client`, since env_config cannot carry live objects.
"""

from __future__ import annotations

from typing import Any, Protocol


class ToolResultLike(Protocol):
    ok: bool
    text: str
    structured: Any
    error_kind: str | None
    error: str | None
    latency_ms: float

    @property
    def infra_fault(self) -> bool: ...


class ToolClient(Protocol):
    async def call_tool(self, server: str, tool: str, arguments: dict[str, Any] | None = None) -> ToolResultLike: ...

    async def list_tools(self) -> dict[str, list[dict[str, Any]]]: ...


_client: ToolClient | None = None


def set_tool_client(client: ToolClient | None) -> None:
    """The client environments built in this process use (None to clear)."""
    global _client
    _client = client


def get_tool_client() -> ToolClient:
    if _client is None:
        raise RuntimeError(
            "no tool client registered: call envs.tool_client.set_tool_client(pool) before building "
            "MCPToolEnv (a ServeToolPool in the cluster, a LocalToolPool in one process)"
        )
    return _client
