"""Benchmark suite `job`: what `ray job submit` costs against the same run started locally.

    python -m jobs.bench_job [--config configs/ci-tiny.yaml] [--repeats 2] [--out bench_results/job.json]

One run, side by side on this machine: a Ray cluster on loopback (a head started with `ray start`, as the
README's runbook does; cluster/local_cluster.py) is started first and left idle while the local runs go.
Then, `--repeats` times, alternating:
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

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from cluster import storage
from cluster.local_cluster import ROOT, clean_env, loopback_cluster

TRAIN = ("python", "-m", "jobs.train")


def options(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/ci-tiny.yaml", help="the run to time (relative to the checkout)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternating")
    p.add_argument("--head-cpus", type=int, default=4, help="the head's logical CPUs (ci-tiny's embedded Ray has 4)")
    p.add_argument("--out", default="bench_results/job.json")
    return p.parse_args(argv)


def run_args(config: str, folder: Path) -> list[str]:
    """jobs.train's arguments for one timed run, all of whose files go under `folder`."""
    sets = {
        "train.storage": str(folder / "runs"),
        "data.train": str(folder / "data" / "tasks.train.jsonl"),
        "data.validation": str(folder / "data" / "tasks.validation.jsonl"),
    }
    return ["--config", config, "--run", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]


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


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_job_suite(args: argparse.Namespace | None = None) -> dict[str, Any]:
    """Run the suite (see the module doc), print its table, return every figure as a dict."""
    from bench.results import machine

    opts = args or options([])
    console = Console(width=None if sys.stdout.isatty() else 150)

    run_name = yaml.safe_load((ROOT / opts.config).read_text()).get("run_name", "mcprl")
    root = Path(tempfile.mkdtemp(prefix="mcprl-bench-job-", dir="/tmp"))
    runs: dict[str, list[dict[str, Any]]] = {"local": [], "submitted": []}
    try:
        t0 = time.perf_counter()
        with loopback_cluster(head_cpus=opts.head_cpus) as cluster:
            cluster_start_s = time.perf_counter() - t0
            console.print(f"cluster on loopback up in {cluster_start_s:.1f} s ({cluster.dashboard})")
            for i in range(opts.repeats):
                for kind in ("local", "submitted") if i % 2 == 0 else ("submitted", "local"):
                    folder = root / f"{kind}-{i}"
                    argv = run_args(opts.config, folder)
                    if kind == "local":
                        cmd, env = [sys.executable, "-m", "jobs.train", *argv], clean_env()
                    else:
                        cmd, env = cluster.submit_command(*TRAIN, *argv), cluster.env
                    result = timed(kind, cmd, env, str(folder / "runs" / run_name))
                    runs[kind].append(result)
                    console.print(f"{kind} #{i + 1}: {result['wall_s']:.1f} s ({result['steps_s']:.1f} s in steps)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures = {
        kind: {key: summary([r[key] for r in rs]) for key in ("wall_s", "steps_s", "rest_s")}
        for kind, rs in runs.items()
    }
    report = {
        "machine": machine(),
        "config": opts.config,
        "repeats": opts.repeats,
        "cluster_start_s": cluster_start_s,
        "runs": runs,
        "figures": figures,
        "ratio": {
            key: figures["submitted"][key]["median"] / figures["local"][key]["median"] for key in ("wall_s", "steps_s")
        },
    }
    print_job(report, console)
    return report


def print_job(report: dict[str, Any], console: Console) -> None:
    def cell(f: dict[str, float]) -> str:
        return f"{f['median']:.1f} ({f['min']:.1f}–{f['max']:.1f})"

    figures = report["figures"]
    table = Table(title=f"{report['config']}: submitted vs local, median (range) of {report['repeats']} runs each")
    for col in ("seconds", "local", "submitted", "submitted / local"):
        table.add_column(col)
    for key, label in (("wall_s", "whole run"), ("steps_s", "GRPO steps"), ("rest_s", "start, eval, teardown")):
        ratio = figures["submitted"][key]["median"] / figures["local"][key]["median"]
        table.add_row(label, cell(figures["local"][key]), cell(figures["submitted"][key]), f"{ratio:.2f}×")
    console.print(table)
    console.print(f"the cluster's own start (once per cluster, not per job): {report['cluster_start_s']:.1f} s")


def main(argv: list[str] | None = None) -> None:
    opts = options(argv)
    report = run_job_suite(opts)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"report: {out}")


if __name__ == "__main__":
    main()
