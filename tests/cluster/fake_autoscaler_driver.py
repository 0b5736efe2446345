"""The driver of test_autoscaler.py, run in its own process against the fake autoscaling cluster at argv[1].

It prints one JSON object: what preflight said (dry run, --run, and a role no node type holds), where an
engine-shaped workload ran, and how the node count moved. The test asserts on it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import cluster.ray_env  # noqa: F401  (before ray)
from configs.schema import Config, Resources

GPU_LIKE = "mcprl_gpu_worker"
DEADLINE_S = 60.0


def run_config(address: str) -> Config:
    """A run whose engine needs the worker type's custom resource; the rest fits the 1-CPU head."""
    cfg = Config()
    cfg.cluster.address = address
    cfg.rollout.engine_resources = Resources(num_cpus=1, resources={GPU_LIKE: 1})
    cfg.learner.worker_resources = Resources(num_cpus=0.5)
    for name in ("fmp", "tavily", "slack", "python"):
        getattr(cfg.tools.servers, name).enabled = False
    cfg.tools.servers.polygon.replica_resources = Resources(num_cpus=0.05)
    return cfg


def alive() -> list[str]:
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


def wait_nodes(count: int) -> float:
    t0 = time.monotonic()
    while len(alive()) != count:
        if time.monotonic() - t0 > DEADLINE_S:
            raise TimeoutError(f"{len(alive())} node(s) alive, waited for {count} for {DEADLINE_S:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - t0


class Probe:
    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def main(address: str) -> dict[str, Any]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.placement import release_request, wait_placed
    from jobs.preflight import Preflight, check_resources

    out: dict[str, Any] = {}
    cfg = run_config(address)

    dry = Preflight()
    check_resources(cfg, dry)  # connects
    out["dry"] = {"ok": dry.checks[0].ok, "detail": dry.checks[0].detail}
    head = alive()
    out["nodes_before"] = len(head)

    h100 = cfg.model_copy(deep=True)
    h100.rollout.engine_resources = Resources(num_cpus=1, num_gpus=1, accelerator_type="H100")
    never = Preflight()
    check_resources(h100, never, request=True)
    out["never"] = {"ok": never.checks[0].ok, "detail": never.checks[0].detail, "fix": never.checks[0].fix}

    run = Preflight()
    check_resources(cfg, run, request=True)  # what `--run` does: asks the autoscaler for every role's bundles
    out["run"] = {"ok": run.checks[0].ok, "detail": run.checks[0].detail}
    out["grew_s"] = wait_nodes(len(head) + 1)

    # The engine's shape, placed as RolloutGroup places it: a placement group of its own, the actor inside.
    res = cfg.rollout.engine_resources
    pg = placement_group([res.bundle()], strategy="PACK", name="mcprl:fake:engine-0")
    wait_placed([pg], "engine-shaped probe", timeout_s=DEADLINE_S)
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    probe = ray.remote(Probe).options(**res.actor_options(), scheduling_strategy=strategy).remote()
    out["engine_node"] = ray.get(probe.node.remote(), timeout=DEADLINE_S)
    out["head_nodes"] = head
    ray.kill(probe)
    remove_placement_group(pg)

    release_request()  # what the driver does at the end of a run
    out["shrank_s"] = wait_nodes(len(head))
    return out


if __name__ == "__main__":
    # The result goes to a file: Ray's autoscaler messages share this process's stdout and may end without a newline.
    Path(sys.argv[2]).write_text(json.dumps(main(sys.argv[1])))
