"""The environment: MCPToolEnv (skyrl-gym), tool-call parsing, rewards.

Importing this package registers MCPToolEnv with skyrl-gym, once per process: skyrl-gym's
`register` raises on a duplicate id, so a second import (or a reload) must not call it again.
"""

from __future__ import annotations

ENV_ID = "MCPToolEnv"


def register_env() -> None:
    """Register MCPToolEnv with skyrl-gym unless this process already has."""
    from skyrl_gym.envs.registration import register, registry

    if ENV_ID not in registry:
        register(id=ENV_ID, entry_point="envs.mcp_tool_env:MCPToolEnv")


register_env()
