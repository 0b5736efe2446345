"""Shared, expensive fixtures: one embedded Ray per test session."""

from __future__ import annotations

import os

# No test may reach the real Hugging Face Hub: offline mode for this process, and (inherited through
# os.environ) for every subprocess, Ray worker and Serve replica the tests start. Set before anything
# imports huggingface_hub, which reads it once. Tests of the download path unset it and point
# HF_ENDPOINT at loopback.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

import cluster.ray_env  # noqa: F401  (before ray: loopback-only listeners)
from cluster.local_cluster import free_port  # noqa: F401  (the tests import it from here)
from configs.schema import ClusterConfig


@pytest.fixture(scope="session")
def ray_cluster():
    """An embedded local Ray for the whole session, stopped at the end."""
    from cluster.ray_env import start_ray, stop_ray

    handle = start_ray(ClusterConfig(num_cpus=2))
    yield handle
    stop_ray(handle)
