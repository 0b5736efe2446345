"""Embedded Ray: loopback only, and we stop only what we started."""

from __future__ import annotations

import ipaddress
import os

import psutil
import ray

from cluster.ray_env import start_ray
from configs.schema import ClusterConfig


def test_embedded_ray_listens_on_loopback_only(ray_cluster):
    assert ray_cluster.started_here
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    assert ray_cluster.address.startswith("127.0.0.1:")
    # The embedded Ray's processes (gcs, raylet, workers) are all descendants of this process.
    ours = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    assert len(ours) >= 3
    exposed = [
        (c.pid, c.laddr)
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in ours and not _loopback(c.laddr.ip)
    ]
    assert not exposed, exposed


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)


def test_second_start_reuses_the_running_ray(ray_cluster):
    again = start_ray(ClusterConfig())
    assert not again.started_here  # stopping this handle must not stop the session's Ray
    assert again.address == ray_cluster.address


def test_address_precedence(monkeypatch):
    from cluster.ray_env import cluster_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(ClusterConfig()) is None  # embedded
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # what `ray job submit` sets
    assert cluster_address(ClusterConfig()) == "127.0.0.1:6379"
    assert cluster_address(ClusterConfig(address="auto")) == "auto"  # the config wins
