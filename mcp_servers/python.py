"""The `python` MCP server: one tool, `run_python`, that runs code in the bubblewrap sandbox."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated, Any

from fastmcp import FastMCP
from pydantic import Field

from configs.schema import PythonToolConfig
from mcp_servers import new_server
from mcp_servers.errors import Unavailable
from mcp_servers.sandbox import run_sandboxed, sandbox_health


def build(cfg: PythonToolConfig) -> FastMCP:
    """The FastMCP server for the python tool, with the limits of `cfg.sandbox`."""
    box = cfg.sandbox
    mcp = new_server("python")
    # Programs are CPU-bound: a replica runs as many at once as the CPUs it reserved, and the pool
    # scales by adding replicas (which Ray places and accounts for), not by oversubscribing one.
    slots = asyncio.Semaphore(box.max_concurrent)

    version = f"{sys.version_info.major}.{sys.version_info.minor}"

    @mcp.tool(
        description=(
            f"Run a Python {version} program (standard library only) in an isolated sandbox and return "
            "its stdout, stderr and exit code. No network; files can be written under /tmp only. "
            f"Limits: {box.wall_time_s:g} s wall time, {box.cpu_time_s} s CPU, {box.memory_mb} MB memory; "
            f"output is cut at {box.max_output_bytes} bytes per stream. Print what you want to see."
        ),
        annotations={"readOnlyHint": True, "openWorldHint": False},  # nothing outside the sandbox changes
    )
    async def run_python(
        code: Annotated[str, Field(description="The complete program, run as a script (`python main.py`).")],
        stdin: Annotated[str, Field(description="Text given to the program on standard input.")] = "",
    ) -> dict[str, Any]:
        # The program's own clock (the sandbox's wall time) starts once it has a slot; the wait before is
        # the machine's, so past queue_timeout_s it fails as an infrastructure fault, never the model's.
        try:
            await asyncio.wait_for(slots.acquire(), box.queue_timeout_s)
        except TimeoutError:
            raise Unavailable(
                f"no free sandbox for {box.queue_timeout_s:g} s ({box.max_concurrent} per replica, all busy): "
                "add python replicas for this load",
                retryable=True,
            ) from None
        try:
            return (await run_sandboxed(code, box, stdin=stdin)).to_dict()
        finally:
            slots.release()

    return mcp


async def health(cfg: PythonToolConfig) -> str | None:
    """A replica is healthy when a sandboxed program runs (bubblewrap present and working)."""
    return await sandbox_health(cfg.sandbox)
