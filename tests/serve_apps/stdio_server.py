"""A small MCP server that speaks stdio, for the pool's external-server tests: `python stdio_server.py`."""

import asyncio
import os
from typing import Annotated

from fastmcp import FastMCP
from pydantic import Field

mcp = FastMCP("notes")


@mcp.tool
def echo(text: Annotated[str, Field(description="Text to send back.")]) -> str:
    """Return the text unchanged."""
    return text


@mcp.tool
def add(a: Annotated[int, Field(description="First addend.")], b: Annotated[int, Field(description="Second.")]) -> dict:
    """Add two integers."""
    return {"sum": a + b}


@mcp.tool
async def sleep(seconds: Annotated[float, Field(ge=0, le=60, description="How long to sleep.")]) -> str:
    """Sleep, then answer (for timeout tests)."""
    await asyncio.sleep(seconds)
    return "awake"


@mcp.tool
def whoami() -> dict:
    """The server's process id (shows which process, and so which session, answered)."""
    return {"pid": os.getpid()}


if __name__ == "__main__":
    mcp.run(transport="stdio", show_banner=False)
