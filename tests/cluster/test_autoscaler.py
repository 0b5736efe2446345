"""Preflight and placement against Ray's fake multi-node autoscaler: a role that needs a worker type's resource
makes the cluster grow, its workload runs there, the idle node goes away, and a role no node type could hold
is refused by name.

SLOW (~2 min): it starts a Ray cluster of its own (tests/cluster/fake_autoscaler.py, never `ray stop`), runs a
one-step ci-tiny training whose engine makes the autoscaler add a node, and waits (~12 s idle timeout) for the
node to go. Its driver runs in a separate
process (tests/cluster/fake_autoscaler_driver.py), so the session's shared Ray is never involved.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.local_cluster import clean_env

from .fake_autoscaler import fake_autoscaling_cluster
from .fake_autoscaler_driver import GPU_LIKE

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]


def test_preflight_grows_the_cluster_for_a_role_and_refuses_one_no_node_type_holds(tmp_path: Path) -> None:
    result, runs = tmp_path / "result.json", tmp_path / "runs"
    # Room beside the engine on the GPU-like node, as on a real one: Serve spreads tool replicas onto new nodes.
    workers = {"gpu_like": {"resources": {"CPU": 2, GPU_LIKE: 1}, "max_workers": 1}}
    with fake_autoscaling_cluster(head_cpus=2, workers=workers) as address:
        env = clean_env({"PYTHONPATH": str(ROOT)})
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.cluster.fake_autoscaler_driver",
                address,
                str(result),
                str(tmp_path / "runs"),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=480,
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
    assert "node types the autoscaler can add: " in dry and "gpu_like (CPU 2, mcprl_gpu_worker 1; up to 1)" in dry

    # An H100 engine: no node type has one, so preflight refuses, naming the role and its config key.
    assert not out["never"]["ok"]
    assert out["never"]["detail"].startswith(f"cluster at {address} can never hold engines")
    assert "never: no node type has GPU" in out["never"]["detail"] and "rollout.engine_resources" in out["never"]["fix"]

    # --run: the run asked for its roles' bundles, the autoscaler added a node, the engine (which only that node
    # type can hold) served the whole run there, and the idle node went away once the run withdrew its request.
    log = out["run"]["log"]
    assert out["run"]["rc"] == 0, log[-6000:]
    assert "asked its autoscaler for room for all 4 actors" in log, log[:6000]
    assert "report: " in log and (runs / "ci-tiny" / "final_adapter" / "adapter_config.json").exists()
    assert out["nodes_before"] == 1 and out["peak_nodes"] == 2
    assert isinstance(out["shrank_s"], float), out["shrank_s"]
