"""Embedded Ray: loopback only, and we stop only what we started."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import ray

from cluster.local_cluster import RAY, clean_env, get_json, node_port_flags, stop_group, wait_for
from cluster.ports import free_port
from cluster.ray_env import _EMBEDDED_ENV, embedded_cpus, start_ray
from configs.schema import ClusterConfig

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]


def test_embedded_ray_listens_on_loopback_only(ray_cluster):
    assert ray_cluster.started_here
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    assert ray_cluster.address.startswith("127.0.0.1:")
    # The embedded Ray's processes (gcs, raylet, workers) are all descendants of this process.
    ours = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    assert len(ours) >= 3
    exposed = [
        (c.pid, c.laddr)
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in ours and not _loopback(c.laddr.ip)
    ]
    assert not exposed, exposed


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)


def test_second_start_reuses_the_running_ray(ray_cluster):
    again = start_ray(ClusterConfig())
    assert not again.started_here  # stopping this handle must not stop the session's Ray
    assert again.address == ray_cluster.address


def test_address_precedence(monkeypatch):
    from cluster.ray_env import cluster_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(ClusterConfig()) is None  # embedded
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # what `ray job submit` sets
    assert cluster_address(ClusterConfig()) == "127.0.0.1:6379"
    assert cluster_address(ClusterConfig(address="auto")) == "auto"  # the config wins


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("http://127.0.0.1:{port}", ["is a URL, the Ray dashboard's", "GCS address", "ray job submit"]),
        ("127.0.0.1:{port}", ["nothing answers at 127.0.0.1:{port}", "GCS address", "unset it"]),
        ("127.0.0.1", ["expected host:port"]),
    ],
    ids=["dashboard-url", "nothing-listens", "no-port"],
)
def test_a_bad_ray_address_fails_within_seconds_naming_it(address: str, says: list[str]) -> None:
    """`RAY_ADDRESS=... python -m jobs.train --config configs/ci-tiny.yaml` (preflight), as the runbook's reader
    typed it: a clear error naming the address and what to set, no traceback, no minutes of retries."""
    port = free_port()
    address = address.format(port=port)
    cmd = [sys.executable, "-m", "jobs.train", "--config", "configs/ci-tiny.yaml"]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=clean_env({"RAY_ADDRESS": address}), capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert f"error: RAY_ADDRESS={address}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    for text in says:
        assert text.format(port=port) in proc.stderr, proc.stderr
    assert took < 60, f"{took:.0f} s"  # the imports, then a refused TCP connect: no Ray retries


def test_the_runbooks_one_machine_cluster_preflight_dashboard_and_stop(ray_cluster, tmp_path: Path) -> None:
    """docs/cluster.md's one-machine cluster as a user runs it: `ray start --head --block` pinned to loopback (here
    on free ports), preflight against its GCS address from a shell without Ray's loopback setting, the run's
    session after preflight still printing the dashboard's URL, and stopping that head by its PID alone."""
    gcs, dash = free_port(), free_port()
    temp = Path(tempfile.mkdtemp(prefix="mcprl-rb-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    head = [
        RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}", f"--temp-dir={temp}", "--num-cpus=2", *node_port_flags(),
    ]  # fmt: skip
    log = open(tmp_path / "head.log", "w")
    proc = subprocess.Popen(head, env=clean_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("the head's dashboard", lambda: get_json(f"http://127.0.0.1:{dash}/api/version") is not None)
        # The user's shell: RAY_ADDRESS only (our own test process set the loopback switch; a shell has none).
        env = {k: v for k, v in clean_env().items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
        env["RAY_ADDRESS"] = f"127.0.0.1:{gcs}"
        cmd = [sys.executable, "-m", "jobs.train", "--config", "configs/ci-tiny.yaml"]
        pre = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert pre.returncode == 0, pre.stdout[-3000:] + pre.stderr[-3000:]
        assert f"cluster at 127.0.0.1:{gcs} holds every role now" in pre.stdout, pre.stdout
        script = (
            "from configs.loader import load_config\n"
            "from jobs.preflight import cluster_view\n"
            "from cluster.ray_env import start_ray\n"
            "cfg = load_config('configs/ci-tiny.yaml')\n"
            "cluster_view(cfg)\n"  # what jobs.train --run does first
            "print('dashboard:', start_ray(cfg.cluster).dashboard_url)\n"
        )
        run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
        assert f"dashboard: http://127.0.0.1:{dash}" in run.stdout, run.stdout + run.stderr[-3000:]

        proc.terminate()  # `kill <PID of ray start --block>`: that head and what it started, nothing else
        proc.wait(timeout=90)
        wait_for("the head's processes to end", lambda: not _processes_under(temp), timeout_s=60)
        assert ray.cluster_resources().get("CPU"), "the other Ray on this machine went too"
    finally:
        stop_group(proc)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _processes_under(temp: Path) -> list[int]:
    """Ray processes of the node whose --temp-dir (or session dir) is `temp`."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(str(temp) in part for part in p.info["cmdline"] or []):
            out.append(p.info["pid"])
    return out


# A fresh interpreter: import our modules as an entry point does (nothing of ours imports ray at import),
# then start an embedded Ray as a job does (start_ray sets the environment up); report where it listens.
FRESH_START = """
import json, os, sys
import jobs.train, bench.__main__  # the entry points' whole import graph
before = {k: os.environ.get(k) for k in KEYS}
ray_imported = "ray" in sys.modules
from cluster.ray_env import start_ray, stop_ray
from configs.schema import ClusterConfig
handle = start_ray(ClusterConfig(num_cpus=1))
import psutil, ray
ours = {p.pid for p in psutil.Process().children(recursive=True)}
listen = [c.laddr.ip for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.pid in ours]
print(json.dumps({"before": before, "ray_imported": ray_imported, "address": handle.address, "listen": listen,
                  "node_ip": ray.util.get_node_ip_address(), "after": {k: os.environ.get(k) for k in KEYS}}))
stop_ray(handle)
"""


def test_a_fresh_process_sets_the_environment_up_only_when_asked_and_starts_ray_on_loopback() -> None:
    env = {k: v for k, v in os.environ.items() if k not in _EMBEDDED_ENV and k != "RAY_ADDRESS"}
    code = f"KEYS = {sorted(_EMBEDDED_ENV)!r}\n" + FRESH_START
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"] == dict.fromkeys(_EMBEDDED_ENV)  # importing changes no environment
    assert not out["ray_imported"]  # so start_ray's configure_ray_env() comes before ray reads it
    assert out["after"] == _EMBEDDED_ENV
    assert out["node_ip"] == "127.0.0.1" and out["address"].startswith("127.0.0.1:")
    assert out["listen"] and all(_loopback(ip) for ip in out["listen"]), out["listen"]  # gcs, raylet, workers


def test_the_embedded_ray_gets_a_whole_cpu_count():
    # The schema reads `num_cpus: 8` as 8.0; Ray's raylet never came up with that on a GPU machine.
    assert [embedded_cpus(ClusterConfig(num_cpus=n)) for n in (8, 8.0, 0.5)] == [8, 8, 1]
    assert isinstance(embedded_cpus(ClusterConfig(num_cpus=8.0)), int)
    assert embedded_cpus(ClusterConfig()) == os.cpu_count()


# A job's early start, as jobs.train makes it: Ray starts on a thread while the job imports; its processes must
# outlive that thread's work (they get a signal when the thread that started them ends), and stop_early stops them.
EARLY_START = """
import json, time
from cluster.console import quiet_third_party
from cluster.ray_env import ray_session, start_ray_early, stop_early
quiet_third_party()  # as every job's setup does
from configs.schema import ClusterConfig
cfg = ClusterConfig(num_cpus=1)
started = start_ray_early(cfg)
import torch  # the job's own work meanwhile
with ray_session(cfg, started) as handle:
    time.sleep(2)  # long after the start: a thread that had ended would have taken Ray with it
    import psutil, ray
    ours = [p for p in psutil.Process().children(recursive=True)]
    print(json.dumps({"answer": ray.get(ray.remote(lambda: 41 + 1).remote()), "pids": [p.pid for p in ours]}))
again = start_ray_early(cfg)
stop_early(again)  # a job whose checks fail
import ray
print(json.dumps({"after_stop": ray.is_initialized()}))
"""


def test_an_early_start_beside_the_jobs_checks_keeps_ray_up_and_stops_it() -> None:
    done = subprocess.run(
        [sys.executable, "-c", EARLY_START], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, last = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert first["answer"] == 42
    assert last == {"after_stop": False}
    assert not [pid for pid in first["pids"] if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert "SIGTERM handler is not set" not in done.stderr  # the job sets it itself: no warning for its user
