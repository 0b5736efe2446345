"""`ray job submit` on a real two-node Ray cluster on loopback, as the runbook (docs/cluster.md) tells a user to do it.

The head runs the job's driver; a worker node (its own --temp-dir, so its own unpacked working directory)
is the only one offering the custom resource `mcprl_worker`, which the engine, the runner, the learner, the
warm-start task and the tool replicas ask for. Outputs go to S3 (moto's server on loopback): nothing may
assume that the driver and the actors share a disk. The first job is stopped with `ray job stop` after its
first checkpoint; a second job resumes the run and finishes it.

The nodes are started by cluster/local_cluster.py (free ports, pinned to 127.0.0.1, token auth off, each in
its own session), with the S3 credentials in their environment, where a real cluster keeps its secrets.
SLOW (~2–3 min): a cluster and two training jobs.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from cluster import storage
from cluster.local_cluster import LoopbackCluster, get_json, loopback_cluster, wait_for
from tests.s3_server import BUCKET

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

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


def submit(cluster: LoopbackCluster, *args: str, wait: bool = True) -> subprocess.CompletedProcess:
    """`ray job submit` of jobs.train on ci-tiny, as docs/cluster.md writes it."""
    entry = ("python", "-m", "jobs.train", "--config", "configs/ci-tiny.yaml", *args)
    return cluster.submit(*entry, wait=wait, timeout_s=JOB_TIMEOUT_S)


def test_a_submitted_run_on_two_nodes_is_stopped_resumed_and_finishes_into_storage(s3: dict[str, str]) -> None:
    from ray.util.state import list_actors

    store = f"s3://{BUCKET}/cluster-runs"
    run = storage.join(store, "ci-tiny")
    sets = [item for o in [*OVERRIDES, f"train.storage={store}"] for item in ("--set", o)]
    with loopback_cluster(workers=[{"num_cpus": 4, "resources": {"mcprl_worker": 10}}], env=s3) as cluster:
        dashboard = cluster.dashboard
        worker = next(n.node_id for n in cluster.alive_nodes() if not n.is_head_node)
        started = submit(cluster, *sets, "--run", wait=False)
        job = re.search(r"raysubmit_\w+", started.stdout)
        assert job, started.stdout + started.stderr
        wait_for(
            "the first checkpoint in storage",
            lambda: storage.exists(storage.join(run, "checkpoints", "step_1", "meta.json")),
            timeout_s=JOB_TIMEOUT_S,
        )
        placed = {a.name: a.node_id for a in list_actors(address=dashboard, detail=True, limit=1000) if a.name}
        for role in ("engine-0", "runner-0", "learner-0"):
            assert placed.get(f"mcprl:ci-tiny:{role}") == worker, (role, placed)
        from ray.job_submission import JobStatus, JobSubmissionClient

        jobs = JobSubmissionClient(dashboard)
        stop = cluster.job("stop", job.group())
        try:
            wait_for("the stopped job's end", lambda: jobs.get_job_status(job.group()) == JobStatus.STOPPED)
        except TimeoutError as e:
            raise AssertionError(
                f"{e}: {jobs.get_job_info(job.group())}\n{stop.stdout[-2000:]}{stop.stderr[-2000:]}\n"
                + jobs.get_job_logs(job.group())[-6000:]
            ) from None
        logs = jobs.get_job_logs(job.group())
        # the job's logs carry the same progress lines as a local run, and say how to resume
        # ... and the dashboard's URL (preflight connects first; the session after it must still find it)
        expected = (f"outputs: {run}", f"Ray dashboard: {dashboard}", "warm start done", "eval [after warm start]")
        for line in (*expected, "stopped by SIGTERM"):
            assert line in logs, f"{line!r} not in the job's logs:\n{logs[-5000:]}"
        apps = get_json(f"{dashboard}/api/serve/applications/") or {}
        assert not apps.get("applications"), f"Serve apps outlived the stopped run: {list(apps['applications'])}"

        again = submit(cluster, *sets, "--run", "--resume")
        assert "succeeded" in again.stdout.lower(), again.stdout[-4000:] + again.stderr[-4000:]
        assert f"resumed from {storage.join(run, 'checkpoints', 'step_')}" in again.stdout
        assert "report: " in again.stdout
    for part in ("checkpoints/step_2/meta.json", "final_adapter/adapter_config.json", "sft/adapter_config.json"):
        assert storage.exists(storage.join(run, *part.split("/"))), part
    for part in ("report/summary.md", "config.json"):
        assert storage.exists(storage.join(run, *part.split("/"))), part
    steps = [json.loads(r)["step"] for r in storage.read_text(storage.join(run, "metrics.jsonl")).splitlines()]
    assert {1, 2} <= set(steps)
