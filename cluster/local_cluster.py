"""A real Ray cluster on this machine's loopback: a head and worker nodes started with `ray start`.

What the multi-node tests and `python -m bench --suite job` run against, started the way the runbook in docs/cluster.md
starts a cluster. Each node binds free ports for everything it listens on (so it lives beside the embedded Ray
of a test session), is pinned to 127.0.0.1, has its own `--temp-dir` (so its own unpacked job working
directories), and runs in its own session: stopping is killing that process group, only what we started.
Token auth is off on the nodes and the CLI (`RAY_AUTH_MODE=disabled`); docs/cluster.md says how to submit with it on.
A one-node cluster listens on loopback only; with worker nodes Ray's own ports listen on every interface.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from cluster.ports import free_port

RAY = str(Path(sys.executable).with_name("ray"))
ROOT = Path(__file__).resolve().parents[1]

# Every Ray process of a loopback cluster, and its drivers and CLI: no token, no telemetry.
LOOPBACK_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # the fake autoscaler's nodes take 127.0.0.1 as their address
}

# Ports every node binds besides the GCS and dashboard ones.
NODE_PORTS = (
    "ray-client-server",
    "dashboard-agent-listen",
    "dashboard-agent-grpc",
    "metrics-export",
    "runtime-env-agent",
)


def node_port_flags() -> list[str]:
    return [f"--{name}-port={free_port()}" for name in NODE_PORTS]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without RAY_ADDRESS (a child must not join our own Ray), plus LOOPBACK_ENV."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | LOOPBACK_ENV | (extra or {})


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM a node's process group (the node and every process it started), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)  # anyone left in the group?
            except ProcessLookupError:
                proc.poll()
                return
            proc.poll()
            time.sleep(0.2)


def wait_for(what: str, ok: Callable[[], object], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s:.0f} s")
        time.sleep(0.5)


def get_json(url: str) -> object:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class LoopbackCluster:
    address: str  # the GCS, for `ray start --address` and ray.init
    dashboard: str  # the dashboard's URL, for `ray job` and the state API
    env: dict[str, str]  # what the nodes run with; give it to `ray job` too

    def alive_nodes(self) -> list:
        from ray.util.state import list_nodes

        try:
            nodes = list_nodes(address=self.dashboard, raise_on_missing_output=False)
        except Exception:  # the dashboard is still starting
            return []
        return [n for n in nodes if n.state == "ALIVE"]

    def job_command(self, *args: str) -> list[str]:
        """The command line of `ray job <args>` against this cluster (run it with `self.env`)."""
        return [RAY, "job", args[0], f"--address={self.dashboard}", *args[1:]]

    def submit_command(self, *entrypoint: str, wait: bool = True) -> list[str]:
        """`ray job submit` of this checkout, with the runtime env docs/cluster.md documents."""
        return self.job_command(
            "submit", f"--working-dir={ROOT}", f"--runtime-env={ROOT / 'cluster' / 'runtime_env.yaml'}",
            *([] if wait else ["--no-wait"]), "--", *entrypoint,
        )  # fmt: skip

    def job(self, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
        """`ray job <args>` against this cluster."""
        return subprocess.run(self.job_command(*args), env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def submit(self, *entrypoint: str, wait: bool = True, timeout_s: float = 600) -> subprocess.CompletedProcess:
        cmd = self.submit_command(*entrypoint, wait=wait)
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)


@contextmanager
def loopback_cluster(
    head_cpus: int = 2, workers: Sequence[dict] = (), env: dict[str, str] | None = None
) -> Iterator[LoopbackCluster]:
    """A head with a dashboard, plus one node per entry of `workers` ({"num_cpus": n, "resources": {...}})."""
    tmp = Path(tempfile.mkdtemp(prefix="mcprl-lc-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    gcs, dash = free_port(), free_port()
    venv_bin = str(Path(sys.executable).parent)  # a job's `python` is the one on PATH where `ray start` ran
    node_env = clean_env(env)
    # "0" keeps every listener on 127.0.0.1 but refuses a second node; with "1" a joining node takes the machine's
    # address for the head's, and Ray's own ports listen on every interface (docs/cluster.md: "Known limits").
    node_env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1" if workers else "0"
    node_env["PATH"] = venv_bin + os.pathsep + node_env.get("PATH", "")
    node_env["RAY_JOB_STOP_WAIT_TIME_S"] = "60"  # what the runbook says to set: time for a stopped run to clean up
    commands = [
        [
            RAY, "start", "--head", f"--port={gcs}", f"--temp-dir={tmp / 'head'}", f"--num-cpus={head_cpus}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        ]
    ] + [
        [
            RAY, "start", f"--address=127.0.0.1:{gcs}", f"--temp-dir={tmp / f'worker{i}'}",
            f"--num-cpus={w.get('num_cpus', 1)}", f"--resources={json.dumps(w.get('resources', {}))}",
        ]
        for i, w in enumerate(workers)
    ]  # fmt: skip
    cluster = LoopbackCluster(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}", node_env)
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        for i, cmd in enumerate(commands):
            log = stack.enter_context(open(tmp / f"node{i}.log", "w"))
            cmd += ["--block", "--node-ip-address=127.0.0.1", *node_port_flags()]
            proc = subprocess.Popen(cmd, env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            stack.callback(stop_group, proc)
            if i == 0:
                wait_for("the head's dashboard", lambda: get_json(f"{cluster.dashboard}/api/version") is not None)
        wait_for(f"{len(commands)} alive nodes", lambda: len(cluster.alive_nodes()) == len(commands))
        yield cluster
