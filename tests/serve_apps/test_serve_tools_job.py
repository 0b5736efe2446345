"""`python -m jobs.serve_tools` end to end: an outside MCP client lists and calls, Ctrl-C stops it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
from fastmcp import Client

from tests.conftest import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_for(url: str, proc: subprocess.Popen, within_s: float = 180) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url, timeout=1).status_code not in (404, 500, 503):  # the proxy is up before the app
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} never answered")


async def test_serve_tools_serves_mcp_to_an_outside_client_and_stops_on_interrupt():
    port = free_port()
    sets = [f"tools.http.port={port}"] + [f"tools.servers.{n}.enabled=false" for n in ("fmp", "tavily", "python")]
    args = [sys.executable, "-m", "jobs.serve_tools", *[a for s in sets for a in ("--set", s)]]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}/mcp/slack/"
        wait_for(url, proc)
        async with Client(url) as client:
            assert {t.name for t in await client.list_tools()} == {"list_channels", "read_history", "post_message"}
            res = await client.call_tool("post_message", {"channel": "general", "text": "from outside"})
            assert res.structured_content["message"]["text"] == "from outside"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port}/mcp/polygon/" in out and "stopped" in out
