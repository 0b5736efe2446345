"""TCP ports on this machine: a free one, whether one is taken, and what a run does about a taken one.

A run that starts its own Ray may move a listener off a default port another run holds; a port set in the
config is the user's choice, so a taken one stops the run instead (`taken_port`, read by preflight before
anything starts and by `cluster.ray_env.listen_port` when the listener starts).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Where Ray's workers listen by default (`ray start --min-worker-port/--max-worker-port`).
RAY_WORKER_PORTS = range(10002, 20000)


class PortTaken(ValueError):
    """A port set explicitly (config or --set) that another listener holds: `problem` and its `fix`."""

    def __init__(self, key: str, host: str, port: int) -> None:
        self.problem = f"{key} {port} is in use on {host} (another run?)"
        self.fix = (
            f"stop what listens there, or set {key} to a free port (--set {key}=N); left unset, a run that starts "
            f"its own Ray takes a free port when {port} is taken"
        )
        super().__init__(f"{self.problem}: {self.fix}")


def _tcp_socket(host: str) -> socket.socket:
    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)


def ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections (Linux's ip_local_port_range; elsewhere IANA's range)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 49152, 65535
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now ("" for every interface), for a listener that binds it later: above Ray's
    worker ports and outside the ephemeral range. A port the kernel picks (bind to 0) is an ephemeral one, which
    any process's outgoing connection may take before the listener binds it: a tool pool's Serve proxy once
    found its port so taken while the engines started beside it."""
    ephemeral = ephemeral_ports()
    candidates = [p for p in range(RAY_WORKER_PORTS.stop, 65536) if p not in ephemeral]
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        if not port_in_use(host, port):
            return port
    with _tcp_socket(host) as s:  # every try taken: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on host:port: a bind the way servers bind (SO_REUSEADDR, so a closed
    connection's TIME_WAIT does not count) fails. Ray Serve's proxy also sets SO_REUSEPORT, with which a second
    proxy would share the port silently (the kernel splits connections between the two); this bind has no
    SO_REUSEPORT, so such a listener fails it too."""
    with _tcp_socket(host) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def taken_port(key: str, host: str, port: int, *, explicit: bool) -> bool:
    """Whether config key `key`'s port (host:port) is taken and must be moved to a free one; raises PortTaken
    when it is taken and was set `explicit`ly."""
    if not port_in_use(host, port):
        return False
    if explicit:
        raise PortTaken(key, host, port)
    return True
