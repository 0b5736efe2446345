"""Benchmarks, measured side by side in one run and reported as ratios.

    python -m jobs.benchmark --suite tools [--calls 300] [--out bench_results/tools.json]

Suite `tools`: one cheap tool (polygon.previous_close, offline) called through three doors —
the in-process FastMCP client, a Serve handle, and MCP over HTTP through Serve's proxy — and a
CPU-bound python-tool program on 1 vs 2 replicas. Numbers depend on the machine and its load:
compare the columns of one run, not runs of different days.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cluster.ray_env import ray_session
from configs.schema import Config
from jobs.cli import base_parser, setup

CHEAP_CALL = ("polygon", "previous_close", {"ticker": "AAPL"})
# ~1 s of pure-Python CPU work: the sandbox's start-up and the routing cost little beside it.
CPU_BOUND_CODE = "s = 0\nfor i in range(12_000_000):\n    s += i * i\nprint(s)\n"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(call: Callable[[], Awaitable[Any]], n: int, concurrency: int) -> dict[str, float]:
    """Latency of `n` sequential calls, then throughput of `n` calls with `concurrency` in flight."""
    for _ in range(min(10, n)):  # warm-up: connections, caches, lazy imports
        await call()
    latencies = []
    for _ in range(n):
        t = time.perf_counter()
        await call()
        latencies.append((time.perf_counter() - t) * 1e3)
    sem = asyncio.Semaphore(concurrency)

    async def bounded() -> None:
        async with sem:
            await call()

    t = time.perf_counter()
    await asyncio.gather(*(bounded() for _ in range(n)))
    wall = time.perf_counter() - t
    return {
        "p50_ms": statistics.median(latencies),
        "p99_ms": percentile(latencies, 0.99),
        "calls_per_s": n / wall,
        "seq_calls_per_s": 1e3 / statistics.mean(latencies),
    }


def _check(result: Any) -> None:
    ok = getattr(result, "ok", None)
    if ok is False or getattr(result, "is_error", False):
        raise RuntimeError(f"benchmark call failed: {result}")


async def bench_doors(cfg: Config, pool: Any, n: int, concurrency: int) -> dict[str, dict[str, float]]:
    from fastmcp import Client

    from mcp_servers import build_server

    server, tool, args = CHEAP_CALL
    results: dict[str, dict[str, float]] = {}
    async with Client(build_server(server, getattr(cfg.tools.servers, server))) as local:
        results["in-process FastMCP client"] = await measure(lambda: local.call_tool(tool, args), n, concurrency)

    async def via_handle() -> None:
        _check(await pool.call_tool(server, tool, args))

    results["Serve handle"] = await measure(via_handle, n, concurrency)
    async with Client(pool.url(server)) as remote:

        async def via_http() -> None:
            _check(await remote.call_tool(tool, args, raise_on_error=False))

        results["MCP over HTTP (Serve proxy)"] = await measure(via_http, n, concurrency)
    return results


async def bench_python_replicas(pool: Any, calls: int, concurrency: int) -> float:
    async def run() -> None:
        _check(await pool.call_tool("python", "run_python", {"code": CPU_BOUND_CODE}))

    await run()
    t = time.perf_counter()
    sem = asyncio.Semaphore(concurrency)

    async def bounded() -> None:
        async with sem:
            await run()

    await asyncio.gather(*(bounded() for _ in range(calls)))
    return calls / (time.perf_counter() - t)


def suite_tools(cfg: Config, calls: int, console: Console) -> dict[str, Any]:
    from serve_apps.tool_pool import deploy_pool, undeploy_pool

    py = cfg.tools.servers.python
    py.autoscaling = None
    py.num_cpus = 0.5
    py.sandbox.max_concurrent = 1  # one CPU-bound program per replica: scale by replicas
    py.timeout_s = 60
    py.sandbox.wall_time_s = py.sandbox.cpu_time_s = 30
    report: dict[str, Any] = {"calls": calls}
    with ray_session(cfg.cluster):
        py.replicas = 1
        pool = deploy_pool(cfg.tools)
        try:
            with console.status("tool doors: in-process, handle, HTTP"):
                report["doors"] = asyncio.run(bench_doors(cfg, pool, calls, concurrency=8))
            throughput = {}
            for replicas in (1, 2):
                py.replicas = replicas
                pool = deploy_pool(cfg.tools)  # redeploys the apps; only python's replica count changed
                with console.status(f"python tool, {replicas} replica(s)"):
                    throughput[replicas] = asyncio.run(bench_python_replicas(pool, calls=12, concurrency=4))
            report["python_calls_per_s"] = throughput
        finally:
            undeploy_pool(pool)
    doors = report["doors"]
    base = doors["in-process FastMCP client"]["p50_ms"]
    report["handle_overhead_p50_ms"] = doors["Serve handle"]["p50_ms"] - base
    report["python_2_vs_1_replicas"] = throughput[2] / throughput[1]
    return report


def print_tools(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"tool calls ({report['calls']} calls each; polygon.previous_close, offline)")
    for col in ("door", "p50 ms", "p99 ms", "calls/s sequential", "calls/s, 8 in flight"):
        table.add_column(col, justify="right" if col != "door" else "left")
    for door, r in report["doors"].items():
        table.add_row(
            door, f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['seq_calls_per_s']:.0f}", f"{r['calls_per_s']:.0f}"
        )
    console.print(table)
    tp = report["python_calls_per_s"]
    console.print(
        f"handle overhead at p50 vs in-process: {report['handle_overhead_p50_ms']:+.2f} ms (goal: within 3 ms)\n"
        f"python tool, CPU-bound program, 4 in flight: 1 replica {tp[1]:.2f} calls/s, "
        f"2 replicas {tp[2]:.2f} calls/s -> {report['python_2_vs_1_replicas']:.2f}x (goal: >= 1.6x)"
    )


SUITES = {"tools": (suite_tools, print_tools)}


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="tools")
    parser.add_argument("--calls", type=int, default=300, help="calls per measurement")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    cfg = setup(args)
    console = Console()
    run, show = SUITES[args.suite]
    report = run(cfg, args.calls, console)
    show(report, console)
    out = Path(args.out or f"bench_results/{args.suite}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    console.print(f"report: {out}")


if __name__ == "__main__":
    main()
