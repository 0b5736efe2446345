"""Fixtures of the pool tests: the test MCP server over streamable HTTP, as an external URL server."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

STDIO_SERVER = str(Path(__file__).with_name("stdio_server.py"))


@pytest.fixture(scope="session")
def notes_url() -> str:
    """The test server over streamable HTTP on loopback, in its own process; its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, STDIO_SERVER, "--http", str(port)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp/"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url, timeout=1)  # any answer (a 4xx for a bare GET) means it listens
            break
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the test MCP server did not start on port {port}") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=10)
