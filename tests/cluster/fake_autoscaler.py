"""Ray's fake multi-node autoscaler on loopback, started and stopped without touching anyone else's Ray.

`ray.cluster_utils.AutoscalingCluster` runs `ray stop --force` (every Ray on the machine dies) and reads a base
config the pip wheel lacks. This starts the same thing by hand: `ray start --head --block` with
`--autoscaling-config` (provider `fake_multinode`), its own temp dir, free ports, `--node-ip-address 127.0.0.1`,
no token auth, in a new session. The autoscaler (a child of the head) starts and stops worker "nodes" (raylets
on this machine) itself; all of them stay in the head's process group, so stopping is `killpg` of that group:
only processes this harness started.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cluster.local_cluster import RAY, clean_env, node_port_flags, stop_group, wait_for
from cluster.ports import free_port
from cluster.ray_env import unreachable

HEAD_TYPE = "ray.head.default"  # the fake provider's name for the head's type


def autoscaler_config(gcs_port: int, head: dict[str, float], workers: dict[str, dict]) -> dict:
    """A fake-multinode autoscaler config: idle workers go after ~12 s."""
    return {
        "cluster_name": "mcprl-fake",
        "max_workers": sum(w.get("max_workers", 1) for w in workers.values()),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.2,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": f"127.0.0.1:{gcs_port}",  # worker nodes join here, not at the default 6379
        },
        "auth": {"ssh_user": "ray"},
        "available_node_types": {
            HEAD_TYPE: {"resources": head, "node_config": {}, "max_workers": 0},
            **{name: {"node_config": {}, "min_workers": 0, **spec} for name, spec in workers.items()},
        },
        "head_node_type": HEAD_TYPE,
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


@contextmanager
def fake_autoscaling_cluster(head_cpus: float, workers: dict[str, dict]) -> Iterator[str]:
    """A head (`head_cpus` CPUs) whose autoscaler can add `workers` node types; yields its GCS address."""
    tmp = Path(tempfile.mkdtemp(prefix="mcprl-fake-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    port = free_port()
    config = tmp / "autoscaler.json"
    config.write_text(json.dumps(autoscaler_config(port, {"CPU": head_cpus}, workers)))
    env = clean_env({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    cmd = [
        RAY, "start", "--head", "--block",
        f"--port={port}", "--node-ip-address=127.0.0.1", f"--temp-dir={tmp / 'ray'}",
        f"--num-cpus={head_cpus:g}", f"--autoscaling-config={config}", "--include-dashboard=false",
        *node_port_flags(),
    ]  # fmt: skip
    log = open(tmp / "head.log", "w")  # closed below, once the head is gone
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Yield a head that answers: a driver checks the address once, for a few seconds (cluster.ray_env).
        wait_for(
            f"the fake cluster's head at 127.0.0.1:{port}",
            lambda: unreachable("127.0.0.1", port, 1.0) is None,
            timeout_s=120,
        )
        yield f"127.0.0.1:{port}"
    finally:
        stop_group(head)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
