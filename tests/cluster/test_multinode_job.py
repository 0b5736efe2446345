"""`ray job submit` on a real two-node Ray cluster on loopback, as the README tells a user to do it.

The head runs the job's driver; a worker node (its own --temp-dir, so its own unpacked working directory)
is the only one offering the custom resource `mcprl_worker`, which the engine, the runner, the learner, the
warm-start task and the tool replicas ask for. Outputs go to S3 (moto's server on loopback): nothing may
assume that the driver and the actors share a disk. The first job is stopped with `ray job stop` after its
first checkpoint; a second job resumes the run and finishes it.

How the fixture starts the nodes: `ray start --block` with free ports for everything a node binds
(tests/cluster/fake_autoscaler.py), `--node-ip-address 127.0.0.1` on each, token auth off
(RAY_AUTH_MODE=disabled on the nodes and the CLI; the README says how to submit with token auth on), and
the S3 credentials in the nodes' environment, where a real cluster keeps its secrets. Each node runs in its
own session and is stopped by killing its process group: only processes this test started.
SLOW (~2–3 min): a cluster and two training jobs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from cluster import storage
from tests.cluster.fake_autoscaler import CLUSTER_ENV, node_port_flags, stop_group
from tests.conftest import free_port
from tests.s3_server import BUCKET, s3_env

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
JOB_TIMEOUT_S = 600
ON_WORKER = "{mcprl_worker: 1}"
OVERRIDES = [
    f"rollout.engine_resources.resources={ON_WORKER}",
    f"rollout.runner_resources.resources={ON_WORKER}",
    f"learner.worker_resources.resources={ON_WORKER}",
    f"tools.servers.polygon.replica_resources.resources={ON_WORKER}",
    f"tools.servers.fmp.replica_resources.resources={ON_WORKER}",
    "cluster.num_cpus=null",
]


def _wait_for(what: str, ok: object, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s:.0f} s")
        time.sleep(0.5)


@contextmanager
def two_nodes(env: dict[str, str]) -> Iterator[tuple[str, str]]:
    """A head and one worker node on loopback; yields (GCS address, dashboard URL)."""
    tmp = Path(tempfile.mkdtemp(prefix="mcprl-2n-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    gcs, dash = free_port(), free_port()
    venv_bin = str(Path(sys.executable).parent)  # a job's `python` is the one on PATH where `ray start` ran
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | CLUSTER_ENV | env
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"  # "0" refuses a second node; each node is pinned to 127.0.0.1
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env["RAY_JOB_STOP_WAIT_TIME_S"] = "60"  # what the runbook says to set: time for a stopped run to clean up
    head_cmd = [
        RAY, "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1",
        f"--temp-dir={tmp / 'head'}", "--num-cpus=2", "--include-dashboard=true",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", *node_port_flags(),
    ]  # fmt: skip
    worker_cmd = [
        RAY, "start", "--block", f"--address=127.0.0.1:{gcs}", "--node-ip-address=127.0.0.1",
        f"--temp-dir={tmp / 'worker'}", "--num-cpus=4", '--resources={"mcprl_worker": 10}', *node_port_flags(),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{dash}"
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        for name, cmd in (("head", head_cmd), ("worker", worker_cmd)):
            log = stack.enter_context(open(tmp / f"{name}.log", "w"))
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            stack.callback(stop_group, proc)
            if name == "head":
                _wait_for("the head's dashboard", lambda: _get_json(f"{url}/api/version") is not None)
        _wait_for("two alive nodes", lambda: len(_alive_nodes(url)) == 2)
        yield f"127.0.0.1:{gcs}", url


def _get_json(url: str) -> object:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _alive_nodes(dashboard: str) -> list[dict]:
    from ray.util.state import list_nodes

    try:
        return [n for n in list_nodes(address=dashboard, raise_on_missing_output=False) if n.state == "ALIVE"]
    except Exception:
        return []


def ray_cli(dashboard: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | CLUSTER_ENV | env
    cmd = [RAY, "job", args[0], f"--address={dashboard}", *args[1:]]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)


def submit(dashboard: str, env: dict[str, str], *args: str, wait: bool = True) -> subprocess.CompletedProcess:
    """`ray job submit` of jobs.train on ci-tiny, as the README writes it."""
    return ray_cli(
        dashboard, env, "submit", f"--working-dir={ROOT}", f"--runtime-env={ROOT / 'cluster' / 'runtime_env.yaml'}",
        *([] if wait else ["--no-wait"]), "--", "python", "-m", "jobs.train", "--config", "configs/ci-tiny.yaml", *args,
    )  # fmt: skip


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    with s3_env() as env:
        yield env


def test_a_submitted_run_on_two_nodes_is_stopped_resumed_and_finishes_into_storage(s3: dict[str, str]) -> None:
    from ray.util.state import list_actors

    store = f"s3://{BUCKET}/cluster-runs"
    run = storage.join(store, "ci-tiny")
    sets = [item for o in [*OVERRIDES, f"train.storage={store}"] for item in ("--set", o)]
    with two_nodes(s3) as (_, dashboard):
        worker = next(n.node_id for n in _alive_nodes(dashboard) if not n.is_head_node)
        started = submit(dashboard, s3, *sets, "--run", wait=False)
        job = re.search(r"raysubmit_\w+", started.stdout)
        assert job, started.stdout + started.stderr
        _wait_for(
            "the first checkpoint in storage",
            lambda: storage.exists(storage.join(run, "checkpoints", "step_1", "meta.json")),
            timeout_s=JOB_TIMEOUT_S,
        )
        placed = {a.name: a.node_id for a in list_actors(address=dashboard, detail=True, limit=1000) if a.name}
        for role in ("engine-0", "runner-0", "learner-0"):
            assert placed.get(f"mcprl:ci-tiny:{role}") == worker, (role, placed)
        from ray.job_submission import JobStatus, JobSubmissionClient

        jobs = JobSubmissionClient(dashboard)
        stop = ray_cli(dashboard, s3, "stop", job.group())
        try:
            _wait_for("the stopped job's end", lambda: jobs.get_job_status(job.group()) == JobStatus.STOPPED)
        except TimeoutError as e:
            raise AssertionError(
                f"{e}: {jobs.get_job_info(job.group())}\n{stop.stdout[-2000:]}{stop.stderr[-2000:]}\n"
                + jobs.get_job_logs(job.group())[-6000:]
            ) from None
        logs = jobs.get_job_logs(job.group())
        # the job's logs carry the same progress lines as a local run, and say how to resume
        for line in (f"outputs: {run}", "warm start done", "eval [after warm start]", "stopped by SIGTERM"):
            assert line in logs, f"{line!r} not in the job's logs:\n{logs[-5000:]}"
        apps = _get_json(f"{dashboard}/api/serve/applications/") or {}
        assert not apps.get("applications"), f"Serve apps outlived the stopped run: {list(apps['applications'])}"

        again = submit(dashboard, s3, *sets, "--run", "--resume")
        assert "succeeded" in again.stdout.lower(), again.stdout[-4000:] + again.stderr[-4000:]
        assert f"resumed from {storage.join(run, 'checkpoints', 'step_')}" in again.stdout
        assert "report: " in again.stdout
    for part in ("checkpoints/step_2/meta.json", "final_adapter/adapter_config.json", "sft/adapter_config.json"):
        assert storage.exists(storage.join(run, *part.split("/"))), part
    for part in ("report/summary.md", "config.json"):
        assert storage.exists(storage.join(run, *part.split("/"))), part
    steps = [json.loads(r)["step"] for r in storage.read_text(storage.join(run, "metrics.jsonl")).splitlines()]
    assert {1, 2} <= set(steps)
