"""Named fault kinds for tool calls.

A tool raises a `ToolFault` to say *why* it failed; the pool turns it into a result with an
`error_kind`, and retries only what is retryable. Policy mistakes (bad arguments, unknown tool)
and infrastructure faults (upstream down, sandbox unavailable) must stay distinguishable:
only the first may ever become a negative reward.
"""

from __future__ import annotations

import logging
from typing import Literal

from fastmcp.exceptions import ToolError

ErrorKind = Literal["timeout", "invalid_arguments", "unknown_tool", "upstream", "sandbox", "unavailable"]

# Kinds caused by the infrastructure, not by the model's call.
INFRA_KINDS: frozenset[str] = frozenset({"upstream", "unavailable"})


class ToolFault(ToolError):
    """A tool call failed for a named reason.

    A FastMCP `ToolError`, so FastMCP passes it through unwrapped, sends its message to MCP clients,
    and logs it in one line: these are expected outcomes, not crashes worth a traceback.
    """

    kind: ErrorKind = "upstream"

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message, log_level=logging.INFO)
        self.retryable = retryable


class InvalidArguments(ToolFault):
    kind = "invalid_arguments"


class UnknownTool(ToolFault):
    kind = "unknown_tool"


class UpstreamError(ToolFault):
    """The outside API failed (5xx, 429 and network errors are retryable; 4xx are not)."""

    kind = "upstream"


class SandboxError(ToolFault):
    """The sandbox refused or killed the program (limit exceeded, sandbox missing)."""

    kind = "sandbox"


class Unavailable(ToolFault):
    """The tool cannot serve now (missing API key, server not connected)."""

    kind = "unavailable"
