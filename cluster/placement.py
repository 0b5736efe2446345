"""Where a run's roles go: placement groups, and whether a cluster can hold the roles now, after growing, or never.

Every role takes a `configs.schema.Resources` per actor (engines, runners, learner workers, tool and judge
replicas). Engines get a placement group each, learner workers share one PACKed group; `wait_placed` waits
for either while an autoscaler adds nodes.

Preflight (jobs/preflight.py) asks `fit_roles` what the cluster can do with the roles' bundles:
- `fits now`: they all fit the nodes the cluster has now (first fit, every role together: they run at once);
- `must grow`: some do not, and the cluster autoscales with a node type that holds each of them; `--run`
  then asks the autoscaler for all the bundles at once (`request_resources`) instead of waiting for the
  actors' demand to trickle in;
- `never`: no node type (or, on a cluster that cannot grow, no node) could hold one actor of the role:
  preflight fails naming the role and what no node offers.

Node types come from the autoscaler: the cluster config it reports to the GCS (autoscaler v2, KubeRay), else the
`--autoscaling-config` file of the autoscaler (monitor) process of this cluster when it runs on this machine, as
on a launcher-made cluster's head, where `ray job submit` runs the driver. Without either, the cluster is taken
as one that does not grow: its current nodes are all it will ever have.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from configs.schema import Resources

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 900.0  # GPU nodes of an autoscaling cluster take minutes to join
PLACEMENT_LOG_S = 30.0
_EPS = 1e-9


# --------------------------------------------------------------------------- placement groups


async def wait_placed(groups: list[Any], what: str, timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
    """Wait until every placement group is placed, logging while an autoscaler adds nodes; past `timeout_s`
    raise, naming `what` and the cluster's resources (the caller removes its groups)."""
    import ray

    pending = {asyncio.ensure_future(pg.ready()) for pg in groups}  # ObjectRefs are awaitable
    t0 = time.monotonic()
    try:
        while pending:
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                raise RuntimeError(
                    f"cannot place {what} within {timeout_s:.0f} s (the cluster has {ray.cluster_resources()}); "
                    "ask less of it in the config, or let the cluster grow"
                )
            _, pending = await asyncio.wait(pending, timeout=min(PLACEMENT_LOG_S, left))
            if pending:
                log.info(
                    "waiting for %s to be placed (%.0f s so far; an autoscaler may add nodes)",
                    what,
                    time.monotonic() - t0,
                )
    finally:
        for f in pending:
            f.cancel()


# --------------------------------------------------------------------------- fitting roles


@dataclass
class Role:
    """`count` actors of one role, each reserving `resources` (config `key`); `shown_count` is what the table
    prints (e.g. 1-4 for an autoscaled deployment, counted at its most)."""

    name: str
    count: int
    resources: Resources
    shown_count: str = ""
    key: str = ""

    def bundles(self) -> list[dict[str, float]]:
        return [self.resources.bundle() for _ in range(self.count)]


@dataclass
class NodeType:
    """A node the cluster has now, or one its autoscaler can add (`max_workers` of it)."""

    name: str
    resources: dict[str, float]
    max_workers: int | None = None


@dataclass
class ClusterView:
    """What the run will have: its nodes now, and the node types it can add (None: it cannot grow)."""

    where: str
    nodes: list[NodeType]
    node_types: list[NodeType] | None = None
    connected: bool = False  # a Ray cluster this process is connected to (an autoscaler can be asked)

    @property
    def autoscaling(self) -> bool:
        return bool(self.node_types) and any((t.max_workers or 0) > 0 for t in self.node_types or [])


@dataclass
class RoleFit:
    role: Role
    verdict: str  # "fits now" | "must grow" | "never"
    why: str = ""


@dataclass
class FitReport:
    fits: list[RoleFit] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.verdict != "never" for f in self.fits)

    @property
    def must_grow(self) -> bool:
        return any(f.verdict == "must grow" for f in self.fits)


def holds(capacity: dict[str, float], bundle: dict[str, float]) -> bool:
    return all(capacity.get(k, 0.0) + _EPS >= v for k, v in bundle.items() if v > 0)


def missing(capacity: dict[str, float], bundle: dict[str, float]) -> list[str]:
    """What `capacity` lacks for `bundle`, e.g. ['GPU 1 (has 0)', 'gpu_node']."""
    out = []
    for k, v in bundle.items():
        have = capacity.get(k, 0.0)
        if v > 0 and have + _EPS < v:
            out.append(f"{k} {v:g} (has {have:g})" if have else k)
    return out


def fit_roles(roles: list[Role], view: ClusterView) -> FitReport:
    """Each role's verdict (see the module doc). Roles are packed together, largest bundles first, into the
    current nodes' total resources; a role none of whose actors could ever fit one node is `never`."""
    free = [dict(n.resources) for n in view.nodes]
    unplaced: dict[int, int] = {}
    # Scarce resources first (first fit decreasing): GPU roles, then the largest CPU asks.
    order = sorted(range(len(roles)), key=lambda i: (-roles[i].resources.num_gpus, -roles[i].resources.num_cpus))
    for i in order:
        for bundle in roles[i].bundles():
            node = next((cap for cap in free if holds(cap, bundle)), None)
            if node is None:
                unplaced[i] = unplaced.get(i, 0) + 1
                continue
            for k, v in bundle.items():
                node[k] = node.get(k, 0.0) - v
    growable = view.node_types if view.autoscaling else None
    report = FitReport()
    for i, role in enumerate(roles):
        if i not in unplaced:
            report.fits.append(RoleFit(role, "fits now"))
            continue
        bundle = role.resources.bundle()
        candidates = (growable or []) + view.nodes
        if growable and any(holds(t.resources, bundle) for t in candidates):
            report.fits.append(RoleFit(role, "must grow", f"{unplaced[i]} of {role.count} wait for new nodes"))
            continue
        if not any(holds(t.resources, bundle) for t in candidates):
            kinds = "node type" if growable else "node"
            lacks = min((missing(t.resources, bundle) for t in candidates), key=len, default=list(bundle))
            report.fits.append(RoleFit(role, "never", f"no {kinds} has {', '.join(lacks)}"))
        else:
            report.fits.append(
                RoleFit(
                    role,
                    "never",
                    f"{unplaced[i]} of {role.count} do not fit beside the other roles, and the cluster cannot grow",
                )
            )
    return report


def fit_table(report: FitReport, view: ClusterView) -> list[str]:
    """The table preflight prints: each role's count, per-actor resources, total and verdict."""
    rows = [("role", "count", "each", "total", "cluster")]
    for f in report.fits:
        r = f.role
        total = Resources(
            num_cpus=r.resources.num_cpus * r.count,
            num_gpus=r.resources.num_gpus * r.count,
            accelerator_type=r.resources.accelerator_type,
            resources={k: v * r.count for k, v in r.resources.resources.items()},
        )
        verdict = f.verdict + (f": {f.why}" if f.why else "")
        rows.append((r.name, r.shown_count or str(r.count), r.resources.describe(), total.describe(), verdict))
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4] for row in rows]
    types = view.node_types if view.autoscaling else None
    if types:
        shown = ", ".join(f"{t.name} ({_shape(t.resources)}; up to {t.max_workers})" for t in types)
        lines.append(f"node types the autoscaler can add: {shown}")
    else:
        lines.append(f"no autoscaler found: the run gets the {len(view.nodes)} node(s) there are now")
    return lines


def _shape(resources: dict[str, float]) -> str:
    keep = {
        k: v for k, v in resources.items() if not k.startswith("node:") and k not in ("memory", "object_store_memory")
    }
    return ", ".join(f"{k} {v:g}" for k, v in sorted(keep.items()))


# --------------------------------------------------------------------------- the cluster


def connected_view(address: str) -> ClusterView:
    """The connected cluster's nodes and, when found, its autoscaler's node types."""
    import ray

    nodes = [
        NodeType(n["NodeID"][:8], {k: float(v) for k, v in n["Resources"].items()})
        for n in ray.nodes()
        if n.get("Alive")
    ]
    return ClusterView(f"cluster at {address}", nodes, autoscaler_node_types(), connected=True)


def autoscaler_node_types() -> list[NodeType] | None:
    """The node types of the connected cluster's autoscaler, or None when none can be found (see module doc)."""
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # an older GCS, or a private API that moved
        log.debug("no cluster config in the GCS", exc_info=True)
        config = None
    if config is not None and config.node_group_configs:
        return [
            NodeType(g.name, {k: float(v) for k, v in g.resources.items()}, None if g.max_count < 0 else g.max_count)
            for g in config.node_group_configs
        ]
    path = _monitor_config_path()
    return node_types_from_file(path) if path else None


def node_types_from_file(path: str) -> list[NodeType]:
    """`available_node_types` of a cluster launcher / autoscaler YAML (or JSON) file."""
    import os

    import yaml

    with open(os.path.expanduser(path)) as f:
        config = yaml.safe_load(f) or {}
    out = []
    for name, spec in (config.get("available_node_types") or {}).items():
        res = {k: float(v) for k, v in (spec.get("resources") or {}).items()}
        out.append(NodeType(name, res, int(spec.get("max_workers", config.get("max_workers", 0)) or 0)))
    return out


def _monitor_config_path() -> str | None:
    """The `--autoscaling-config` of this cluster's autoscaler process, when it runs on this machine."""
    import psutil
    import ray

    gcs = ray.get_runtime_context().gcs_address
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if not any(part.endswith("monitor.py") for part in cmd):
            continue
        if f"--gcs-address={gcs}" not in cmd:
            continue  # another cluster's autoscaler on this machine
        for part in cmd:
            if part.startswith("--autoscaling-config="):
                return part.split("=", 1)[1]
    return None


def request_bundles(bundles: list[dict[str, float]]) -> None:
    """Ask the autoscaler for room for all these bundles at once (a standing request, see `release_request`)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)
    log.info("asked the autoscaler for %d bundle(s)", len(bundles))


def release_request() -> None:
    """Withdraw the standing request, so that idle nodes can go. Safe without Ray or a request."""
    import ray

    if not ray.is_initialized():
        return
    from ray.autoscaler.sdk import request_resources

    try:
        request_resources(bundles=[])
    except Exception as e:  # shutting down anyway: say it, do not mask the run's own outcome
        log.warning("could not withdraw the autoscaler request: %s: %s", type(e).__name__, e)
