"""Benchmark suite `job`: what `ray job submit` costs against the same run started locally.

    python -m bench --suite job [--repeats 3] [--set job.config=configs/ci-tiny.yaml]

One run, side by side on this machine: a Ray cluster on loopback (a head started with `ray start`, as the
the runbook in docs/cluster.md does; cluster/local_cluster.py) is started first and left idle while the local runs go.
Then, `--repeats` times, alternating (`--quick`: once each, one GRPO step):
- local:     `python -m jobs.train --config CFG --run` in a fresh process (its own embedded Ray);
- submitted: `ray job submit --working-dir . --runtime-env cluster/runtime_env.yaml -- python -m jobs.train ...`
             to that cluster (the CLI packs and uploads this checkout; the head unpacks it and starts the driver).
Each run gets its own storage folder and task files (so both generate their tasks and start from nothing).
Figures per run: wall time (process start to exit; for the submitted run, from `ray job submit` until it
returns), the steps' own time (the sum of `timing/step_s` in metrics.jsonl) and the rest (start-up, warm
start, evaluations, teardown). Reported as medians with ranges, and the submitted/local ratios.
The cluster's own start time is shown apart: a user pays it once, not per job.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from bench.options import BenchOptions
from bench.results import Row, Spread, SuiteResult, machine, spread
from cluster import storage
from cluster.local_cluster import ROOT, clean_env, loopback_cluster

TRAIN = ("python", "-m", "jobs.train")
KEYS = {"wall_s": "whole run", "steps_s": "GRPO steps", "rest_s": "start, eval, teardown"}
# --quick: one step, no warm start, one evaluation task each time: the two paths, at the least cost
QUICK_SETS = ("train.steps=1", "sft_warmup.enabled=false", "train.eval_tasks=1")


def run_args(config: str, folder: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """jobs.train's arguments for one timed run, all of whose files go under `folder`."""
    sets = {
        "train.storage": str(folder / "runs"),
        "data.train": str(folder / "data" / "tasks.train.jsonl"),
        "data.validation": str(folder / "data" / "tasks.validation.jsonl"),
    }
    sets = [*(f"{k}={v}" for k, v in sets.items()), *extra]
    return ["--config", config, "--run", *[a for item in sets for a in ("--set", item)]]


def step_seconds(run_folder: str) -> list[float]:
    path = storage.join(run_folder, "metrics.jsonl")
    rows = [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]
    return [r["timing/step_s"] for r in rows if "timing/step_s" in r]


def timed(kind: str, cmd: list[str], env: dict[str, str], run_folder: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or (kind == "submitted" and "succeeded" not in proc.stdout.lower()):
        tail = proc.stdout[-3000:] + proc.stderr[-3000:]
        raise RuntimeError(f"the {kind} run failed (exit {proc.returncode}):\n{tail}")
    steps = step_seconds(run_folder)
    return {"wall_s": wall, "steps_s": sum(steps), "rest_s": wall - sum(steps), "steps": len(steps)}


def run(opts: BenchOptions, console: Console) -> SuiteResult:
    """Run the suite (see the module doc), print its table."""
    job = opts.job
    repeats = 1 if opts.quick else opts.repeats
    extra = QUICK_SETS if opts.quick else ()

    run_name = yaml.safe_load((ROOT / job.config).read_text()).get("run_name", "mcprl")
    root = Path(tempfile.mkdtemp(prefix="mcprl-bench-job-", dir="/tmp"))
    runs: dict[str, list[dict[str, Any]]] = {"local": [], "submitted": []}
    try:
        t0 = time.perf_counter()
        with loopback_cluster(head_cpus=job.head_cpus) as cluster:
            cluster_start_s = time.perf_counter() - t0
            console.print(f"cluster on loopback up in {cluster_start_s:.1f} s ({cluster.dashboard})")
            for i in range(repeats):
                for kind in ("local", "submitted") if i % 2 == 0 else ("submitted", "local"):
                    folder = root / f"{kind}-{i}"
                    argv = run_args(job.config, folder, extra)
                    if kind == "local":
                        cmd, env = [sys.executable, "-m", "jobs.train", *argv], clean_env()
                    else:
                        cmd, env = cluster.submit_command(*TRAIN, *argv), cluster.env
                    result = timed(kind, cmd, env, str(folder / "runs" / run_name))
                    runs[kind].append(result)
                    console.print(f"{kind} #{i + 1}: {result['wall_s']:.1f} s ({result['steps_s']:.1f} s in steps)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures = {kind: {key: spread([r[key] for r in rs]) for key in KEYS} for kind, rs in runs.items()}
    report = {
        "machine": machine(),
        "config": job.config,
        "repeats": repeats,
        "cluster_start_s": cluster_start_s,
        "runs": runs,
        "ratio": {key: figures["submitted"][key].median / figures["local"][key].median for key in KEYS},
    }
    show(figures, report, console)
    rows = [
        Row(f"{label}, {job.config}", "s", figures["submitted"][key], figures["local"][key],
            "the same run started locally (ours: ray job submit)", "lower")
        for key, label in KEYS.items()
    ]  # fmt: skip
    notes = [f"the loopback cluster's own start, paid once per cluster: {cluster_start_s:.1f} s"]
    return SuiteResult("job", report, rows, notes=notes)


def show(figures: dict[str, dict[str, Spread]], report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"{report['config']}: submitted vs local, median (range) of {report['repeats']} runs each")
    for col in ("seconds", "local", "submitted", "submitted / local"):
        table.add_column(col)
    for key, label in KEYS.items():
        local, submitted = figures["local"][key], figures["submitted"][key]
        table.add_row(label, local.text(), submitted.text(), f"{submitted.median / local.median:.2f}×")
    console.print(table)
    console.print(f"the cluster's own start (once per cluster, not per job): {report['cluster_start_s']:.1f} s")
