"""Bring Ray up: connect to a running cluster, or start an embedded one on this machine.

Embedded Ray binds loopback only and is sized for a small machine. We shut down only what we
started: a driver attached to someone's cluster just disconnects.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from cluster.ports import free_port, taken_port
from configs.schema import ClusterConfig

log = logging.getLogger(__name__)

# Environment the workers of an embedded Ray inherit: no telemetry, loopback-only listeners.
_EMBEDDED_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # With this off, Ray binds its listeners to 127.0.0.1 instead of the machine's address.
    # Ray reads it once, when `ray` is first imported: see configure_ray_env.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_DEDUP_LOGS": "1",
    # Serve kills a proxy not ready within this (5 s by default), and its start fails; on 2 busy cores a proxy
    # often needs longer. serve_apps.tool_pool.start_serve waits for the restarted one where this is not set.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
}


def on_loopback(address: str) -> bool:
    """Whether a Ray address (host:port, ray://host:port) names this machine's loopback."""
    host = address.partition("://")[2] or address
    return host.rpartition(":")[0].strip("[]") in ("127.0.0.1", "localhost", "::1")


def configure_ray_env() -> None:
    """Set the embedded Ray's environment (loopback-only listeners, no telemetry) in this process, where
    not set already; idempotent. Ray reads it when `ray` is first imported, so every entry point calls
    this before anything imports ray (jobs.cli.setup, bench's main, tests/conftest.py); no module of ours
    imports ray at module level. `start_ray` and preflight's `cluster_view` call it too, for callers that
    are no entry point. `ray job submit` sets RAY_ADDRESS, and then Ray's networking is left alone unless
    that address is loopback: a driver joining a cluster there needs the same setting, else Ray rewrites
    127.0.0.1 into the machine's address, where a loopback-only GCS never answers (minutes of retries)."""
    address = os.environ.get("RAY_ADDRESS")
    if address and not on_loopback(address):
        return
    for key, value in _EMBEDDED_ENV.items():
        os.environ.setdefault(key, value)


def replica_on_loopback() -> None:
    """Ray Serve (2.60) binds each replica's inter-deployment gRPC server to every interface ("[::]:0"),
    whatever the node's address. On a node at 127.0.0.1 (the embedded default, the loopback test clusters)
    bind it there too. Call it in a deployment's __init__: Serve starts that server after __init__ returns."""
    import ray

    if ray.util.get_node_ip_address() != "127.0.0.1":
        return
    try:
        from ray.serve._private import replica
    except ImportError:  # another Ray layout: nothing to narrow
        return
    bind = replica.add_port_to_grpc_server
    if getattr(bind, "on_loopback", False):
        return

    def bind_loopback(server: Any, address: str) -> int:
        return bind(server, address.replace("[::]", "127.0.0.1", 1))

    bind_loopback.on_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = bind_loopback


# Whether this process started the Ray it is connected to (start_ray's embedded case): only such a run may
# move a listener off a default port that another run on this machine holds (`listen_port`).
_started_embedded = False


def listen_port(key: str, host: str, port: int, *, explicit: bool, serves: str) -> int:
    """The port to listen on for config key `key` (host:port as configured). A run that started its own Ray
    (an embedded Ray) and finds the port taken, most likely by another run on this machine, takes a free
    port on `host` instead and says so in one line naming `serves`, unless the port was `explicit` (set in the
    config or by --set): that is a ValueError naming `key`, since whoever chose the port expects it. Connected
    to a cluster, the port is returned as it is: Serve there may already listen on it, as it should."""
    if not _started_embedded or not taken_port(key, host, port, explicit=explicit):
        return port
    moved = free_port(host)
    log.warning("%s %d is in use (another run?): %s on %s:%d", key, port, serves, host, moved)
    return moved


@dataclass
class RayHandle:
    address: str
    started_here: bool
    dashboard_url: str | None


def actor_name(run_name: str, role: str, index: int) -> str:
    """The name the Ray dashboard shows for a run's actor: `mcprl:<run_name>:<role>-<index>`."""
    return f"mcprl:{run_name}:{role}-{index}"


def start_named(actor_class: Any, name: str, options: dict[str, Any], *args: Any) -> Any:
    """`actor_class.options(name=name, **options).remote(*args)`, failing with a clear error when another live
    actor holds the name in this Ray namespace (another run with the same run_name)."""
    from ray.exceptions import ActorAlreadyExistsError

    try:
        return actor_class.options(name=name, **options).remote(*args)
    except ActorAlreadyExistsError:
        raise _name_taken(name) from None


def ensure_name_free(name: str) -> None:
    """Fail as `start_named` would, before reserving anything for the actor (a placement group)."""
    import ray

    try:
        ray.get_actor(name)
    except ValueError:
        return
    raise _name_taken(name)


def _name_taken(name: str) -> RuntimeError:
    import ray

    namespace = ray.get_runtime_context().namespace
    return RuntimeError(
        f"Ray actor name {name!r} is taken in namespace {namespace!r}: another run with this run_name is "
        "live there. Stop it, or give this run another run_name (or cluster.namespace)"
    )


async def wait_name_free(name: str, timeout_s: float) -> None:
    """Wait until no live actor holds `name` (the GCS frees a killed actor's name once it has marked it
    dead); RuntimeError naming the actor past `timeout_s`."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get_actor(name)
        except ValueError:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: the name is still taken {timeout_s:.0f} s after killing it")
        await asyncio.sleep(0.1)


@functools.cache
def remote_class(cls: type) -> Any:
    """`ray.remote(cls)`, once per class and process: Ray rewraps a class's methods in place each time,
    and a second wrapping of the same class fails (`wrapper loop when unwrapping`). Use `.options()`."""
    import ray

    return ray.remote(cls)


def cluster_address(cfg: ClusterConfig) -> str | None:
    """The address to connect to, or None for an embedded local Ray."""
    return cfg.address or os.environ.get("RAY_ADDRESS") or None


class RayAddressError(ValueError):
    """The configured Ray address is malformed or nothing answers there; the message names it and the fix."""


def checked_address(cfg: ClusterConfig, timeout_s: float = 3.0) -> str | None:
    """`cluster_address`, checked before `ray.init` sees it: Ray answers a dashboard URL with a bare
    `ValueError: Invalid Ray address`, and an address where nothing listens with minutes of retries."""
    address = cluster_address(cfg)
    if not address or address in ("auto", "local"):
        return address
    key = "cluster.address" if cfg.address else "RAY_ADDRESS"
    named = f"{key}={address}"
    gcs = "the head's GCS address, host:port as `ray start --head` printed it (port 6379 by default)"
    scheme, sep, rest = address.partition("://")
    if sep and scheme in ("http", "https"):
        raise RayAddressError(
            f"{named} is a URL, the Ray dashboard's, which `ray job submit` takes. A command started here joins "
            f"the cluster at {gcs}: set {key} to that, or submit the command as a job: "
            "`ray job submit --working-dir . --runtime-env cluster/runtime_env.yaml -- python -m jobs.train ...`"
        )
    host, _, port = (rest if sep else address).rpartition(":")
    if (sep and scheme != "ray") or not host or not port.isdigit():
        raise RayAddressError(f"{named}: expected host:port ({gcs}), ray://host:port (Ray Client) or auto")
    refused = unreachable(host.strip("[]"), int(port), timeout_s)
    if refused is not None:
        raise RayAddressError(
            f"{named}: nothing answers at {host}:{port} ({refused.strerror or refused}). Start the cluster, or set "
            f"{key} to {gcs}; unset it to start an embedded Ray on this machine"
        )
    return address


def unreachable(host: str, port: int, timeout_s: float) -> OSError | None:
    """None once a TCP connection to host:port succeeds, else the last error after `timeout_s`: a head that is
    still starting refuses for a moment, so a refusal is retried until then."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.1)).close()
            return None
        except OSError as e:
            if time.monotonic() + 0.2 >= deadline:
                return e
            time.sleep(0.2)


def _dashboard_url() -> str | None:
    """The dashboard URL of the Ray this process is connected to (ray.init returns it only to its caller)."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    url = getattr(node, "webui_url", None)
    return (url if "://" in url else f"http://{url}") if url else None


def embedded_cpus(cfg: ClusterConfig) -> int:
    """The embedded Ray's CPU count, a whole number: given 8.0 (the schema's float), Ray 2.60's raylet never
    registered on a GPU machine (the driver waited 30 s for it, then gave up), while 8 started in 4 s."""
    return math.ceil(cfg.num_cpus) if cfg.num_cpus else os.cpu_count() or 1


def start_ray(cfg: ClusterConfig) -> RayHandle:
    """Connect to the configured cluster, or start an embedded one (idempotent within a process)."""
    configure_ray_env()  # in time when ray is not imported yet; else the warning below says what went wrong
    import ray

    from cluster.console import quiet_worker_lines

    quiet_worker_lines()

    if ray.is_initialized():  # preflight connected first, or a test session's Ray
        ctx = ray.get_runtime_context()
        return RayHandle(ctx.gcs_address, started_here=False, dashboard_url=_dashboard_url())

    address = checked_address(cfg)
    if address:
        info = ray.init(address=address, namespace=cfg.namespace, log_to_driver=True)
        log.info("connected to Ray at %s", address)
        return RayHandle(address, started_here=False, dashboard_url=info.dashboard_url or None)

    global _started_embedded
    info = ray.init(
        address="local",  # always a new instance, never a cluster someone `ray start`ed on this machine
        num_cpus=embedded_cpus(cfg),
        namespace=cfg.namespace,
        include_dashboard=cfg.dashboard,
        dashboard_host="127.0.0.1",
        log_to_driver=True,
        runtime_env={"env_vars": {k: os.environ[k] for k in _EMBEDDED_ENV if k in os.environ}},
    )
    _started_embedded = True
    log.info("started an embedded Ray (%s CPUs)", ray.cluster_resources().get("CPU"))
    if ray.util.get_node_ip_address() != "127.0.0.1":
        log.warning("embedded Ray listens beyond loopback: `ray` was imported before configure_ray_env()")
    return RayHandle(info.address_info["gcs_address"], started_here=True, dashboard_url=info.dashboard_url or None)


def stop_ray(handle: RayHandle) -> None:
    """Undo `start_ray`: stop an embedded Ray (and its Serve), or only disconnect from a cluster."""
    global _started_embedded
    import ray

    if not ray.is_initialized():
        return
    _started_embedded = False
    # An embedded Ray takes its Serve with it; asking Serve to shut down first only makes the raylet
    # log the controller's killed tasks.
    ray.shutdown()


def start_ray_early(cfg: ClusterConfig) -> Future[RayHandle] | None:
    """An embedded Ray's start on a thread, for a job that overlaps it with its own checks (preflight's imports
    keep one core busy, Ray's new processes the other: 3-5 s sooner to the engines' start on 2 cores). Hand the
    result to `ray_session`, or to `stop_early` where the job does not go on. None where the job connects to a
    cluster (that costs little, and preflight checks the address first) or Ray is up already."""
    if cluster_address(cfg):
        return None
    configure_ray_env()
    import ray  # here, not on the thread: the two threads' imports then share none of Ray's own

    if ray.is_initialized():
        return None
    # What ray.init sets when it runs on the main thread (it cannot on another): SIGTERM leaves by SystemExit,
    # so that the job's `finally` blocks stop Ray.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    started: Future[RayHandle] = Future()

    def start() -> None:
        try:
            started.set_result(start_ray(cfg))
        except BaseException as e:  # the job sees it where it takes the handle
            started.set_exception(e)
            return
        # Ray's processes get the parent-death signal when the thread that started them ends (Linux's is per
        # thread): this one lives as long as the process.
        threading.Event().wait()

    threading.Thread(target=start, name="ray-start", daemon=True).start()
    return started


def stop_early(started: Future[RayHandle] | None) -> None:
    """Undo `start_ray_early` for a job that does not go on (its checks failed, or Ctrl-C)."""
    if started is None:
        return
    try:
        handle = started.result()
    except Exception:  # it did not start: nothing to stop
        return
    stop_ray(handle)


@contextmanager
def ray_session(cfg: ClusterConfig, started: Future[RayHandle] | None = None) -> Iterator[RayHandle]:
    """Ray for the block, stopped after it where it was started here; `started`: `start_ray_early`'s."""
    handle = started.result() if started is not None else start_ray(cfg)
    try:
        yield handle
    finally:
        stop_ray(handle)
