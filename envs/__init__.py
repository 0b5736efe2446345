"""The environment: MCPToolEnv (skyrl-gym), tool-call parsing, rewards.

Whoever makes envs through `skyrl_gym.make` calls `register_env()` first (importing this package does
nothing): it registers MCPToolEnv once per process, since skyrl-gym's `register` raises on a duplicate id.
Our own runner builds `MCPToolEnv` directly and needs no registration.
"""

from __future__ import annotations

ENV_ID = "MCPToolEnv"


def register_env() -> None:
    """Register MCPToolEnv with skyrl-gym unless this process already has."""
    from skyrl_gym.envs.registration import register, registry

    if ENV_ID not in registry:
        register(id=ENV_ID, entry_point="envs.mcp_tool_env:MCPToolEnv")
