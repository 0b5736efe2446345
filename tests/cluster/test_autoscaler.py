"""Preflight and placement against Ray's fake multi-node autoscaler: a role that needs a worker type's resource
makes the cluster grow, its workload runs there, the idle node goes away, and a role no node type could hold
is refused by name.

SLOW (~60 s): it starts a Ray cluster of its own (tests/cluster/fake_autoscaler.py, never `ray stop`), waits for
the autoscaler to add a node and, after the ~12 s idle timeout, to remove it. Its driver runs in a separate
process (tests/cluster/fake_autoscaler_driver.py), so the session's shared Ray is never involved.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cluster.local_cluster import clean_env

from .fake_autoscaler import fake_autoscaling_cluster
from .fake_autoscaler_driver import GPU_LIKE

ROOT = Path(__file__).resolve().parents[2]


def test_preflight_grows_the_cluster_for_a_role_and_refuses_one_no_node_type_holds(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    workers = {"gpu_like": {"resources": {"CPU": 1, GPU_LIKE: 1}, "max_workers": 1}}
    with fake_autoscaling_cluster(head_cpus=1, workers=workers) as address:
        env = clean_env({"PYTHONPATH": str(ROOT)})
        proc = subprocess.run(
            [sys.executable, "-m", "tests.cluster.fake_autoscaler_driver", address, str(result)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert proc.returncode == 0 and result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(result.read_text())

    # Dry run: the engine needs the worker type, the rest fits the head; nothing is asked of the autoscaler.
    assert out["dry"]["ok"], out["dry"]
    dry = out["dry"]["detail"]
    assert dry.startswith(f"cluster at {address} must grow for engines: --run asks its autoscaler")
    engines_row = next(line for line in dry.splitlines() if line.strip().startswith("engines"))
    assert "1 CPU, mcprl_gpu_worker: 1" in engines_row and engines_row.rstrip().endswith(
        "must grow: 1 of 1 wait for new nodes"
    )
    assert "fits now" in next(line for line in dry.splitlines() if line.strip().startswith("learner workers"))
    assert "node types the autoscaler can add: " in dry and "gpu_like (CPU 1, mcprl_gpu_worker 1; up to 1)" in dry

    # An H100 engine: no node type has one, so preflight refuses, naming the role and its config key.
    assert not out["never"]["ok"]
    assert out["never"]["detail"].startswith(f"cluster at {address} can never hold engines")
    assert "never: no node type has GPU" in out["never"]["detail"] and "rollout.engine_resources" in out["never"]["fix"]

    # --run: asked for the bundles, the autoscaler added a node, the engine-shaped workload ran on it, and the
    # idle node went away once the request was withdrawn.
    assert out["run"]["ok"] and "asked its autoscaler for room for all 4 actors" in out["run"]["detail"]
    assert out["nodes_before"] == 1
    assert out["engine_node"] not in out["head_nodes"]
