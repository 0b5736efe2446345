"""Every Ray metric mcprl exports, in one place, and the one way to record them.

Ray exports a `ray.util.metrics` metric named `mcprl_x` on each node's Prometheus endpoint
(`http://<node>:<ray.nodes()[i]["MetricsExportPort"]>/metrics`) as `ray_mcprl_x`: a gauge as
`ray_mcprl_x`, a counter as `ray_mcprl_x_total`, a histogram as `ray_mcprl_x_bucket` / `_sum` /
`_count` (`Metric.series`). A histogram's `_sum` is approximate (with Ray 2.60 one 0.05 s
observation gave 0.055, the midpoint of its 0.01–0.1 bucket), so plot quantiles from `_bucket`.
The Ray dashboard's Metrics view and `cluster/grafana/mcprl.json` plot them.
Every metric carries a `run` tag (the config's `run_name`), so runs sharing a cluster stay apart.

Who records what, where the number is produced:

- the step figures (`STEP_FIGURES`: tokens/s, episodes/s, reward, KL, step time, sync latency, ...):
  gauges tagged run, set by the driver (`jobs.tracking.Tracker.log` → `record_step`);
- `mcprl_engine_policy_version`: a gauge tagged run, engine, set by each engine actor after it starts
  and after each weight load (`orchestration.rollout_actors.EngineHost`);
- `mcprl_tool_latency_s` (a histogram, tagged run, server, tool) and `mcprl_tool_errors` (a counter,
  tagged run, server, tool, kind: the result's `error_kind`): every call through a `ToolHost`, so in
  the Serve replica that ran it.

Switched by `logging.ray_metrics` (the driver passes `metrics_run(cfg)`: the run name, or None for
off, to whatever records). Recording costs one dict lookup when Ray is not up in the process: `ray`
is not even imported then.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

PREFIX = "mcprl_"
PROMETHEUS_PREFIX = "ray_"  # what Ray puts before every application metric it exports

Kind = Literal["gauge", "counter", "histogram"]
_SUFFIX = {"gauge": "", "counter": "_total", "histogram": "_bucket"}

# Tool calls: 1 ms (an in-process lookup) to a minute (a slow live API, a sandboxed program).
TOOL_LATENCY_BOUNDARIES = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class Metric:
    """One exported metric: its Ray name, kind, description and tag keys (all required when recording)."""

    name: str
    kind: Kind
    description: str
    tags: tuple[str, ...] = ("run",)
    key: str | None = None  # for a step figure: the Tracker key it is set from
    boundaries: tuple[float, ...] = ()  # a histogram's bucket upper bounds

    @property
    def series(self) -> str:
        """The Prometheus series that holds its samples (a histogram's buckets: `_bucket`, with `le`)."""
        return PROMETHEUS_PREFIX + self.name + _SUFFIX[self.kind]


def metric_name(key: str) -> str:
    """A Tracker key as a metric name: `mcprl_` + the key with characters outside [a-zA-Z0-9_] as `_`
    (`rollout/episode_reward` → `mcprl_rollout_episode_reward`)."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _step(key: str, description: str) -> Metric:
    return Metric(metric_name(key), "gauge", description, key=key)


# The driver's figures of the latest step (the keys jobs/train.py logs); other keys stay in metrics.jsonl and W&B.
STEP_FIGURES = (
    _step("rollout/tokens_per_s", "Tokens generated per second by the runners in the step's rollout."),
    _step("rollout/episodes_per_s", "Episodes finished per second by the runners in the step's rollout."),
    _step("rollout/episode_reward", "Mean reward of the step's scored episodes."),
    _step("rollout/episode_reward_std", "Standard deviation of the step's episode rewards."),
    _step("rollout/success_rate", "Share of the step's episodes whose final answer was right."),
    _step("rollout/groups_kept", "Share of the step's GRPO groups with both outcomes (algorithm.filter_groups)."),
    _step("rollout/tool_success_rate", "Share of the step's tool calls that succeeded."),
    _step("rollout/dropped_infra", "Episodes of the step dropped for infrastructure faults."),
    _step("train/tokens_per_s", "Learner tokens per second in the step's update."),
    _step("train/kl", "KL(policy || reference) of the step's update."),
    _step("train/policy_loss", "Policy loss of the step's update."),
    _step("train/grad_norm", "Gradient norm of the step's update (before clipping)."),
    _step("timing/step_s", "Wall time of the whole step, seconds."),
    _step("timing/rollout_s", "Wall time of the step's rollout phase, seconds."),
    _step("timing/train_s", "Wall time of the step's learner update, seconds."),
    _step("sync/latency_s", "Weight sync: seconds until the slowest engine confirmed the new policy."),
    _step("eval/validation/success_rate", "Share of held-out validation tasks answered right at the last evaluation."),
)
ENGINE_POLICY_VERSION = Metric(
    PREFIX + "engine_policy_version", "gauge", "Policy version the engine gives new requests.", ("run", "engine")
)
TOOL_LATENCY = Metric(
    PREFIX + "tool_latency_s",
    "histogram",
    "Tool call latency in the tool pool, seconds (retries included).",
    ("run", "server", "tool"),
    boundaries=TOOL_LATENCY_BOUNDARIES,
)
TOOL_ERRORS = Metric(
    PREFIX + "tool_errors", "counter", "Failed tool calls, by error kind.", ("run", "server", "tool", "kind")
)

METRICS: dict[str, Metric] = {m.name: m for m in (*STEP_FIGURES, ENGINE_POLICY_VERSION, TOOL_LATENCY, TOOL_ERRORS)}
_BY_KEY = {m.key: m for m in STEP_FIGURES}

# Ray metric objects are per process; made on first use.
_instances: dict[str, Any] = {}


def metrics_run(cfg: Any) -> str | None:
    """The `run` tag for a `configs.schema.Config`, or None when `logging.ray_metrics` is off."""
    return cfg.run_name if cfg.logging.ray_metrics else None


def ray_up() -> bool:
    """Ray is initialised in this process (without importing it when nothing has)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _instance(metric: Metric) -> Any:
    obj = _instances.get(metric.name)
    if obj is None:
        from ray.util import metrics as rm

        if metric.kind == "gauge":
            obj = rm.Gauge(metric.name, description=metric.description, tag_keys=metric.tags)
        elif metric.kind == "counter":
            obj = rm.Counter(metric.name, description=metric.description, tag_keys=metric.tags)
        else:
            obj = rm.Histogram(
                metric.name, description=metric.description, boundaries=list(metric.boundaries), tag_keys=metric.tags
            )
        _instances[metric.name] = obj
    return obj


def record(metric: Metric, value: float, **tags: str) -> None:
    """Set the gauge, add `value` to the counter, or observe `value` in the histogram, with these tags
    (exactly the metric's tag keys). Nothing happens when Ray is not up here or `value` is not finite."""
    if set(tags) != set(metric.tags):
        raise ValueError(f"metric {metric.name}: tags {sorted(tags)} given, {sorted(metric.tags)} expected")
    if not ray_up() or not math.isfinite(value):
        return
    obj = _instance(metric)
    values = {k: str(v) for k, v in tags.items()}
    if metric.kind == "gauge":
        obj.set(float(value), tags=values)
    elif metric.kind == "counter":
        obj.inc(float(value), tags=values)
    else:
        obj.observe(float(value), tags=values)


def record_step(run: str, figures: Mapping[str, float]) -> int:
    """Set the step-figure gauges (`STEP_FIGURES`) from a step's figures; other keys are ignored.
    Returns how many were set (0 when Ray is not up)."""
    if not ray_up():
        return 0
    n = 0
    for key, value in figures.items():
        metric = _BY_KEY.get(key)
        if metric is not None and math.isfinite(value):
            record(metric, value, run=run)
            n += 1
    return n


GRAFANA_DASHBOARD = "cluster/grafana/mcprl.json"


def dashboard_line(dashboard_url: str | None, run: str | None) -> str:
    """What a job prints at start: where to watch it (the Ray dashboard, when there is one) and the
    series its metrics are exported as (`run`: the run tag, None when metrics are off)."""
    where = "no Ray dashboard in this session"
    if dashboard_url:
        where = "Ray dashboard: " + (dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}")
    if run is None:
        return f"{where}; Ray metrics are off (logging.ray_metrics)"
    series = f'{PROMETHEUS_PREFIX}{PREFIX}*{{run="{run}"}}'
    return f"{where}; metrics: {series} (Grafana: import {GRAFANA_DASHBOARD})"


__all__ = [
    "ENGINE_POLICY_VERSION",
    "METRICS",
    "STEP_FIGURES",
    "TOOL_ERRORS",
    "TOOL_LATENCY",
    "Metric",
    "dashboard_line",
    "metric_name",
    "metrics_run",
    "record",
    "record_step",
]
