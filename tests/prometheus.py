"""Reading Ray's metrics back as Prometheus scrapes them: each node's `/metrics` endpoint, on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def scrape() -> list[Any]:
    """Every sample on every live node's metrics endpoint (prometheus_client `Sample`s: name, labels, value)."""
    import httpx
    import ray
    from prometheus_client.parser import text_string_to_metric_families

    samples = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        # The embedded test Ray binds loopback only: never scrape another address.
        text = httpx.get(f"http://127.0.0.1:{node['MetricsExportPort']}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            samples += family.samples
    return samples


def find(samples: list[Any], name: str, **labels: str) -> list[Any]:
    """The samples of series `name` whose labels include these."""
    return [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def wait_for(found: Callable[[list[Any]], T], what: str, timeout_s: float = 120.0) -> T:
    """Scrape until `found(samples)` is truthy and return it. Ray exports every few seconds (10 s by
    default), so this polls; the deadline only bounds a hang, it is no claim about speed."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape()
        result = found(samples)
        if result:
            return result
        if time.monotonic() > deadline:
            names = sorted({s.name for s in samples if "mcprl" in s.name})
            raise AssertionError(f"{what}: not on the metrics endpoint after {timeout_s:.0f} s; mcprl series: {names}")
        time.sleep(1.0)
