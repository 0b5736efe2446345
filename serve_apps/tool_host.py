"""One MCP server behind the pool's rules: enforced timeouts, bounded retries, a rate limit, named errors.

`ToolHost` is a plain class: a Serve replica owns one, the in-process pool owns one per server, and
the HTTP front forwards to it — so every path into a tool obeys the same rules.

Every operation is bounded: opening a server's session (`open_timeout_s`), listing its tools
(`list_timeout_s`), each call (`timeout_s`, `tool_timeouts`) and closing (`close_timeout_s`). One that
overruns raises `ToolPoolTimeout`, which names the server and the operation; a call reports it in its
result instead (kind `timeout` for the call itself, `unavailable` when the server could not be opened).

Episodes: `call_tool(..., episode_id=...)` runs the call in that episode's state on a stateful server
(the offline Slack: one workspace per episode; an external server marked `stateful`: one client
session, for stdio one process, per episode), and `end_episode(episode_id)` drops it. Stateless
servers ignore the id, except that a client of a remote MCP server passes it on in the request's
`_meta` (`EPISODE_META`), so a remote mcprl pool keeps episodes apart too, and ends them with a call
of the reserved tool `END_EPISODE_TOOL`. Live backends (the real Slack, Polygon...) cannot be
isolated: an episode that posts to the real Slack posts where every other episode reads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from cluster.metrics import TOOL_ERRORS, TOOL_LATENCY, record
from cluster.retry import RetryPolicy, retry_async
from configs.schema import Deployment
from mcp_servers.episodes import EpisodeStates, current_episode, end_episode_hook
from mcp_servers.errors import INFRA_KINDS, ErrorKind, ToolFault

log = logging.getLogger(__name__)

# The request `_meta` key that carries the episode id over MCP (HTTP or stdio).
EPISODE_META = "mcprl/episode_id"
# A reserved tool, never listed: calling it with EPISODE_META in `_meta` ends that episode on the server.
END_EPISODE_TOOL = "mcprl.end_episode"


class ToolPoolError(RuntimeError):
    """A server of the pool could not be reached at all (opening its session failed); names the server."""


class ToolPoolTimeout(TimeoutError):
    """A server did not answer a pool operation (open, list_tools, call_tool, close) in time."""

    def __init__(self, server: str, operation: str, seconds: float) -> None:
        super().__init__(f"server {server!r} did not answer {operation} within {seconds:g}s")
        self.server, self.operation, self.seconds = server, operation, seconds


async def bounded(server: str, operation: str, aw: Awaitable[Any], seconds: float) -> Any:
    """Await `aw` for at most `seconds`; past that, raise ToolPoolTimeout naming the server."""
    try:
        return await asyncio.wait_for(aw, seconds)
    except TimeoutError:
        raise ToolPoolTimeout(server, operation, seconds) from None


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

    async def open(self, episode_id: str | None = None) -> None:
        """Be ready to serve this episode (None: the shared state): connect, start a process. Idempotent."""
        ...

    async def list_tools(self) -> list[dict[str, Any]]: ...

    async def call(self, tool: str, arguments: dict[str, Any], episode_id: str | None = None) -> tuple[str, Any]:
        """Run one tool; return (text, structured) or raise (ToolFault or the backend's own errors)."""
        ...

    async def end_episode(self, episode_id: str) -> None:
        """Drop this episode's state, if any. Idempotent."""
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

    def set_rate(self, rate: float) -> None:
        """Change the rate from now on (tokens already earned stay, up to the new burst size)."""
        self.rate = rate
        self.capacity = max(1.0, rate)
        self.tokens = min(self.tokens, self.capacity)

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
        metrics_run: str | None = None,
    ) -> None:
        """`replicas`: how many hosts share the service's rate limit (see `set_replicas`). `probe`: a server's own
        health check, returning None when healthy or the reason it is not. `metrics_run`: the run tag of the tool
        latency and error metrics (cluster.metrics); None = none."""
        self.name = name
        self.metrics_run = metrics_run
        self.backend = backend
        self.probe = probe
        self.cfg = cfg
        self.replicas = max(1, replicas)
        self.limiter = RateLimiter(cfg.rate_limit_per_s / self.replicas) if cfg.rate_limit_per_s else None
        self.retry_policy = RetryPolicy(cfg.max_retries, cfg.retry_backoff_s)
        self._tools: list[dict[str, Any]] | None = None

    def set_replicas(self, replicas: int) -> None:
        """`replicas` hosts now share the service: this one's share of `rate_limit_per_s` follows."""
        self.replicas = max(1, replicas)
        if self.limiter and self.cfg.rate_limit_per_s:
            self.limiter.set_rate(self.cfg.rate_limit_per_s / self.replicas)

    @property
    def rate_per_s(self) -> float | None:
        """This host's share of the service's rate limit (None: unlimited)."""
        return self.limiter.rate if self.limiter else None

    async def open(self, episode_id: str | None = None) -> None:
        """Connect the backend (for this episode, on a stateful server); ToolPoolTimeout past open_timeout_s."""
        await bounded(self.name, "open", self.backend.open(episode_id), self.cfg.open_timeout_s)

    async def list_tools(self) -> list[dict[str, Any]]:
        """The server's tools as MCP dicts: name, description, inputSchema."""
        if self._tools is None:
            await self.open()
            self._tools = await bounded(self.name, "list_tools", self.backend.list_tools(), self.cfg.list_timeout_s)
        return self._tools

    def timeout_for(self, tool: str) -> float:
        return self.cfg.tool_timeouts.get(tool, self.cfg.timeout_s)

    async def call_tool(
        self, tool: str, arguments: dict[str, Any] | None = None, *, episode_id: str | None = None
    ) -> ToolCallResult:
        """Call `tool` in this episode's state (None: shared); never raises for a tool's failure — the
        result says what went wrong."""
        result = await self._call_tool(tool, arguments, episode_id)
        if self.metrics_run is not None:
            self._record(result)
        return result

    def _record(self, result: ToolCallResult) -> None:
        # A name the model made up is not a tag value: one series per hallucination would have no bound.
        tool = "(unknown)" if result.error_kind == "unknown_tool" else result.tool
        tags = {"run": self.metrics_run, "server": self.name, "tool": tool}
        record(TOOL_LATENCY, result.latency_ms / 1e3, **tags)
        if not result.ok:
            record(TOOL_ERRORS, 1, kind=result.error_kind or "unknown", **tags)

    async def _call_tool(self, tool: str, arguments: dict[str, Any] | None, episode_id: str | None) -> ToolCallResult:
        start = time.perf_counter()
        timeout = self.timeout_for(tool)
        try:  # opening (a new episode's process, say) is not the call's time: bounded on its own
            await self.open(episode_id)
        except Exception as e:
            kind, message = ("unavailable", str(e)) if isinstance(e, ToolPoolTimeout) else classify(e)[:2]
            return ToolCallResult(
                self.name, tool, False, f"Error ({kind}): {message}", None, kind, message,
                latency_ms=(time.perf_counter() - start) * 1e3,
            )  # fmt: skip

        async def once(attempt: int) -> tuple[ToolCallResult, bool]:
            """One try: (the result, whether its failure is worth another try)."""
            try:
                if not isinstance(arguments, dict | None):
                    raise TypeError("arguments must be a JSON object")
                if self.limiter:
                    await self.limiter.acquire()
                call = self.backend.call(tool, arguments or {}, episode_id)
                text, structured = await asyncio.wait_for(call, timeout)
                return ToolCallResult(
                    self.name, tool, True, text, structured,
                    latency_ms=(time.perf_counter() - start) * 1e3, attempts=attempt,
                ), False  # fmt: skip
            except TimeoutError:
                message = f"{self.name}.{tool} timed out after {timeout:g} s"
                kind, retryable = "timeout", False
            except TypeError as e:
                kind, message, retryable = "invalid_arguments", str(e), False
            except Exception as e:
                kind, message, retryable = classify(e)
            return ToolCallResult(
                self.name, tool, False, f"Error ({kind}): {message}", None, kind, message,
                latency_ms=(time.perf_counter() - start) * 1e3, attempts=attempt,
            ), retryable  # fmt: skip

        result, _ = await retry_async(once, self.retry_policy, retry_result=lambda outcome: outcome[1])
        if not result.ok:
            log.debug("%s.%s failed (%s): %s", self.name, tool, result.error_kind, result.error)
        return result

    async def end_episode(self, episode_id: str) -> None:
        """Drop the episode's state (idempotent); ToolPoolTimeout past close_timeout_s."""
        await bounded(self.name, "end_episode", self.backend.end_episode(episode_id), self.cfg.close_timeout_s)

    async def close(self) -> None:
        """Close the backend's sessions and processes; ToolPoolTimeout past close_timeout_s."""
        await bounded(self.name, "close", self.backend.close(), self.cfg.close_timeout_s)

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

    async def open(self, episode_id: str | None = None) -> None:
        return None

    async def list_tools(self) -> list[dict[str, Any]]:
        tools = await self.server.list_tools()
        return [t.to_mcp_tool().model_dump(by_alias=True, exclude_none=True, mode="json") for t in tools]

    async def call(self, tool: str, arguments: dict[str, Any], episode_id: str | None = None) -> tuple[str, Any]:
        token = current_episode.set(episode_id)  # a stateful server picks the episode's state by it
        try:
            result = await self.server.call_tool(tool, arguments)
        finally:
            current_episode.reset(token)
        return _text_of(result.content), result.structured_content

    async def end_episode(self, episode_id: str) -> None:
        if hook := end_episode_hook(self.server):
            await hook(episode_id)

    async def close(self) -> None:
        return None


class _Session:
    """One MCP client session, opened on first use. Closing it ends the stdio program, if it has one."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._client: Any = None
        self._lock = asyncio.Lock()

    async def get(self) -> Any:
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
                # close(), not __aexit__: fastmcp keeps a stdio program alive past the context unless the
                # transport is closed too, and programs left running hang the event loop's shutdown.
                await client.close()
            except Exception as e:  # the session is already broken; closing it is best effort
                log.debug("closing a dropped MCP session: %s", e)

    async def close(self) -> None:
        async with self._lock:
            await self._drop()

    async def run(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        """`fn(client)`, reconnecting once when the session turns out to be dropped."""
        from fastmcp.exceptions import ToolError

        try:
            return await fn(await self.get())
        except ToolError:
            raise  # the server answered: nothing wrong with the session
        except Exception as e:
            log.warning("MCP session failed (%s: %s); reconnecting once", type(e).__name__, e)
            await self.close()
            return await fn(await self.get())


class ClientBackend:
    """A remote MCP server (stdio command or URL) through persistent client sessions.

    One shared session serves every call of a stateless server. A `stateful` one also gets one session
    per episode (for stdio: its own process), closed at `end_episode`; at most `max_live_episodes`.
    Each call made in an episode carries its id in `_meta`; with `forward_episodes` (a URL server,
    which may be another mcprl pool) `end_episode` is passed on as a call of END_EPISODE_TOOL.
    """

    def __init__(
        self,
        transport_factory: Callable[[], Any],
        *,
        name: str = "mcp",
        stateful: bool = False,
        forward_episodes: bool = False,
        max_live_episodes: int = 64,
    ) -> None:
        self._factory = transport_factory
        self.stateful = stateful
        self.forward_episodes = forward_episodes
        self._shared = _Session(transport_factory)
        self._episodes: EpisodeStates[_Session] = EpisodeStates(name, max_live_episodes)

    def _session(self, episode_id: str | None) -> _Session:
        if not self.stateful or episode_id is None:
            return self._shared
        session = self._episodes.get(episode_id)
        if session is None:
            session = _Session(self._factory)
            for old in self._episodes.add(episode_id, session):
                _close_soon(old)
        return session

    async def open(self, episode_id: str | None = None) -> None:
        await self._session(episode_id).get()

    async def list_tools(self) -> list[dict[str, Any]]:
        tools = await self._shared.run(lambda c: c.list_tools())
        return [t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in tools]

    async def call(self, tool: str, arguments: dict[str, Any], episode_id: str | None = None) -> tuple[str, Any]:
        meta = {EPISODE_META: episode_id} if episode_id is not None else None
        result = await self._session(episode_id).run(
            lambda c: c.call_tool(tool, arguments, raise_on_error=True, meta=meta)
        )
        return _text_of(result.content), result.structured_content

    async def end_episode(self, episode_id: str) -> None:
        session = self._episodes.pop(episode_id)
        if session is not None:
            await session.close()
        if self.forward_episodes:
            meta = {EPISODE_META: episode_id}
            result = await self._shared.run(lambda c: c.call_tool_mcp(END_EPISODE_TOOL, {}, meta=meta))
            if result.is_error:  # a server that is not an mcprl pool has no such tool, nor episodes to end
                log.debug("%s did not end episode %r: %s", END_EPISODE_TOOL, episode_id, _text_of(result.content))

    async def close(self) -> None:
        await asyncio.gather(self._shared.close(), *(s.close() for s in self._episodes.pop_all()))


_closing: set[asyncio.Task[None]] = set()


def _close_soon(session: _Session) -> None:
    """Close an evicted session in the background (eviction happens in a synchronous step)."""
    task = asyncio.get_running_loop().create_task(session.close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)
