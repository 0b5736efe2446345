"""Suite `env`: MCPToolEnv's own cost per step. `astep` on a typical one-call Hermes turn against an
instant in-process tool (a client that returns a canned result at once) vs that tool called alone; the
difference is the env's overhead per step (parsing, reward, observation, metadata). Each repeat is the
best of 5 passes of many steps.

    python -m bench --suite env [--repeats 3] [--set env.calls=300]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from rich.console import Console

from bench.doubles import InstantClient
from bench.options import BenchOptions
from bench.results import Row, SuiteResult, spread

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


async def bench_env_steps(n: int, repeats: int = 5) -> dict[str, float]:
    """Best-of-`repeats` seconds per step for n steps of: the tool alone, and the env's astep."""
    from envs.mcp_tool_env import MCPToolEnv

    client = InstantClient()
    env = MCPToolEnv(None, ENV_ROW, tool_client=client)
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
    return {"tool_s": min(tool_s), "env_s": min(env_s)}


def run(opts: BenchOptions, console: Console) -> SuiteResult:
    n = 200 if opts.quick else max(2000, opts.env.calls * 10)  # micro-timings: many steps, best of 5
    passes = []
    for i in range(opts.repeats):
        with console.status(f"env: {n} steps x 5 ({i + 1}/{opts.repeats})"):
            passes.append(asyncio.run(bench_env_steps(n)))
    tool_ms = [p["tool_s"] * 1e3 for p in passes]
    env_ms = [p["env_s"] * 1e3 for p in passes]
    overhead_ms = [e - t for e, t in zip(env_ms, tool_ms, strict=True)]
    report: dict[str, Any] = {"steps": n, "action": ENV_ACTION, "tool_alone_ms": tool_ms, "env_astep_ms": env_ms}
    console.print(
        f"MCPToolEnv step, one Hermes call, instant tool: tool alone {statistics.median(tool_ms):.4f} ms, "
        f"env astep {statistics.median(env_ms):.4f} ms, overhead {statistics.median(overhead_ms):.4f} ms "
        "(goal: < 0.2 ms)"
    )
    rows = [
        Row("env overhead per step (astep − tool alone)", "ms", spread(overhead_ms), better="lower", goal="< 0.2 ms"),
        Row("env astep", "ms", spread(env_ms), spread(tool_ms), "the tool called alone", "lower"),
    ]
    return SuiteResult("env", report, rows)
