"""Benchmarks, measured side by side in one run and reported as ratios.

    python -m jobs.benchmark --suite tools [--calls 300] [--out bench_results/tools.json]
    python -m jobs.benchmark --suite env [--calls 300]
    python -m jobs.benchmark --suite rollout [--calls 300]

Suite `tools`: one cheap tool (polygon.previous_close, offline) called through three doors —
the in-process FastMCP client, a Serve handle, and MCP over HTTP through Serve's proxy — and a
CPU-bound python-tool program on 1 vs 2 replicas. Numbers depend on the machine and its load:
compare the columns of one run, not runs of different days.

Suite `env`: MCPToolEnv's own cost per step. `astep` on a typical one-call Hermes turn against an
instant in-process tool (a client that returns a canned result at once) vs that tool called alone;
the difference is the env's overhead per step (parsing, reward, observation, metadata).

Suite `rollout`: EpisodeRunner episodes per second, `async` vs `lockstep`, same tasks (rule
templates), same engine, every tool call delayed by 100 ms ± 50 ms (uniform, seeded) on top of the
in-process pool. The engine is a scripted stand-in that answers each turn with the task's expert
call after a fixed generation time: a model engine would make random or untrained calls that
mostly never reach a tool, which would hide the tool latency this suite is about. Measured once
with every episode at once and once with at most 16 episodes in flight.
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


# --------------------------------------------------------------------------- env suite

ENV_ACTION = '<tool_call>{"name": "polygon.previous_close", "arguments": {"ticker": "NVDA"}}</tool_call>'
ENV_ROW = {
    "data_source": "mcprl/bench",
    "prompt": [{"role": "user", "content": "What was NVDA's previous close?"}],
    "reward_spec": {
        "method": "rule",
        "ground_truth": {
            "task_id": "bench-env",
            "complexity": "simple",
            "max_turns": 50,
            "success": {"must_call_tool": "polygon.previous_close"},
            "tool_sequence": [{"step": 1, "server": "polygon", "tool": "previous_close", "params": {"ticker": "NVDA"}}],
            "limits": {"max_servers": 1, "max_tools": 1},
            "final_answer": {"value": 186.52, "tolerance": 0.01},
        },
    },
}


class InstantResult:
    """A canned ok result, the size of a real previous_close answer."""

    ok = True
    text = '{"ticker":"NVDA","status":"OK","results":[{"T":"NVDA","o":183.1,"c":186.52,"v":171234567}]}'
    structured = None
    error_kind = None
    error = None
    latency_ms = 0.0
    infra_fault = False


class InstantClient:
    """A ToolClient that answers at once: what is left of a step is the env's own work."""

    result = InstantResult()

    async def call_tool(self, server: str, tool: str, arguments: dict[str, Any] | None = None) -> InstantResult:
        return self.result

    async def list_tools(self) -> dict[str, list[dict[str, Any]]]:
        schema = {"type": "object", "properties": {"ticker": {"type": "string"}}, "required": ["ticker"]}
        return {"polygon": [{"name": "previous_close", "description": "Previous day bar.", "inputSchema": schema}]}


async def bench_env_steps(n: int, repeats: int = 5) -> dict[str, float]:
    """Best-of-`repeats` seconds per step for n steps of: the tool alone, and the env's astep."""
    from envs.mcp_tool_env import MCPToolEnv
    from envs.tool_client import set_tool_client

    client = InstantClient()
    set_tool_client(client)
    try:
        env = MCPToolEnv(None, ENV_ROW)
        await env.ainit(None)
        tool_s, env_s = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(n):
                await client.call_tool("polygon", "previous_close", {"ticker": "NVDA"})
            tool_s.append((time.perf_counter() - t) / n)
            t = time.perf_counter()
            for _ in range(n):
                env.turns, env.done = 0, False  # keep one long episode going without re-building the env
                out = await env.astep(ENV_ACTION)
            env_s.append((time.perf_counter() - t) / n)
            env.conversation = env.conversation[:2]
        if out["metadata"]["calls"][0]["ok"] is not True:
            raise RuntimeError(f"benchmark step failed: {out['metadata']}")
    finally:
        set_tool_client(None)
    return {"tool_s": min(tool_s), "env_s": min(env_s)}


def suite_env(cfg: Config, calls: int, console: Console) -> dict[str, Any]:
    n = max(2000, calls * 10)  # micro-timings: many steps, best of 5
    with console.status(f"env: {n} steps x 5"):
        r = asyncio.run(bench_env_steps(n))
    return {
        "steps": n,
        "action": ENV_ACTION,
        "tool_alone_calls_per_s": 1 / r["tool_s"],
        "env_astep_steps_per_s": 1 / r["env_s"],
        "tool_alone_ms": r["tool_s"] * 1e3,
        "env_astep_ms": r["env_s"] * 1e3,
        "env_overhead_ms": (r["env_s"] - r["tool_s"]) * 1e3,
    }


def print_env(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"MCPToolEnv step, one Hermes call, instant tool (best of 5 x {report['steps']} steps)")
    for col in ("what", "per s", "ms each"):
        table.add_column(col, justify="right" if col != "what" else "left")
    table.add_row("tool alone", f"{report['tool_alone_calls_per_s']:,.0f}", f"{report['tool_alone_ms']:.4f}")
    table.add_row("env astep", f"{report['env_astep_steps_per_s']:,.0f}", f"{report['env_astep_ms']:.4f}")
    console.print(table)
    console.print(f"env overhead per step: {report['env_overhead_ms']:.4f} ms (goal: < 0.2 ms)")


# --------------------------------------------------------------------------- rollout suite

ROLLOUT_TASKS = 16
ROLLOUT_GROUP = 4
ROLLOUT_GEN_S = 0.02  # the stand-in engine's time per generation
ROLLOUT_TOOL_S = (0.05, 0.15)  # 100 ms ± 50 ms


class LatentClient:
    """A ToolClient that delays each call by a seeded uniform latency, then asks the real pool."""

    def __init__(self, pool: Any, low_s: float, high_s: float, seed: int = 0) -> None:
        import random

        self.pool, self.low_s, self.high_s = pool, low_s, high_s
        self.rng = random.Random(seed)

    async def call_tool(self, server: str, tool: str, arguments: dict[str, Any] | None = None) -> Any:
        await asyncio.sleep(self.rng.uniform(self.low_s, self.high_s))
        return await self.pool.call_tool(server, tool, arguments)

    async def list_tools(self) -> dict[str, list[dict[str, Any]]]:
        return await self.pool.list_tools()


class ExpertEngine:
    """A RolloutEngine stand-in: turn k of a task's episode gets the task's k-th expert action."""

    def __init__(self, tokenizer: Any, rows: list[dict[str, Any]], gen_s: float) -> None:
        self.tok, self.gen_s = tokenizer, gen_s
        from envs.parsing import expert_turns

        self.scripts = [(row["prompt"][-1]["content"], expert_turns(row)) for row in rows]

    async def generate(self, prompt_token_ids: list[int], sampling: Any) -> Any:
        from actors.engine_api import Generation

        text = self.tok.decode(prompt_token_ids, skip_special_tokens=False)
        turn = text.count("<|im_start|>assistant") - 1
        script = next(actions for user, actions in self.scripts if user in text)
        await asyncio.sleep(self.gen_s)
        ids = self.tok.encode(script[min(turn, len(script) - 1)], add_special_tokens=False)[: sampling.max_new_tokens]
        return Generation(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop", version=0)

    def version(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {}


def _rule_rows(n: int) -> list[dict[str, Any]]:
    import subprocess
    import sys
    import tempfile

    from tasks.io import read_rows

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rule.jsonl"
        cmd = [sys.executable, "-m", "jobs.generate_tasks", "--method", "rule", "--n", str(n), "--seed", "0"]
        subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True, timeout=600)
        return read_rows(out)


async def bench_rollout(cfg: Config, rows: list[dict[str, Any]], cap: int | None) -> dict[str, dict[str, float]]:
    from actors.episode_runner import EpisodeRunner
    from actors.models import load_tokenizer
    from envs.tool_client import set_tool_client
    from serve_apps.tool_pool import LocalToolPool

    tokenizer = load_tokenizer(cfg.model)
    pool = await LocalToolPool.create(cfg.tools)
    out: dict[str, dict[str, float]] = {}
    try:
        warm = EpisodeRunner(cfg, [ExpertEngine(tokenizer, rows, 0.0)], tokenizer, progress=False)
        set_tool_client(pool)
        await warm.run(rows, 1)  # first calls of each tool and template warm caches: not either mode's cost
        for mode in ("async", "lockstep"):
            set_tool_client(LatentClient(pool, *ROLLOUT_TOOL_S))  # same seed: same latencies per mode
            run_cfg = cfg.model_copy(
                update={"rollout": cfg.rollout.model_copy(update={"mode": mode, "max_total_tokens": 32768})}
            )
            engine = ExpertEngine(tokenizer, rows, ROLLOUT_GEN_S)
            runner = EpisodeRunner(run_cfg, [engine], tokenizer, max_concurrent_episodes=cap, progress=False)
            t = time.perf_counter()
            trajs = await runner.run(rows, ROLLOUT_GROUP)
            wall = time.perf_counter() - t
            bad = [tr for tr in trajs if tr.infra_fault or tr.finish_reason != "done"]
            if bad:
                raise RuntimeError(
                    f"rollout benchmark: {len(bad)} episodes did not finish cleanly: {bad[0].finish_reason}"
                )
            out[mode] = {
                "episodes": len(trajs),
                "wall_s": wall,
                "episodes_per_s": len(trajs) / wall,
                "turns_mean": statistics.fmean(tr.turns for tr in trajs),
            }
    finally:
        set_tool_client(None)
        await pool.close()
    return out


def suite_rollout(cfg: Config, calls: int, console: Console) -> dict[str, Any]:
    with console.status(f"rollout: generating {ROLLOUT_TASKS} rule tasks"):
        rows = _rule_rows(ROLLOUT_TASKS)
    report: dict[str, Any] = {
        "engine": f"scripted expert calls, {ROLLOUT_GEN_S * 1e3:.0f} ms per generation",
        "tool_latency_ms": [x * 1e3 for x in ROLLOUT_TOOL_S],
        "tasks": len(rows),
        "group_size": ROLLOUT_GROUP,
        "runs": {},
    }
    for label, cap in (("all at once", None), ("16 in flight", 16)):
        with console.status(f"rollout: async vs lockstep, {label}"):
            r = asyncio.run(bench_rollout(cfg, rows, cap))
        r["ratio"] = {"async_over_lockstep": r["async"]["episodes_per_s"] / r["lockstep"]["episodes_per_s"]}
        report["runs"][label] = r
    return report


def print_rollout(report: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"EpisodeRunner, {report['tasks']} tasks x {report['group_size']}, tool latency "
        f"{report['tool_latency_ms'][0]:.0f}-{report['tool_latency_ms'][1]:.0f} ms, {report['engine']}"
    )
    for col in ("episodes in flight", "async eps/s", "lockstep eps/s", "async / lockstep"):
        table.add_column(col, justify="right" if "flight" not in col else "left")
    for label, r in report["runs"].items():
        table.add_row(
            label,
            f"{r['async']['episodes_per_s']:.2f}",
            f"{r['lockstep']['episodes_per_s']:.2f}",
            f"{r['ratio']['async_over_lockstep']:.2f}x",
        )
    console.print(table)
    console.print("goal: async >= 1.5x lockstep")


SUITES = {
    "tools": (suite_tools, print_tools),
    "env": (suite_env, print_env),
    "rollout": (suite_rollout, print_rollout),
}


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
