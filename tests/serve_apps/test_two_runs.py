"""Two runs on one machine, each with its own embedded Ray: the second moves off the port the first serves on.

Serve's proxy binds with SO_REUSEPORT, so before this a second run shared the first one's port and the kernel
split each run's MCP clients between the two runs' tools. The first run is this test session's Ray; the
second is a fresh process that starts its Ray and deploys its pool the way the driver does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from fastmcp import Client

from configs.loader import load_config
from serve_apps.tool_pool import deploy_pool, undeploy_pool
from tests.conftest import free_port

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
BUILTINS = ("polygon", "fmp", "tavily", "slack", "python")

SECOND_RUN = """
import json, logging, sys
from cluster.ray_env import start_ray, stop_ray
from configs.loader import load_config
from configs.schema import ClusterConfig, HttpConfig
from serve_apps.tool_pool import deploy_pool, undeploy_pool

logging.basicConfig(level=logging.WARNING, format="%(message)s")
cfg = load_config(None, [f"tools.servers.{n}.enabled=false" for n in SERVERS_OFF])
# The port the first run holds, as this run's default: not written in its config, so it may move.
cfg.tools.http = HttpConfig.model_construct(_fields_set=set(), host="127.0.0.1", port=PORT, bearer_token_env=None)
handle = start_ray(ClusterConfig(num_cpus=1))
pool = deploy_pool(cfg.tools)
print(json.dumps({"started_here": handle.started_here, "base_url": pool.base_url}), flush=True)
sys.stdin.readline()  # serve until the test has called both runs
undeploy_pool(pool)
stop_ray(handle)
"""


def _off(keep: str) -> list[str]:
    """Every built-in server but `keep`."""
    return [n for n in BUILTINS if n != keep]


def _disable(name: str) -> str:
    return f"tools.servers.{name}.enabled=false"


async def _tool_names(url: str) -> set[str]:
    async with Client(url) as client:
        return {t.name for t in await client.list_tools()}


def _wait_for_json(out: Path, proc: subprocess.Popen, within_s: float = 300) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        lines = [line for line in out.read_text().splitlines() if line.startswith("{")]
        if lines:
            return json.loads(lines[-1])
        assert proc.poll() is None, out.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no pool within {within_s} s:\n{out.read_text()[-3000:]}"
        time.sleep(0.5)


async def test_a_second_run_with_its_own_ray_serves_its_pool_on_another_port(ray_cluster, tmp_path: Path) -> None:
    first = deploy_pool(load_config(None, [f"tools.http.port={free_port()}", *map(_disable, _off("slack"))]).tools)
    taken = urlsplit(first.base_url).port  # Serve's real port (the session's Serve may have started earlier)
    code = f"PORT = {taken}\nSERVERS_OFF = {_off('polygon')!r}\n" + SECOND_RUN
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, not this session's
    out = tmp_path / "second.log"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=sink, stderr=sink, text=True
        )
    try:
        second = _wait_for_json(out, proc)
        assert second["started_here"]
        moved = urlsplit(second["base_url"]).port
        assert second["base_url"] == f"http://127.0.0.1:{moved}" and moved != taken
        said = f"tools.http.port {taken} is in use (another run?): the MCP tool pool serves on 127.0.0.1:{moved}"
        assert said in out.read_text().splitlines()
        # Both serve at once, each its own tools: every connection to a port reaches that port's run.
        for _ in range(3):
            assert await _tool_names(first.url("slack")) == {"list_channels", "read_history", "post_message"}
            assert "previous_close" in await _tool_names(f"{second['base_url']}/mcp/polygon/")
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=120) == 0, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        undeploy_pool(first)
