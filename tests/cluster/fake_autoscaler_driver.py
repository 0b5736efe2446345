"""The driver of test_autoscaler.py, run in its own process against the fake autoscaling cluster at argv[1].

It writes one JSON object to argv[2]: what preflight said (a dry run, and a role no node type holds), how a
whole `jobs.train --run` (its outputs under argv[3]) ended, and how the node count moved. The test asserts on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cluster.ray_env import configure_ray_env
from configs.loader import load_config
from configs.schema import Resources

GPU_LIKE = "mcprl_gpu_worker"
DEADLINE_S = 60.0
RUN_TIMEOUT_S = 240
CONFIG = "configs/ci-tiny.yaml"


def overrides(address: str, storage: str) -> dict[str, str]:
    """ci-tiny, one step, polygon only, its engine needing the worker type's custom resource."""
    return {
        "cluster.address": address,
        "cluster.num_cpus": "null",
        "rollout.engine_resources": f"{{num_cpus: 1, resources: {{{GPU_LIKE}: 1}}}}",
        "train.storage": storage,
        "data.train": f"{storage}/data/tasks.train.jsonl",
        "data.validation": f"{storage}/data/tasks.validation.jsonl",
        "train.steps": "1",
        "train.eval_tasks": "2",
        "tools.servers.fmp.enabled": "false",
        "generation.domains": "[polygon]",
    }


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


def main(address: str, storage: str) -> dict[str, Any]:
    from jobs.preflight import Preflight, check_resources

    out: dict[str, Any] = {}
    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in overrides(address, storage).items()])

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

    # A whole ci-tiny run (`jobs.train --run`, its own process), its engine shaped like the worker type. Its
    # preflight asks the autoscaler for room; the engine can only be placed on the node that adds; the run
    # ends by withdrawing its request, so the node goes idle and away.
    peak = [len(head)]
    watching = threading.Event()

    def watch() -> None:
        while not watching.wait(0.5):
            peak[0] = max(peak[0], len(alive()))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(train_command(address, storage), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        parts = (x.decode() if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        rc, log = "timed out", f"{e}\n" + "".join(parts)
    watching.set()
    watcher.join()
    out["run"] = {"rc": rc, "s": time.monotonic() - t0, "log": log}
    out["peak_nodes"] = peak[0]
    try:
        out["shrank_s"] = wait_nodes(len(head))
    except TimeoutError as e:
        out["shrank_s"] = str(e)
    return out


def train_command(address: str, storage: str) -> list[str]:
    sets = [a for k, v in overrides(address, storage).items() for a in ("--set", f"{k}={v}")]
    return [sys.executable, "-m", "jobs.train", "--config", CONFIG, "--run", *sets]


if __name__ == "__main__":
    configure_ray_env()  # before ray is imported
    # The result goes to a file: Ray's autoscaler messages share this process's stdout and may end without a newline.
    Path(sys.argv[2]).write_text(json.dumps(main(sys.argv[1], sys.argv[3])))
