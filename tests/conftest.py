"""Shared, expensive fixtures: one embedded Ray per test session, a loopback S3 server per module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# No test may reach the real Hugging Face Hub: offline mode for this process, and (inherited through
# os.environ) for every subprocess, Ray worker and Serve replica the tests start. Set before anything
# imports huggingface_hub, which reads it once. Tests of the download path unset it and point
# HF_ENDPOINT at loopback.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from cluster.local_cluster import free_port  # noqa: F401  (the tests import it from here)
from cluster.ray_env import configure_ray_env
from configs.schema import ClusterConfig

configure_ray_env()  # before any test module imports ray: loopback-only listeners


@pytest.fixture(scope="session")
def ray_cluster():
    """An embedded local Ray for the whole session, stopped at the end."""
    from cluster.ray_env import start_ray, stop_ray

    handle = start_ray(ClusterConfig(num_cpus=2))
    yield handle
    stop_ray(handle)


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """A real S3 API (moto's server) on loopback, with the AWS_* variables pointing at it (for one module: the
    variables are restored after it)."""
    from tests.s3_server import s3_env

    with s3_env() as env:
        yield env


@pytest.fixture(params=["folder", "s3"])
def storage_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A `train.storage` root, once a folder and once an s3:// URI: storage code must behave the same on both."""
    if request.param == "folder":
        return str(tmp_path / "store")
    from tests.s3_server import BUCKET

    request.getfixturevalue("s3")
    return f"s3://{BUCKET}/{tmp_path.name}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Whatever starts the session's Ray is slow: `make test-fast` (-m "not slow") leaves it out."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
