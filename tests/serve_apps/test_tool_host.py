"""ToolHost's rules without Ray: retries only for retryable faults, rate limits, error mapping."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from configs.schema import Deployment
from mcp_servers.errors import InvalidArguments, UpstreamError
from serve_apps.tool_host import RateLimiter, ToolHost, ToolPoolTimeout


class Flaky:
    """A backend that fails `failures` times with `fault`, then answers."""

    def __init__(self, fault: Exception, failures: int) -> None:
        self.fault, self.failures, self.calls = fault, failures, 0

    async def open(self, episode_id: str | None = None) -> None:
        return None

    async def list_tools(self) -> list[dict[str, Any]]:
        return [{"name": "t", "inputSchema": {"type": "object"}}]

    async def call(self, tool: str, arguments: dict[str, Any], episode_id: str | None = None) -> tuple[str, Any]:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.fault
        return "fine", {"ok": True}

    async def end_episode(self, episode_id: str) -> None:
        return None

    async def close(self) -> None:
        return None


def host(backend: Flaky, **cfg: Any) -> ToolHost:
    return ToolHost("svc", backend, Deployment(retry_backoff_s=0.01, **cfg))


async def test_retryable_faults_are_retried_until_success():
    backend = Flaky(UpstreamError("503 from upstream", retryable=True), failures=2)
    r = await host(backend, max_retries=2).call_tool("t", {})
    assert r.ok and r.attempts == 3 and backend.calls == 3


async def test_retries_are_bounded_and_the_fault_is_named():
    backend = Flaky(UpstreamError("503 from upstream", retryable=True), failures=10)
    r = await host(backend, max_retries=2).call_tool("t", {})
    assert not r.ok and r.error_kind == "upstream" and r.infra_fault
    assert r.attempts == 3 and backend.calls == 3


async def test_non_retryable_faults_are_not_retried():
    for fault in (UpstreamError("404 from upstream"), InvalidArguments("ticker 'ZZZ' is unknown")):
        backend = Flaky(fault, failures=1)
        r = await host(backend, max_retries=3).call_tool("t", {})
        assert not r.ok and r.attempts == 1 and backend.calls == 1
        assert r.text.startswith(f"Error ({r.error_kind}):")


async def test_per_tool_timeout_overrides_the_default():
    class Slow(Flaky):
        async def call(self, tool: str, arguments: dict[str, Any], episode_id: str | None = None) -> tuple[str, Any]:
            await asyncio.sleep(5)
            return "late", None

    h = host(Slow(UpstreamError("x"), 0), timeout_s=30, tool_timeouts={"t": 0.2})
    assert h.timeout_for("t") == 0.2 and h.timeout_for("other") == 30
    r = await h.call_tool("t", {})
    assert r.error_kind == "timeout" and "0.2 s" in r.error


async def test_rate_limit_spaces_calls():
    limiter = RateLimiter(rate=20)  # a burst of 20, then one call every 50 ms
    start = time.monotonic()
    for _ in range(30):
        await limiter.acquire()
    assert time.monotonic() - start >= 0.45  # 10 calls beyond the burst, 50 ms apart at the least


async def test_rate_limit_is_split_across_replicas():
    h = ToolHost("svc", Flaky(UpstreamError("x"), 0), Deployment(rate_limit_per_s=10), replicas=2)
    assert h.limiter is not None and h.limiter.rate == 5


async def test_health_check_runs_the_servers_probe():
    h = ToolHost("svc", Flaky(UpstreamError("x"), 0), Deployment(), probe=lambda: _answer("bwrap is missing"))
    with pytest.raises(RuntimeError, match="bwrap is missing"):
        await h.healthy()
    await ToolHost("svc", Flaky(UpstreamError("x"), 0), Deployment(), probe=lambda: _answer(None)).healthy()


async def _answer(value: str | None) -> str | None:
    return value


class Hung(Flaky):
    """A backend that never answers anything."""

    async def open(self, episode_id: str | None = None) -> None:
        await asyncio.sleep(3600)

    async def list_tools(self) -> list[dict[str, Any]]:
        await asyncio.sleep(3600)
        return []

    async def end_episode(self, episode_id: str) -> None:
        await asyncio.sleep(3600)

    async def close(self) -> None:
        await asyncio.sleep(3600)


async def test_every_operation_is_bounded_and_names_the_server():
    h = ToolHost("git", Hung(UpstreamError("x"), 0), Deployment(open_timeout_s=0.2, close_timeout_s=0.1))
    with pytest.raises(ToolPoolTimeout, match=r"^server 'git' did not answer open within 0.2s$"):
        await h.list_tools()
    r = await h.call_tool("t", {})  # a server that cannot be opened is the infrastructure's fault
    assert r.error_kind == "unavailable" and r.infra_fault and r.error == "server 'git' did not answer open within 0.2s"
    with pytest.raises(ToolPoolTimeout, match=r"'git' did not answer end_episode within 0.1s"):
        await h.end_episode("e1")
    with pytest.raises(ToolPoolTimeout, match=r"'git' did not answer close within 0.1s"):
        await h.close()

    class OpensThenHangs(Hung):
        async def open(self, episode_id: str | None = None) -> None:
            return None

    h = ToolHost("git", OpensThenHangs(UpstreamError("x"), 0), Deployment(list_timeout_s=0.2))
    with pytest.raises(ToolPoolTimeout, match=r"'git' did not answer list_tools within 0.2s"):
        await h.list_tools()
