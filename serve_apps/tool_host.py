"""One MCP server behind the pool's rules: enforced timeouts, bounded retries, a rate limit, named errors.

`ToolHost` is a plain class: a Serve replica owns one, the in-process pool owns one per server, and
the HTTP front forwards to it — so every path into a tool obeys the same rules.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from configs.schema import Deployment
from mcp_servers.errors import INFRA_KINDS, ErrorKind, ToolFault

log = logging.getLogger(__name__)


@dataclass
class ToolCallResult:
    """What a tool call returns through the pool (handle, in-process, or as seen over HTTP)."""

    server: str
    tool: str
    ok: bool
    text: str  # what an MCP client (and the model) reads
    structured: Any = None  # the JSON result, when the tool returned one
    error_kind: ErrorKind | None = None
    error: str | None = None
    latency_ms: float = 0.0
    attempts: int = 1

    @property
    def infra_fault(self) -> bool:
        """True when the infrastructure, not the caller, is to blame: never a policy penalty."""
        return self.error_kind in INFRA_KINDS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolCallResult:
        return cls(**d)


class ToolBackend(Protocol):
    """Where the tools really run: a FastMCP server in this process, or a client of a remote one."""

    async def list_tools(self) -> list[dict[str, Any]]: ...

    async def call(self, tool: str, arguments: dict[str, Any]) -> tuple[str, Any]:
        """Run one tool; return (text, structured) or raise (ToolFault or the backend's own errors)."""
        ...

    async def close(self) -> None: ...


class RateLimiter:
    """Token bucket: at most `rate` calls a second, bursts up to one second's worth."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.capacity = max(1.0, rate)
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        self.lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self.lock:
            while True:
                now = time.monotonic()
                self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= 1:
                    self.tokens -= 1
                    return
                await asyncio.sleep((1 - self.tokens) / self.rate)


def classify(exc: BaseException) -> tuple[ErrorKind, str, bool]:
    """Map an exception from a backend to (error kind, message, retryable)."""
    from fastmcp.exceptions import NotFoundError, ToolError
    from fastmcp.exceptions import ValidationError as FastMCPValidationError

    cause = exc.__cause__
    if isinstance(exc, ToolFault):
        return exc.kind, str(exc), exc.retryable
    if isinstance(cause, ToolFault):  # FastMCP wraps what a tool raised in a ToolError
        return cause.kind, str(cause), cause.retryable
    if isinstance(exc, FastMCPValidationError):
        return "invalid_arguments", _validation_message(cause or exc), False
    if isinstance(exc, NotFoundError):
        return "unknown_tool", str(exc), False
    if isinstance(exc, ToolError):
        # A remote MCP server reports every failure as a tool error; its text is all we get.
        text = str(exc)
        if text.startswith("Unknown tool"):
            return "unknown_tool", text, False
        if "validation error" in text.lower() or "invalid arguments" in text.lower():
            return "invalid_arguments", text, False
        return "upstream", text, False
    if isinstance(exc, ConnectionError | OSError | EOFError):
        return "unavailable", f"{type(exc).__name__}: {exc}", True
    return "upstream", f"{type(exc).__name__}: {exc}", False


def _validation_message(exc: BaseException) -> str:
    """'field: problem' lines from a pydantic error, so the model learns which argument was wrong."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    parts = []
    for e in errors():
        field = ".".join(str(p) for p in e.get("loc", ())) or "arguments"
        parts.append(f"{field}: {e.get('msg')}")
    return "invalid arguments: " + "; ".join(parts)


class ToolHost:
    """Calls the tools of one server with the deployment's timeouts, retries and rate limit."""

    def __init__(
        self,
        name: str,
        backend: ToolBackend,
        cfg: Deployment,
        replicas: int = 1,
        probe: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        """`probe`: a server's own health check, returning None when healthy or the reason it is not."""
        self.name = name
        self.backend = backend
        self.probe = probe
        self.cfg = cfg
        self.limiter = RateLimiter(cfg.rate_limit_per_s / replicas) if cfg.rate_limit_per_s else None
        self._tools: list[dict[str, Any]] | None = None

    async def list_tools(self) -> list[dict[str, Any]]:
        """The server's tools as MCP dicts: name, description, inputSchema."""
        if self._tools is None:
            self._tools = await self.backend.list_tools()
        return self._tools

    def timeout_for(self, tool: str) -> float:
        return self.cfg.tool_timeouts.get(tool, self.cfg.timeout_s)

    async def call_tool(self, tool: str, arguments: dict[str, Any] | None = None) -> ToolCallResult:
        """Call `tool`; never raises for a tool's failure — the result says what went wrong."""
        start = time.perf_counter()
        timeout = self.timeout_for(tool)
        attempt = 0
        while True:
            attempt += 1
            try:
                if not isinstance(arguments, dict | None):
                    raise TypeError("arguments must be a JSON object")
                if self.limiter:
                    await self.limiter.acquire()
                text, structured = await asyncio.wait_for(self.backend.call(tool, arguments or {}), timeout)
                return ToolCallResult(
                    self.name, tool, True, text, structured,
                    latency_ms=(time.perf_counter() - start) * 1e3, attempts=attempt,
                )  # fmt: skip
            except TimeoutError:
                message = f"{self.name}.{tool} timed out after {timeout:g} s"
                kind, retryable = "timeout", False
            except TypeError as e:
                kind, message, retryable = "invalid_arguments", str(e), False
            except Exception as e:
                kind, message, retryable = classify(e)
            if not retryable or attempt > self.cfg.max_retries:
                log.debug("%s.%s failed (%s): %s", self.name, tool, kind, message)
                return ToolCallResult(
                    self.name, tool, False, f"Error ({kind}): {message}", None, kind, message,
                    latency_ms=(time.perf_counter() - start) * 1e3, attempts=attempt,
                )  # fmt: skip
            await asyncio.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 1))

    async def healthy(self) -> None:
        """Raise if the server cannot list its tools or fails its probe (Serve restarts such a replica)."""
        self._tools = None
        if not await self.list_tools():
            raise RuntimeError(f"MCP server {self.name!r} lists no tools")
        if self.probe and (problem := await self.probe()):
            raise RuntimeError(f"MCP server {self.name!r} is unhealthy: {problem}")


# --------------------------------------------------------------------------- backends


def _text_of(content: list[Any]) -> str:
    """The text an MCP client shows for a result's content blocks (non-text blocks as JSON)."""
    parts = []
    for block in content:
        text = getattr(block, "text", None)
        parts.append(text if text is not None else json.dumps(block.model_dump(mode="json")))
    return "\n".join(parts)


class LocalBackend:
    """A FastMCP server in this process (a built-in server, or a test's)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    async def list_tools(self) -> list[dict[str, Any]]:
        tools = await self.server.list_tools()
        return [t.to_mcp_tool().model_dump(by_alias=True, exclude_none=True, mode="json") for t in tools]

    async def call(self, tool: str, arguments: dict[str, Any]) -> tuple[str, Any]:
        result = await self.server.call_tool(tool, arguments)
        return _text_of(result.content), result.structured_content

    async def close(self) -> None:
        return None


class ClientBackend:
    """A remote MCP server (stdio command or URL) through one persistent client session.

    The session is opened on first use and reopened once when a call finds it dropped.
    """

    def __init__(self, transport_factory: Any) -> None:
        self._factory = transport_factory
        self._client: Any = None
        self._lock = asyncio.Lock()

    async def _session(self) -> Any:
        async with self._lock:
            if self._client is None or not self._client.is_connected():
                from fastmcp import Client

                await self._drop()
                client = Client(self._factory())
                await client.__aenter__()
                self._client = client
            return self._client

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.__aexit__(None, None, None)
            except Exception as e:  # the session is already broken; closing it is best effort
                log.debug("closing a dropped MCP session: %s", e)

    async def _with_reconnect(self, fn: Any) -> Any:
        from fastmcp.exceptions import ToolError

        try:
            return await fn(await self._session())
        except ToolError:
            raise  # the server answered: nothing wrong with the session
        except Exception as e:
            log.warning("MCP session failed (%s: %s); reconnecting once", type(e).__name__, e)
            await self._drop()
            return await fn(await self._session())

    async def list_tools(self) -> list[dict[str, Any]]:
        tools = await self._with_reconnect(lambda c: c.list_tools())
        return [t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in tools]

    async def call(self, tool: str, arguments: dict[str, Any]) -> tuple[str, Any]:
        result = await self._with_reconnect(lambda c: c.call_tool(tool, arguments, raise_on_error=True))
        return _text_of(result.content), result.structured_content

    async def close(self) -> None:
        async with self._lock:
            await self._drop()
