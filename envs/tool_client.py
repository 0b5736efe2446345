"""How the environment reaches its tools and its judge.

A tool client is any object with `call_tool`, `list_tools` and `end_episode` (`ToolClient`): the Serve
pool (`serve_apps.tool_pool.ServeToolPool`) and the in-process pool (`LocalToolPool`) both fit. A judge
is any `envs.judge.JudgeLike`.

Who builds an `MCPToolEnv` either hands it both (mcprl's episode runners do: the Serve pool and the
judge deployment the driver set up), or the env builds them from its `env_config` alone, which is
what a trainer that is not ours needs (SkyRL's generator calls `skyrl_gym.make` in its own worker
processes):

- tools: `env.tools` (`configs.schema.ToolSource`): an in-process pool of the configured servers,
  the Serve pool's applications, or MCP endpoints over streamable HTTP;
- judge: `reward.judge.source`: in-process against an OpenAI-compatible endpoint, or the Serve
  deployment.

Clients built from config are made once per process and config, and live on a loop thread of their
own: SkyRL drives `env.step` from a thread pool, each thread with its own event loop, while an MCP
session or an HTTP connection pool belongs to the loop that opened it. Every call hops to that loop.

`set_tool_client` overrides the config for every env built in this process (tests, notebooks).
envs/ sits below serve_apps/, so the pools are imported lazily, by the functions that build them.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from configs.schema import JudgeConfig, RewardConfig, ToolsConfig, ToolSource

if TYPE_CHECKING:
    from envs.judge import JudgeLike

log = logging.getLogger(__name__)


class ToolResultLike(Protocol):
    ok: bool
    text: str
    structured: Any
    error_kind: str | None
    error: str | None
    latency_ms: float

    @property
    def infra_fault(self) -> bool: ...


class ToolClient(Protocol):
    async def call_tool(
        self, server: str, tool: str, arguments: dict[str, Any] | None = None, *, episode_id: str | None = None
    ) -> ToolResultLike:
        """`episode_id`: the episode whose tool state the call reads and writes (None = shared state)."""
        ...

    async def list_tools(self) -> dict[str, list[dict[str, Any]]]: ...

    async def end_episode(self, episode_id: str) -> None:
        """Drop the episode's state on every stateful server (idempotent)."""
        ...


_override: ToolClient | None = None


def set_tool_client(client: ToolClient | None) -> None:
    """The client every env built in this process uses, whatever its config says (None to clear)."""
    global _override
    _override = client


# --------------------------------------------------------------------------- a loop of their own


class LoopThread:
    """An event loop on a daemon thread; coroutines submitted from any thread or loop run there."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """A concurrent Future of the coroutine's result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Await the coroutine on this loop from the caller's loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel what still runs on the loop and wait for it, then stop and close the loop: no task is
        left pending for the interpreter's exit to destroy."""

        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            await self.loop.shutdown_asyncgens()

        try:
            self.submit(cancel_the_rest()).result(timeout_s)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)
            if not self.thread.is_alive():
                self.loop.close()


class OnOwnLoop:
    """Wraps an object whose async methods must run on the loop that built it (see the module docstring)."""

    def __init__(self, target: Any, runner: LoopThread) -> None:
        self._target = target
        self._runner = runner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr

        async def hop(*args: Any, **kwargs: Any) -> Any:
            return await self._runner.run(attr(*args, **kwargs))

        return hop

    def close_and_stop(self, timeout_s: float = 10.0) -> None:
        """Close the object on its loop (`close` or `aclose`: MCP sessions, stdio programs, HTTP pools),
        then stop the loop."""
        closes = (getattr(self._target, name, None) for name in ("close", "aclose"))
        close = next((c for c in closes if asyncio.iscoroutinefunction(c)), None)
        try:
            if close is not None:
                self._runner.submit(close()).result(timeout_s)
        except Exception as e:  # the process is ending; one client's fault must not keep the rest open
            log.warning("closing %s: %s: %s", type(self._target).__name__, type(e).__name__, e)
        finally:
            self._runner.stop(timeout_s)


_built: dict[str, OnOwnLoop] = {}
_built_lock = threading.Lock()


def _once(key: str, build: Callable[[], Coroutine[Any, Any, Any]], name: str) -> OnOwnLoop:
    """The object `build()` makes, built once per process and key on its own loop thread."""
    with _built_lock:
        hit = _built.get(key)
        if hit is None:
            if not _built:  # the process owns them: closed at its exit (close_built), while their loops still run
                atexit.register(close_built)
            runner = LoopThread(name)
            hit = _built[key] = OnOwnLoop(runner.submit(build()).result(), runner)
        return hit


def close_built() -> None:
    """Close every client built from config and stop its loop. Without this, the interpreter's exit
    destroys their pending session tasks ("Task was destroyed but it is pending!", then "no running
    event loop" from the MCP client's cleanup) and leaves stdio programs to be killed. Registered with
    atexit by the first build (atexit runs before daemon threads stop), since a trainer that builds envs
    from config (SkyRL) has no hook at its end; callers that have one may call it themselves."""
    with _built_lock:
        built = list(_built.values())
        _built.clear()
        atexit.unregister(close_built)
    for hit in built:
        hit.close_and_stop()


# --------------------------------------------------------------------------- tools


def tools_section(value: str | Mapping[str, Any] | ToolsConfig | None) -> ToolsConfig:
    """A tools config from a YAML file (an mcprl config with a `tools:` section), a dict (the section, or
    a mapping holding it under `tools`), or a ToolsConfig; empty = the defaults."""
    if isinstance(value, ToolsConfig):
        return value
    if not value:
        return ToolsConfig()
    if isinstance(value, str):
        from configs.loader import load_config

        return load_config(value).tools
    section = value.get("tools", value) if isinstance(value, Mapping) else value
    return ToolsConfig.model_validate(dict(section))


def http_tools_config(source: ToolSource) -> ToolsConfig:
    """The `http` source as a pool of URL servers (built-ins off): `<url>/mcp/<server>/` and `endpoints`."""
    endpoints = {s: f"{source.url.rstrip('/')}/mcp/{s}/" for s in source.servers} if source.url else {}
    endpoints.update(source.endpoints)
    headers = {"Authorization": f"Bearer ${{{source.bearer_token_env}}}"} if source.bearer_token_env else {}
    if source.bearer_token_env and not os.environ.get(source.bearer_token_env):
        raise ValueError(f"env.tools.bearer_token_env names {source.bearer_token_env}, which is not set")
    off = {name: {"enabled": False} for name in ToolsConfig().servers.model_dump()}
    external = [{"name": name, "url": url, "headers": headers} for name, url in endpoints.items()]
    return ToolsConfig.model_validate({"servers": off, "external": external})


async def _serve_pool(source: ToolSource) -> Any:
    import ray
    from ray import serve

    from serve_apps.tool_pool import APP_PREFIX, ServeToolPool

    if not ray.is_initialized():
        ray.init(address=source.ray_address or os.environ.get("RAY_ADDRESS") or "auto", logging_level="ERROR")
    apps = [a for a in serve.status().applications if a.startswith(APP_PREFIX)]
    servers = source.servers or [a[len(APP_PREFIX) :] for a in apps]
    missing = [s for s in servers if APP_PREFIX + s not in apps]
    if missing or not servers:
        raise RuntimeError(
            f"env.tools source serve: no Serve application for {missing or 'any server'} "
            f"(running: {sorted(apps) or 'none'}); start the pool with `python -m jobs.serve_tools`"
        )
    return ServeToolPool({s: serve.get_app_handle(APP_PREFIX + s) for s in servers}, base_url="")


def tool_client_from_config(
    source: ToolSource, tools: str | Mapping[str, Any] | ToolsConfig | None = None
) -> ToolClient:
    """The tool client `source` describes, built once per process and config (see the module docstring).

    `tools`: the servers for the `local` source when `source.config` is empty (env_config's `tools` key).
    """
    if source.source == "serve":
        return _once(f"serve:{source.model_dump_json()}", lambda: _serve_pool(source), "mcprl-tools-serve")
    cfg = http_tools_config(source) if source.source == "http" else tools_section(source.config or tools)

    async def build() -> Any:
        from serve_apps.tool_pool import LocalToolPool

        return await LocalToolPool.create(cfg)

    return _once(f"{source.source}:{cfg.model_dump_json()}", build, f"mcprl-tools-{source.source}")


def resolve_tool_client(source: ToolSource, tools: Any = None) -> ToolClient:
    """`set_tool_client`'s override when one is set, else `tool_client_from_config`."""
    return _override if _override is not None else tool_client_from_config(source, tools)


# --------------------------------------------------------------------------- judge


def judge_from_config(cfg: RewardConfig | JudgeConfig) -> JudgeLike:
    """The judge `judge.source` names, built once per process and config (see envs.judge_serve.judge_client)."""
    reward = cfg if isinstance(cfg, RewardConfig) else RewardConfig(judge=cfg)

    async def build() -> JudgeLike:
        from envs.judge_serve import judge_client

        return await asyncio.to_thread(judge_client, reward)  # may join Ray and deploy: blocking calls

    key = json.dumps(reward.judge.model_dump(mode="json"), sort_keys=True)
    return _once(f"judge:{key}", build, "mcprl-judge")


__all__ = [
    "LoopThread",
    "OnOwnLoop",
    "ToolClient",
    "close_built",
    "judge_from_config",
    "resolve_tool_client",
    "set_tool_client",
    "tool_client_from_config",
]
