"""Ray metrics for the dashboard: the catalog (cluster/metrics.py), the Grafana dashboard that plots it,
and the real thing: a driver step and tool calls on Serve read back from the node's Prometheus endpoint."""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path

import pytest

from cluster import metrics
from cluster.metrics import METRICS, STEP_FIGURES, TOOL_ERRORS, TOOL_LATENCY, dashboard_line, metric_name, record
from configs.loader import load_config
from configs.schema import Config, LoggingConfig
from jobs.tracking import Tracker
from tests.conftest import free_port
from tests.prometheus import find, wait_for

DASHBOARD = Path(__file__).parents[2] / metrics.GRAFANA_DASHBOARD
SERIES = re.compile(r"\bray_mcprl_[A-Za-z0-9_]+")


# Every Prometheus series the catalog's metrics are exported as, and the metric each belongs to.
EXPORTED = {
    f"ray_{m.name}{suffix}": m.name
    for m in METRICS.values()
    for suffix in {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}[m.kind]
}


def plotted(expr: str) -> set[str]:
    """The catalog metrics a PromQL expression reads; fails on a series the catalog does not define."""
    unknown = [s for s in SERIES.findall(expr) if s not in EXPORTED]
    assert not unknown, f"{expr!r} reads {unknown}, which cluster/metrics.py does not define"
    return {EXPORTED[s] for s in SERIES.findall(expr)}


def test_catalog() -> None:
    assert metric_name("rollout/episode_reward") == "mcprl_rollout_episode_reward"
    assert metric_name("finish/max-turns.x") == "mcprl_finish_max_turns_x"
    assert len(METRICS) == len(STEP_FIGURES) + 3  # names are unique
    for m in METRICS.values():
        assert re.fullmatch(r"mcprl_[a-z0-9_]+", m.name) and m.description and "run" in m.tags
        assert (m.kind == "histogram") == bool(m.boundaries)
    assert {m.key for m in STEP_FIGURES} >= {
        "rollout/tokens_per_s", "rollout/episodes_per_s", "rollout/episode_reward", "train/kl", "timing/step_s",
        "sync/latency_s",
    }  # fmt: skip
    assert TOOL_LATENCY.series == "ray_mcprl_tool_latency_s_bucket"
    assert TOOL_ERRORS.series == "ray_mcprl_tool_errors_total"
    # A recording with the wrong tags is refused, naming the metric, before it could reach Ray.
    with pytest.raises(ValueError, match=r"mcprl_tool_errors: tags \['run'\] given"):
        record(TOOL_ERRORS, 1, run="x")


def test_dashboard_line() -> None:
    line = dashboard_line("127.0.0.1:8265", "demo")
    assert line.startswith("Ray dashboard: http://127.0.0.1:8265;")
    assert 'ray_mcprl_*{run="demo"}' in line and "cluster/grafana/mcprl.json" in line
    assert dashboard_line(None, None) == "no Ray dashboard in this session; Ray metrics are off (logging.ray_metrics)"


def test_grafana_dashboard_plots_every_metric() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert plotted(variables["run"]["query"]["query"])  # the run picker lists runs of a defined metric
    seen: set[str] = set()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        where = f"panel {panel['title']!r}"
        assert panel["type"] == "timeseries" and {"x", "y", "w", "h"} <= set(panel["gridPos"]), where
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["targets"], where
        for target in panel["targets"]:
            assert target["refId"] and target["datasource"] == panel["datasource"], where
            assert '{run=~"$run"}' in target["expr"], f"{where}: every query follows the run picker"
            names = plotted(target["expr"])
            assert names, f"{where}: {target['expr']!r} reads no mcprl metric"
            seen |= names
    assert seen == set(METRICS), f"defined but not plotted: {sorted(set(METRICS) - seen)}"


def test_driver_step_and_serve_tool_calls_reach_prometheus(tmp_path, ray_cluster) -> None:
    """The driver logs one step (Tracker, as jobs.train does) and the tool pool on Serve answers three
    calls; the node's Prometheus endpoint then shows the figures, tagged with the run."""
    from serve_apps.tool_pool import deploy_pool, undeploy_pool

    run = "metrics-test"
    off = Config(run_name="metrics-off", logging=LoggingConfig(wandb="off", ray_metrics=False))
    with Tracker(off, tmp_path / "off") as tr:
        tr.log(1, {"rollout/episode_reward": 0.5})
    on = Config(run_name=run, logging=LoggingConfig(wandb="off", ray_metrics=True))
    with Tracker(on, tmp_path / "on") as tr:
        figures = {"episode_reward": 0.25, "tokens_per_s": 120.0, "episodes_per_s": 1.5, "unlisted": 3.0}
        tr.log(1, figures, prefix="rollout/")
        tr.log(1, {"train/kl": 0.0125, "train/grad_norm": math.nan, "timing/step_s": 2.5, "sync/latency_s": 0.04})

    disabled = [f"tools.servers.{n}.enabled=false" for n in ("fmp", "tavily", "slack", "python")]
    pool = deploy_pool(load_config(None, [f"tools.http.port={free_port()}", *disabled]).tools, metrics_run=run)
    try:

        async def calls() -> list[str | None]:
            results = await asyncio.gather(
                pool.call("polygon.previous_close", {"ticker": "NVDA"}),
                pool.call("polygon.previous_close", {}),
                pool.call("polygon.made_up_tool", {"x": 1}),
            )
            return [r.error_kind for r in results]

        assert asyncio.run(calls()) == [None, "invalid_arguments", "unknown_tool"]

        def ready(samples: list) -> list | None:
            wanted = [
                find(samples, "ray_mcprl_rollout_episode_reward", run=run),
                find(samples, "ray_mcprl_train_kl", run=run),
                find(samples, "ray_mcprl_tool_latency_s_count", run=run, server="polygon", tool="previous_close"),
                find(samples, "ray_mcprl_tool_errors_total", run=run, kind="unknown_tool"),
            ]
            return samples if all(wanted) else None

        samples = wait_for(ready, f"the step figures and tool metrics of run {run!r}")
    finally:
        undeploy_pool(pool)

    def value(name: str, **labels: str) -> float:
        found = find(samples, name, run=run, **labels)
        assert len(found) == 1, f"{name}{labels}: {found}"
        return found[0].value

    # The driver's figures, as logged; a NaN and keys outside the catalog are not exported.
    assert value("ray_mcprl_rollout_episode_reward") == 0.25
    assert value("ray_mcprl_rollout_tokens_per_s") == 120.0
    assert value("ray_mcprl_rollout_episodes_per_s") == 1.5
    assert value("ray_mcprl_train_kl") == 0.0125
    assert value("ray_mcprl_timing_step_s") == 2.5
    assert value("ray_mcprl_sync_latency_s") == 0.04
    assert not find(samples, "ray_mcprl_train_grad_norm", run=run)
    assert not [s for s in samples if "unlisted" in s.name]
    # A run with logging.ray_metrics off exports nothing (it logged before the run above, in the same process).
    assert not [s for s in samples if s.labels.get("run") == "metrics-off"]
    # Tool latency: both calls of the real tool, in the histogram's buckets; errors by kind, a made-up
    # tool name kept out of the tags.
    assert value("ray_mcprl_tool_latency_s_count", server="polygon", tool="previous_close") == 2
    assert value("ray_mcprl_tool_latency_s_bucket", server="polygon", tool="previous_close", le="+Inf") == 2
    assert value("ray_mcprl_tool_errors_total", server="polygon", tool="previous_close", kind="invalid_arguments") == 1
    assert value("ray_mcprl_tool_errors_total", server="polygon", tool="(unknown)", kind="unknown_tool") == 1
    assert not [s for s in samples if "made_up_tool" in str(s.labels)]
