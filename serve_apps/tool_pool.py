"""The MCP tool pool: one Ray Serve application per MCP server, and the clients that call it.

Each replica builds its server in-process (FastMCP apps cannot be pickled from the driver) and
offers two doors: MCP over stateless streamable HTTP at `/mcp/<server>/` (and `/mcp/<server>/mcp`)
for any MCP client, and handle methods (`call_tool`, `list_tools`) for callers inside the cluster.
`LocalToolPool` is the same pool without Ray, for unit tests, notebooks and the benchmark's baseline.

Episodes. `call_tool(server, tool, arguments, episode_id=...)` runs a call in that episode's own
state on a stateful server, and `end_episode(episode_id)` drops the episode's state on every server
(idempotent). Episode id None is the shared state (tools used outside episodes: task validation,
generation). Stateful servers are the offline Slack (one SQLite workspace per episode, copied from the
fixture) and any external server marked `stateful: true` (one client session per episode; for stdio,
one process). Over MCP HTTP the id travels in the request's `_meta` under `mcprl/episode_id`; an HTTP
client ends an episode by calling the reserved, unlisted tool `mcprl.end_episode` with that `_meta`
(see serve_apps.mcp_front). A pool of URL servers pointing at this pool keeps the isolation, since
its clients send both.

On Serve, per-episode state lives in a replica's memory, so all of an episode's calls must reach the
same replica. Serve's routing by key (model multiplexing, `handle.options(multiplexed_model_id=...)`)
is only best effort: it prefers a replica that holds the key, but sends the request elsewhere when
that replica is busy or none holds it yet, and a replica that dies takes its episodes with it. So
stateful servers run exactly one replica (the config refuses more); a replica restarted mid-episode
comes back with fresh state, from the fixture. One replica of the offline Slack (SQLite in memory)
serves far more calls than a rollout makes.

Live backends (the real Slack, Polygon, FMP, Tavily) cannot be isolated: every episode reads and
writes the one real service.

Resources and scale: each replica reserves its server's `replica_resources` (Serve's `ray_actor_options`);
`autoscaling` lets Serve add replicas under load and remove them when quiet. A server's `rate_limit_per_s`
is for the whole service: each replica takes its share, 1/n for the n replicas RUNNING now, and re-reads
n from Serve every REPLICA_COUNT_PERIOD_S (so for a few seconds after a change the replicas together may
allow up to one share more, or less, than the limit).

Every pool operation has a timeout (per server: `open_timeout_s`, `list_timeout_s`, `timeout_s`,
`close_timeout_s`); one that overruns raises (or, for a call, returns) an error that names the server,
e.g. `ToolPoolTimeout: server 'git' did not answer list_tools within 10s`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from cluster.ray_env import listen_port
from cluster.retry import REPLICA_RETRY_WAIT_S, RetryPolicy, retry_async
from configs.schema import Deployment, ExternalServer, HttpConfig, PythonToolConfig, ToolsConfig
from mcp_servers import build_server, health_probe
from mcp_servers.errors import UnknownTool
from serve_apps.mcp_front import MCP_SUFFIX, build_front, http_app
from serve_apps.tool_host import (
    ClientBackend,
    LocalBackend,
    ToolBackend,
    ToolCallResult,
    ToolHost,
    ToolPoolError,
    ToolPoolTimeout,
    bounded,
)

log = logging.getLogger(__name__)

APP_PREFIX = "mcp-"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# API keys the live backends read; a replica gets only the one its server needs.
LIVE_KEYS = {"polygon": "POLYGON_API_KEY", "fmp": "FMP_API_KEY", "tavily": "TAVILY_API_KEY", "slack": "SLACK_BOT_TOKEN"}
REPLICA_COUNT_PERIOD_S = 2.0  # how often an autoscaled, rate-limited replica re-reads its deployment's replica count


@dataclass
class ServerSpec:
    """Everything a replica needs to build one server: plain data, so it pickles."""

    name: str
    cfg: Deployment
    external: bool = False
    metrics_run: str | None = None  # the run tag of its tool metrics; None = no metrics

    @property
    def max_replicas(self) -> int:
        scaling = self.cfg.autoscaling
        return scaling.max_replicas if scaling else self.cfg.replicas

    @property
    def min_replicas(self) -> int:
        scaling = self.cfg.autoscaling
        return scaling.min_replicas if scaling else self.cfg.replicas


def server_specs(cfg: ToolsConfig, metrics_run: str | None = None) -> list[ServerSpec]:
    """The enabled servers of a tools config, built-ins first."""
    specs = [
        ServerSpec(name, getattr(cfg.servers, name), metrics_run=metrics_run) for name in type(cfg.servers).model_fields
    ]
    specs += [ServerSpec(e.name, e, external=True, metrics_run=metrics_run) for e in cfg.external]
    return [s for s in specs if s.cfg.enabled]


ENV_REFERENCE = re.compile(r"\$\{(\w+)\}")  # ${VAR} in an external server's env and headers


def _expand_env(value: str) -> str:
    return ENV_REFERENCE.sub(lambda m: os.environ.get(m.group(1), ""), value)


def make_backend(spec: ServerSpec) -> ToolBackend:
    if not spec.external:
        return LocalBackend(build_server(spec.name, spec.cfg))
    ext: ExternalServer = spec.cfg  # type: ignore[assignment]

    def transport() -> Any:
        from fastmcp.client.transports import StdioTransport, StreamableHttpTransport

        if ext.command:
            env = {**os.environ, **{k: _expand_env(v) for k, v in ext.env.items()}}
            # keep_alive=False: the program lives exactly as long as its session
            return StdioTransport(ext.command[0], ext.command[1:], env=env, keep_alive=False)
        return StreamableHttpTransport(ext.url, headers={k: _expand_env(v) for k, v in ext.headers.items()})

    return ClientBackend(
        transport,
        name=spec.name,
        stateful=ext.stateful,
        forward_episodes=ext.url is not None,
        max_live_episodes=ext.max_live_episodes,
    )


async def make_host(spec: ServerSpec) -> ToolHost:
    probe = None if spec.external else health_probe(spec.name, spec.cfg)
    # The most replicas there can be: a replica's share of the rate limit is never too large before it
    # learns the live count (see _deployment_class).
    return ToolHost(
        spec.name, make_backend(spec), spec.cfg, replicas=spec.max_replicas, probe=probe, metrics_run=spec.metrics_run
    )


# --------------------------------------------------------------------------- in-process pool


class ToolPool:
    """What callers see, in the cluster or in-process: call a tool, list the tools, end an episode."""

    async def call_tool(
        self, server: str, tool: str, arguments: dict[str, Any] | None = None, *, episode_id: str | None = None
    ) -> ToolCallResult:
        """Call `tool` of `server` in the episode's state (None: the shared state)."""
        raise NotImplementedError

    async def end_episode(self, episode_id: str) -> None:
        """Drop the episode's state on every stateful server. Idempotent; faults are logged, not raised."""
        raise NotImplementedError

    async def list_tools(self) -> dict[str, list[dict[str, Any]]]:
        """MCP tool dicts by server (external servers' tool names are `<server>.<tool>`)."""
        raise NotImplementedError

    async def call(
        self, qualified: str, arguments: dict[str, Any] | None = None, *, episode_id: str | None = None
    ) -> ToolCallResult:
        """Call `server.tool` by its qualified name."""
        server, _, tool = qualified.partition(".")
        return await self.call_tool(server, tool, arguments, episode_id=episode_id)

    def _unknown_server(self, server: str, tool: str, known: list[str]) -> ToolCallResult:
        msg = str(UnknownTool(f"no MCP server {server!r} in the pool; servers: {', '.join(sorted(known))}"))
        return ToolCallResult(server, tool, False, f"Error (unknown_tool): {msg}", None, "unknown_tool", msg)

    async def close(self) -> None:
        return None


def _log_end_faults(episode_id: str, names: list[str], outcomes: list[Any]) -> None:
    for name, outcome in zip(names, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            log.warning("server %r could not end episode %r: %s: %s", name, episode_id, type(outcome).__name__, outcome)


class LocalToolPool(ToolPool):
    """The pool in this process: same hosts and rules, no Ray. Build with `await LocalToolPool.create(cfg)`."""

    def __init__(self, hosts: dict[str, ToolHost]) -> None:
        self.hosts = hosts

    @classmethod
    async def create(cls, cfg: ToolsConfig) -> LocalToolPool:
        """Build every enabled server and open them all at once (each within its open_timeout_s)."""
        pool = cls({s.name: await make_host(s) for s in server_specs(cfg)})
        outcomes = await asyncio.gather(*(h.open() for h in pool.hosts.values()), return_exceptions=True)
        failed = [(name, e) for name, e in zip(pool.hosts, outcomes, strict=True) if isinstance(e, BaseException)]
        if failed:
            await pool.close()
            name, error = failed[0]
            if isinstance(error, ToolPoolTimeout):
                raise error
            # The transport's own errors rarely say which server or URL they came from.
            raise ToolPoolError(f"server {name!r} could not be opened: {type(error).__name__}: {error}") from error
        return pool

    async def call_tool(
        self, server: str, tool: str, arguments: dict[str, Any] | None = None, *, episode_id: str | None = None
    ) -> ToolCallResult:
        host = self.hosts.get(server)
        if host is None:
            return self._unknown_server(server, tool, list(self.hosts))
        return await host.call_tool(tool, arguments, episode_id=episode_id)

    async def end_episode(self, episode_id: str) -> None:
        names = list(self.hosts)
        outcomes = await asyncio.gather(*(self.hosts[n].end_episode(episode_id) for n in names), return_exceptions=True)
        _log_end_faults(episode_id, names, outcomes)

    async def list_tools(self) -> dict[str, list[dict[str, Any]]]:
        names = list(self.hosts)
        lists = await asyncio.gather(*(_qualified_tools(self.hosts[n]) for n in names))
        return dict(zip(names, lists, strict=True))

    async def close(self) -> None:
        """Close every server (all at once); raises the first fault, e.g. a ToolPoolTimeout, after trying all."""
        outcomes = await asyncio.gather(*(h.close() for h in self.hosts.values()), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome


async def _qualified_tools(host: ToolHost) -> list[dict[str, Any]]:
    tools = await host.list_tools()
    if isinstance(host.backend, ClientBackend):  # external tools are namespaced everywhere
        return [{**t, "name": f"{host.name}.{t['name']}"} for t in tools]
    return tools


# --------------------------------------------------------------------------- Serve


def _deployment_class() -> Any:
    """The Serve deployment, defined lazily so importing this module does not import Ray Serve."""
    from ray import serve

    @serve.ingress()
    class MCPServer:
        async def __init__(self, spec: ServerSpec, token: str | None, secrets: dict[str, str]) -> None:
            from cluster.ray_env import replica_on_loopback

            replica_on_loopback()
            logging.getLogger("fastmcp").setLevel(logging.ERROR)  # bad arguments are results, not news
            os.environ.update(secrets)  # this replica's own process: backends read keys from the environment
            self.spec = spec
            self.token = token
            self.host = await make_host(spec)
            tools = await self.host.list_tools()
            self.front = build_front(self.host, tools, prefix=f"{spec.name}." if spec.external else "")
            self.follower = None
            if spec.cfg.rate_limit_per_s and spec.cfg.autoscaling:
                self.follower = asyncio.create_task(self._follow_replica_count())

        async def _follow_replica_count(self) -> None:
            """Keep this replica's share of the rate limit at 1/n of the n replicas running now."""
            ctx = serve.get_replica_context()
            while True:
                try:
                    n = await asyncio.to_thread(running_replicas, ctx.app_name, ctx.deployment)
                    if n != self.host.replicas:
                        self.host.set_replicas(n)
                        log.info(
                            "%s: %d replica(s) running, %.3g calls/s here", ctx.deployment, n, self.host.rate_per_s
                        )
                except Exception as e:  # the controller is busy or restarting: keep the last share
                    log.debug("replica count of %s unknown: %s: %s", ctx.deployment, type(e).__name__, e)
                await asyncio.sleep(REPLICA_COUNT_PERIOD_S)

        async def rate_limit_share(self) -> dict[str, Any]:
            """This replica's id, the replica count it last saw, and its calls/s (None: no limit)."""
            ctx = serve.get_replica_context()
            return {
                "replica": ctx.replica_id.unique_id,
                "replicas": self.host.replicas,
                "rate_per_s": self.host.rate_per_s,
            }

        def __serve_build_asgi_app__(self) -> Any:
            return http_app(self.front, self.token)

        async def call_tool(
            self, tool: str, arguments: dict[str, Any] | None = None, episode_id: str | None = None
        ) -> dict[str, Any]:
            return (await self.host.call_tool(tool, arguments, episode_id=episode_id)).to_dict()

        async def end_episode(self, episode_id: str) -> None:
            await self.host.end_episode(episode_id)

        async def list_tools(self) -> list[dict[str, Any]]:
            return await _qualified_tools(self.host)

        async def check_health(self) -> None:
            await self.host.healthy()

        async def __del__(self) -> None:
            if self.follower is not None:
                self.follower.cancel()
            await self.host.close()

    return MCPServer


def running_replicas(app: str, deployment: str) -> int:
    """Replicas of `deployment` in application `app` that Serve reports RUNNING (at least 1: the caller's)."""
    from ray import serve

    status = serve.status().applications[app].deployments[deployment]
    return max(1, int(status.replica_states.get("RUNNING", 0)))


def secrets_for(spec: ServerSpec) -> dict[str, str]:
    """The variables a server's replica needs from the driver's environment: its API key, and those
    an external server's `env`/`headers` name as ${VAR}.

    They travel as pickled constructor arguments, not as a runtime_env, which the dashboard shows.
    """
    names = {LIVE_KEYS.get(spec.name, "")}
    if isinstance(spec.cfg, ExternalServer):
        for value in [*spec.cfg.env.values(), *spec.cfg.headers.values()]:
            names.update(ENV_REFERENCE.findall(value))
    return {k: os.environ[k] for k in names if k in os.environ}


def _app_for(spec: ServerSpec, token: str | None) -> Any:
    from ray import serve

    cfg = spec.cfg
    options: dict[str, Any] = {
        "name": spec.name,
        "ray_actor_options": cfg.replica_resources.actor_options(),
        "health_check_period_s": cfg.health_check_period_s,
        "max_ongoing_requests": 64,
        # A stopping replica still finishes its calls in flight, but looks every 0.1 s rather than Serve's 2 s,
        # which was what every undeploy of the pool waited, in full, at the end of each run.
        "graceful_shutdown_wait_loop_s": 0.1,
        # One line per call would drown a training run's console; Serve's metrics still count calls.
        "logging_config": {"enable_access_log": False, "log_level": "WARNING"},
    }
    if isinstance(cfg, PythonToolConfig):
        # The sandbox forks a process per call; gRPC's fork handlers then log a line each time (with Ray's
        # threads inside gRPC they skip anyway). The child execs at once, so they are not needed.
        options["ray_actor_options"]["runtime_env"] = {"env_vars": {"GRPC_ENABLE_FORK_SUPPORT": "false"}}
    if cfg.autoscaling:
        options["autoscaling_config"] = cfg.autoscaling.model_dump()
    else:
        options["num_replicas"] = cfg.replicas
    deployment = serve.deployment(_deployment_class()).options(**options)
    return deployment.bind(spec, token, secrets_for(spec))


def check_http_security(cfg: ToolsConfig) -> str | None:
    """The bearer token, read from its variable; refuses to expose the pool beyond loopback without one."""
    http = cfg.http
    token = os.environ.get(http.bearer_token_env) if http.bearer_token_env else None
    if http.bearer_token_env and not token:
        raise ValueError(f"tools.http.bearer_token_env names {http.bearer_token_env}, which is not set")
    if http.host not in LOOPBACK_HOSTS and not token:
        raise ValueError(
            f"tools.http.host is {http.host}: serving beyond loopback needs a bearer token "
            "(set tools.http.bearer_token_env to a variable holding it)"
        )
    return token


class ServeToolPool(ToolPool):
    """Calls the pool's deployments through Serve handles; survives replicas that die mid-call."""

    def __init__(
        self, handles: dict[str, Any], base_url: str, retries: int = 3, timeouts: dict[str, Deployment] | None = None
    ) -> None:
        """`base_url`: Serve's proxy, e.g. http://127.0.0.1:8000. `timeouts`: each server's config, whose
        list and close timeouts bound the handle calls (defaults when absent)."""
        self.handles = handles
        self.base_url = base_url
        self.retries = retries
        self.retry_policy = RetryPolicy(retries, REPLICA_RETRY_WAIT_S)
        self.timeouts = timeouts or {}

    def _cfg(self, server: str) -> Deployment:
        return self.timeouts.get(server) or Deployment()

    def url(self, server: str) -> str:
        return f"{self.base_url}/mcp/{server}/"

    def suffixed_url(self, server: str) -> str:
        """The same server at a path ending in `/mcp`, for clients that insist on one (the MCP Inspector)."""
        return self.url(server) + MCP_SUFFIX.lstrip("/")

    async def call_tool(
        self, server: str, tool: str, arguments: dict[str, Any] | None = None, *, episode_id: str | None = None
    ) -> ToolCallResult:
        from ray.exceptions import RayActorError

        handle = self.handles.get(server)
        if handle is None:
            return self._unknown_server(server, tool, list(self.handles))
        # The replica bounds the call itself; this looser bound covers a replica that never answers at all.
        cfg = self._cfg(server)
        limit = cfg.open_timeout_s + max([cfg.timeout_s, *cfg.tool_timeouts.values()]) * (cfg.max_retries + 1) + 30

        async def once(_: int) -> ToolCallResult:
            answer = await bounded(server, "call_tool", handle.call_tool.remote(tool, arguments, episode_id), limit)
            return ToolCallResult.from_dict(answer)

        try:  # a replica that died under us is retried: Serve routes the retry elsewhere
            return await retry_async(once, self.retry_policy, retry_exc=lambda e: isinstance(e, RayActorError))
        except ToolPoolTimeout as e:
            return ToolCallResult(server, tool, False, f"Error (unavailable): {e}", None, "unavailable", str(e))
        except RayActorError as e:
            msg = f"replica of {server!r} died and retries ran out: {type(e).__name__}"
            return ToolCallResult(server, tool, False, f"Error (unavailable): {msg}", None, "unavailable", msg)

    async def list_tools(self) -> dict[str, list[dict[str, Any]]]:
        names = list(self.handles)
        lists = await asyncio.gather(
            *(bounded(n, "list_tools", self.handles[n].list_tools.remote(), self._cfg(n).list_timeout_s) for n in names)
        )
        return dict(zip(names, lists, strict=True))

    async def end_episode(self, episode_id: str) -> None:
        names = list(self.handles)
        outcomes = await asyncio.gather(
            *(
                bounded(n, "end_episode", self.handles[n].end_episode.remote(episode_id), self._cfg(n).close_timeout_s)
                for n in names
            ),
            return_exceptions=True,
        )
        _log_end_faults(episode_id, names, outcomes)


def serve_pool_at(cfg: ToolsConfig) -> ServeAddress:
    """Start Serve where the pool should listen (or find it running) and check the pool may serve there; Ray
    must be up already. Where Serve really listens: a running Serve keeps the address it started with."""
    token = check_http_security(cfg)
    at = start_serve(cfg.http, "the MCP tool pool serves")
    if not at.started and (at.host, at.port) != (cfg.http.host, cfg.http.port):
        log.warning(
            "Serve was already running on %s:%s; tools.http asks %s:%s, which applies only when Serve starts",
            at.host, at.port, cfg.http.host, cfg.http.port,
        )  # fmt: skip
    if at.host not in LOOPBACK_HOSTS and not token:
        where = f"{at.host}:{at.port}"
        raise ValueError(f"Serve already listens on {where}, beyond loopback: the pool needs a bearer token")
    return at


def deploy_pool(cfg: ToolsConfig, metrics_run: str | None = None, at: ServeAddress | None = None) -> ServeToolPool:
    """Deploy every enabled server as its own Serve application; Ray must be up already. `metrics_run`:
    the replicas record tool latency and errors as Ray metrics tagged with this run (None: they don't).
    `at`: what `serve_pool_at` returned, for a caller that started Serve first (jobs.train: its proxy takes
    its port before the learners start beside the applications' deployment); None starts it here."""
    from ray import serve

    host, port, _ = at or serve_pool_at(cfg)
    token = check_http_security(cfg)
    specs = server_specs(cfg, metrics_run)
    targets = [
        serve.RunTarget(_app_for(s, token), name=APP_PREFIX + s.name, route_prefix=f"/mcp/{s.name}") for s in specs
    ]
    handles = serve.run_many(targets)
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return ServeToolPool(
        {s.name: h for s, h in zip(specs, handles, strict=True)},
        f"http://{url_host}:{port}",
        timeouts={s.name: s.cfg for s in specs},
    )


class ServeAddress(NamedTuple):
    host: str
    port: int
    started: bool  # this call started Serve (else it was running, with the address it started with)


def start_serve(http: HttpConfig, serves: str) -> ServeAddress:
    """Start Ray Serve with its proxy at `http`, unless Serve is running already (HTTP options are fixed when
    Serve first starts in a cluster), and say where the proxy really listens. A run that started its own Ray
    moves off a port another run on this machine holds (`listen_port`; `serves` names what the moved proxy
    serves, for the line that says so): a second proxy would otherwise share it, since Serve binds with
    SO_REUSEPORT, and the kernel would hand one run's HTTP clients to the other run's tools."""
    from ray import serve
    from ray.exceptions import RayActorError
    from ray.serve.context import _get_global_client

    options = None
    if _get_global_client(raise_if_no_controller_running=False) is None:
        explicit = http.port_is_explicit()
        port = listen_port("tools.http.port", http.host, http.port, explicit=explicit, serves=serves)
        options = {"host": http.host, "port": port}
    try:
        serve.start(http_options=options, logging_config={"log_level": "WARNING", "enable_access_log": False})
    except (RayActorError, TimeoutError) as e:
        log.warning("Ray Serve's HTTP proxy was slow to start (%s); waiting for the next", type(e).__name__)
    # Serve's controller kills a proxy that fails its ready check (5 s at first, RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S)
    # three times, even after serve.start returned, and starts another with a longer timeout; on a busy machine the
    # first proxy is often that slow. Wait for a healthy one rather than fail the run's first tool calls.
    wait_for_proxy(PROXY_WAIT_S)
    running = _get_global_client().http_config
    return ServeAddress(running.host, running.port, options is not None)


# How long start_serve waits for Serve's proxy to be healthy; how long Serve lists none before it counts as without.
PROXY_WAIT_S = 180.0
NO_PROXY_S = 10.0


def wait_for_proxy(timeout_s: float) -> None:
    """Wait until Serve's proxy on this node (else every proxy) is HEALTHY; a clear error if not within `timeout_s`.
    Serve lists no proxy for a moment while it replaces one; listing none for `NO_PROXY_S`, it runs without."""
    import time

    import ray
    from ray import serve

    here = ray.get_runtime_context().get_node_id()
    start = time.monotonic()
    listed = start
    while True:
        now = time.monotonic()
        proxies = {node: str(getattr(s, "value", s)) for node, s in serve.status().proxies.items()}
        waited = {here: proxies[here]} if here in proxies else proxies
        if waited:
            listed = now
            if all(s == "HEALTHY" for s in waited.values()):
                return
        elif now - listed > NO_PROXY_S:
            return
        if now - start > timeout_s:
            states = ", ".join(f"node {n[:8]}: {s}" for n, s in waited.items()) or "none listed"
            raise RuntimeError(
                f"Ray Serve's HTTP proxy did not become healthy within {timeout_s:.0f} s ({states}). The machine "
                "may be too busy for it to start: free some CPU, or start Ray with a longer "
                "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S in its environment. Serve's own log: the Ray session's "
                "logs/serve/ folder."
            )
        time.sleep(0.2)


def undeploy_pool(pool: ServeToolPool, timeout_s: float = 60.0) -> None:
    """Delete the pool's applications (leaves Serve and other applications alone)."""
    undeploy_apps(pool.handles, timeout_s)


def undeploy_apps(servers: Iterable[str], timeout_s: float = 60.0) -> None:
    """Delete the applications of these servers, those that exist, all at once (one by one costs seconds each)."""
    import time

    from ray import serve

    names = {APP_PREFIX + n for n in servers} & set(serve.status().applications)
    for name in names:
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while names & set(serve.status().applications) and time.monotonic() < deadline:
        time.sleep(0.2)
