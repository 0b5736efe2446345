"""Shared, expensive fixtures: one embedded Ray per test session."""

from __future__ import annotations

import socket

import pytest

import cluster.ray_env  # noqa: F401  (before ray: loopback-only listeners)
from configs.schema import ClusterConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """An embedded local Ray for the whole session, stopped at the end."""
    from cluster.ray_env import start_ray, stop_ray

    handle = start_ray(ClusterConfig(num_cpus=2))
    yield handle
    stop_ray(handle)
