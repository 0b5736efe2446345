"""`python -m jobs.serve_tools` end to end: an outside MCP client lists and calls, Ctrl-C stops it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from fastmcp import Client

from mcp_servers import mcprl_version
from tests.conftest import free_port, ignore_sigint

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Output:
    """Collects a process's output lines in a thread, so the test can wait for one without blocking."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        self.thread.start()

    def wait_for(self, text: str, proc: subprocess.Popen, within_s: float = 240) -> None:
        deadline = time.monotonic() + within_s
        while not any(text in line for line in self.lines):
            assert proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, f"no {text!r} within {within_s} s:\n" + "".join(self.lines)
            time.sleep(0.2)

    def text(self) -> str:
        self.thread.join(timeout=30)
        return "".join(self.lines)


async def test_serve_tools_serves_mcp_to_an_outside_client_and_stops_on_interrupt():
    port = free_port()
    sets = [f"tools.http.port={port}"] + [f"tools.servers.{n}.enabled=false" for n in ("fmp", "tavily", "python")]
    args = [sys.executable, "-m", "jobs.serve_tools", *[a for s in sets for a in ("--set", s)]]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # started with SIGINT ignored, as a script's background job is (and as a test process may hand it down)
    proc = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ignore_sigint
    )
    output = Output(proc)
    try:
        output.wait_for("Serving; press Ctrl-C to stop.", proc)
        url = f"http://127.0.0.1:{port}/mcp/slack/"
        async with Client(url) as client:
            assert client.server_info.version == mcprl_version()  # ours, not FastMCP's
            assert {t.name for t in await client.list_tools()} == {"list_channels", "read_history", "post_message"}
            res = await client.call_tool("post_message", {"channel": "general", "text": "from outside"})
            assert res.structured_content["message"]["text"] == "from outside"
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:  # say where it hangs, not only that it does
            spy = [os.path.join(os.path.dirname(sys.executable), "py-spy"), "dump", "--pid", str(proc.pid)]
            stack = subprocess.run(spy, capture_output=True, text=True)
            lines = "".join(output.lines)
            raise AssertionError(f"no exit 120 s after SIGINT:\n{stack.stdout}{stack.stderr}\n{lines}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
    out = output.text()
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port}/mcp/polygon/" in out and "stopped" in out
    assert "Traceback" not in out
