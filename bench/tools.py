"""Suite `tools`: one cheap tool (polygon.previous_close, offline) called through three doors — the
in-process FastMCP client, a Serve handle, and MCP over HTTP through Serve's proxy — and a CPU-bound
python-tool program on 1 vs 2 replicas. Each door is measured `--repeats` times, in turn.

    python -m bench --suite tools [--repeats 3] [--set tools.calls=300]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.options import BenchOptions
from bench.results import Row, SuiteResult, spread
from cluster.ray_env import ray_session
from configs.schema import Config

CHEAP_CALL = ("polygon", "previous_close", {"ticker": "AAPL"})
# ~1 s of pure-Python CPU work: the sandbox's start-up and the routing cost little beside it.
CPU_BOUND_CODE = "s = 0\nfor i in range(12_000_000):\n    s += i * i\nprint(s)\n"
QUICK_CODE = CPU_BOUND_CODE.replace("12_000_000", "500_000")


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


async def bench_python_replicas(
    pool: Any, calls: int, concurrency: int, code: str = CPU_BOUND_CODE, warm: int = 1
) -> float:
    """Calls/s of `calls` runs of `code` on the python tool, `concurrency` in flight, after `warm` untimed
    ones at once (one per replica warms every replica's sandbox)."""

    async def run() -> None:
        _check(await pool.call_tool("python", "run_python", {"code": code}))

    await asyncio.gather(*(run() for _ in range(warm)))
    t = time.perf_counter()
    sem = asyncio.Semaphore(concurrency)

    async def bounded() -> None:
        async with sem:
            await run()

    await asyncio.gather(*(bounded() for _ in range(calls)))
    return calls / (time.perf_counter() - t)


async def bench_tools(cfg: Config, pool: Any, calls: int, repeats: int, console: Console) -> dict[str, Any]:
    doors: dict[str, list[dict[str, float]]] = {}
    for i in range(repeats):
        with console.status(f"tool doors: in-process, handle, HTTP ({i + 1}/{repeats})"):
            for door, r in (await bench_doors(cfg, pool, calls, concurrency=8)).items():
                doors.setdefault(door, []).append(r)
    return doors


def run(opts: BenchOptions, console: Console) -> SuiteResult:
    from serve_apps.tool_pool import deploy_pool, undeploy_pool

    cfg = opts.mcprl_config()
    calls = 20 if opts.quick else opts.tools.calls
    py = cfg.tools.servers.python
    py.autoscaling = None
    py.replica_resources.num_cpus = 0.5
    py.sandbox.max_concurrent = 1  # one CPU-bound program per replica: scale by replicas
    py.sandbox.wall_time_s = py.sandbox.cpu_time_s = 30
    py.timeout_s = 120  # above the slot wait (60 s) and the wall time
    python_calls, code = (4, QUICK_CODE) if opts.quick else (12, CPU_BOUND_CODE)
    throughput: dict[int, list[float]] = {1: [], 2: []}
    with ray_session(cfg.cluster):
        py.replicas = 1
        pool = deploy_pool(cfg.tools)
        try:
            doors = asyncio.run(bench_tools(cfg, pool, calls, opts.repeats, console))
            for replicas in (1, 2):
                py.replicas = replicas
                pool = deploy_pool(cfg.tools)  # redeploys the apps; only python's replica count changed
                with console.status(f"python tool, {replicas} replica(s)"):
                    for _ in range(opts.repeats):
                        throughput[replicas].append(asyncio.run(bench_python_replicas(pool, python_calls, 4, code)))
        finally:
            undeploy_pool(pool)
    report = {"calls": calls, "doors": doors, "python_calls_per_s": throughput}
    show(report, console)
    local = "in-process FastMCP client"
    rows = [
        Row("p50 latency, Serve handle", "ms", spread([r["p50_ms"] for r in doors["Serve handle"]]),
            spread([r["p50_ms"] for r in doors[local]]), "in-process FastMCP client", "lower",
            "handle within 3 ms of in-process"),
        Row("p50 latency, MCP over HTTP (Serve proxy)", "ms",
            spread([r["p50_ms"] for r in doors["MCP over HTTP (Serve proxy)"]]),
            spread([r["p50_ms"] for r in doors[local]]), "in-process FastMCP client", "lower"),
        Row("calls/s, 8 in flight, Serve handle", "calls/s", spread([r["calls_per_s"] for r in doors["Serve handle"]]),
            spread([r["calls_per_s"] for r in doors[local]]), "in-process FastMCP client", "higher"),
        Row("CPU-bound python tool, 4 in flight", "calls/s", spread(throughput[2]), spread(throughput[1]),
            "1 replica (ours: 2)", "higher", ">= 1.6x"),
    ]  # fmt: skip
    return SuiteResult("tools", report, rows)


def show(report: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"tool calls ({report['calls']} calls each; polygon.previous_close, offline; median of repeats)"
    )
    for col in ("door", "p50 ms", "p99 ms", "calls/s sequential", "calls/s, 8 in flight"):
        table.add_column(col, justify="right" if col != "door" else "left")
    for door, rs in report["doors"].items():
        m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        table.add_row(
            door, f"{m['p50_ms']:.2f}", f"{m['p99_ms']:.2f}", f"{m['seq_calls_per_s']:.0f}", f"{m['calls_per_s']:.0f}"
        )
    console.print(table)
    tp = {k: statistics.median(v) for k, v in report["python_calls_per_s"].items()}
    console.print(
        f"python tool, CPU-bound program, 4 in flight: 1 replica {tp[1]:.2f} calls/s, "
        f"2 replicas {tp[2]:.2f} calls/s -> {tp[2] / tp[1]:.2f}x (goal: >= 1.6x)"
    )
