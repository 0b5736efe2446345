"""A small MCP server for the pool's external-server tests.

`python stdio_server.py`: MCP over stdio. `--http PORT`: streamable HTTP on 127.0.0.1:PORT.
`--silent`: a program that never answers (for the pool's timeouts).
"""

import asyncio
import os
import sys
import time
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
    if "--silent" in sys.argv:
        time.sleep(3600)
    elif "--http" in sys.argv:
        port = int(sys.argv[sys.argv.index("--http") + 1])
        mcp.run(transport="http", host="127.0.0.1", port=port, path="/mcp/", show_banner=False, log_level="warning")
    else:
        mcp.run(transport="stdio", show_banner=False)
