"""Benchmarks, measured side by side in one run and reported as ratios.

    python -m jobs.benchmark --suite tools [--calls 300] [--out bench_results/tools.json]
    python -m jobs.benchmark --suite env [--calls 300]
    python -m jobs.benchmark --suite rollout [--calls 300]
    python -m jobs.benchmark --suite train      (sizes: python -m jobs.bench_train --help)
    python -m jobs.benchmark --suite job        (ray job submit vs local: python -m jobs.bench_job --help)
    python -m jobs.benchmark --suite prompt --config configs/demo-cpu.yaml

Suite `tools`: one cheap tool (polygon.previous_close, offline) called through three doors —
the in-process FastMCP client, a Serve handle, and MCP over HTTP through Serve's proxy — and a
CPU-bound python-tool program on 1 vs 2 replicas. Numbers depend on the machine and its load:
compare the columns of one run, not runs of different days.

Suite `env`: MCPToolEnv's own cost per step. `astep` on a typical one-call Hermes turn against an
instant in-process tool (a client that returns a canned result at once) vs that tool called alone;
the difference is the env's overhead per step (parsing, reward, observation, metadata).

Suite `prompt`: first-prompt tokens of the config's tasks with its model's tokenizer, the system tool
block as JSON lines vs compact signatures (`env.tool_format`). The tasks are made in-process by the
rule generator from the config's `generation` section (its servers offline), no Ray; each task is shown
the tools of the servers it uses, as an episode is (`envs.prompting.count_prompt_tokens`).

Suite `rollout`, side by side in one run (prints the machine too):
- engines: HF vs vLLM tokens/s on SmolLM2-135M-Instruct, the same 32 chat prompts x 64 new tokens,
  greedy, all requests at once; then LoRA adapter swap latency (`load_adapter` of an r=16 q,k,v,o
  adapter, 5 swaps, median). Both engines run in this process (vLLM spawns its engine core: hence
  the `__main__` guard), one after the other.
- push modes (vLLM only): `rollout.weight_push` adapter vs merged for a LoRA run: a real learner's
  adapter, or its merged weights, pushed to an engine started for that mode (export s, engine load s),
  then a demo-like step: 12 prompts x 4 samples sharing a ~700-token prefix, 64 new tokens, temperature 1
  (generated tokens/s, prefix-cache hit rate).
- async vs lockstep: EpisodeRunner episodes per second, same tasks (16 rule templates x group 4),
  every tool call delayed by 100 ms ± 50 ms (uniform, seeded) on top of the in-process pool; all
  episodes at once and at most 16 in flight. Two engines: a scripted stand-in that answers each turn
  with the task's expert call after a fixed 20 ms (a model would make calls that mostly never reach
  a tool, hiding the tool latency this is about), and the real HF engine on tiny-random doing a real
  generation of 16-96 tokens (seeded by the prompt) on the real conversation before answering with
  the expert call: real, variable generation cost and batching, the same episodes. "ideal" is the
  ratio an overhead-free runner with an unlimited engine would get on the same episodes (simulated
  from the order statistics of the latencies): lockstep waits for the slowest episode of each turn,
  and with uniform 50-150 ms latencies and equal turn counts that caps async/lockstep below
  (gen + 150) / (gen + 100) ms.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.doubles import InstantClient, LatentClient, RealCostExpertEngine, expert_engine, rule_rows
from bench.results import machine
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
    py.replica_resources.num_cpus = 0.5
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


# --------------------------------------------------------------------------- prompt suite

TOOL_FORMATS = ("json", "compact")


async def prompt_tasks(cfg: Config) -> tuple[list[Any], dict[str, list[dict[str, Any]]]]:
    """The config's rule tasks (as TaskRows) and the tool listing of its servers, all offline."""
    from jobs.generate_tasks import offline_tools
    from serve_apps.tool_pool import LocalToolPool
    from tasks.generators import get_generator
    from tasks.generators.options import GenerateOptions
    from tasks.schema import TaskRow

    pool = await LocalToolPool.create(offline_tools(cfg.tools))
    try:
        listing = await pool.list_tools()
        rows = await get_generator("rule")(cfg, GenerateOptions.from_config(cfg, splits={}), pool)
    finally:
        await pool.close()
    return [TaskRow.model_validate(r) for r in rows], listing


def suite_prompt(cfg: Config, calls: int, console: Console) -> dict[str, Any]:
    from actors.models import load_tokenizer
    from envs.prompting import count_prompt_tokens, tool_prompt_for

    with console.status(f"prompt: {cfg.generation.n_samples} rule tasks, {cfg.model.name}'s tokenizer"):
        rows, listing = asyncio.run(prompt_tasks(cfg))
        tokenizer = load_tokenizer(cfg.model)
        tokens = {
            fmt: [count_prompt_tokens(tokenizer, row, listing, cfg.env.final_answer, fmt) for row in rows]
            for fmt in TOOL_FORMATS
        }
    report: dict[str, Any] = {"model": cfg.model.name, "tasks": len(rows), "tool_prompt": tool_prompt_for(tokenizer)}
    for fmt, n in tokens.items():
        report[fmt] = {"mean": statistics.mean(n), "max": max(n), "min": min(n)} if n else {}
    if rows:
        report["compact_vs_json_mean"] = report["compact"]["mean"] / report["json"]["mean"]
    return report


def print_prompt(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"first-prompt tokens, {report['tasks']} rule tasks, {report['model']}'s tokenizer")
    for col in ("env.tool_format", "mean", "max", "min"):
        table.add_column(col, justify="right" if col != "env.tool_format" else "left")
    for fmt in TOOL_FORMATS:
        if report[fmt]:
            r = report[fmt]
            table.add_row(fmt, f"{r['mean']:.1f}", str(r["max"]), str(r["min"]))
    console.print(table)
    if report["tool_prompt"] == "template":
        console.print("this model's chat template renders tools=: tool_format does not apply to its prompts")
    elif "compact_vs_json_mean" in report:
        console.print(f"compact / json, mean: {report['compact_vs_json_mean']:.2f}")


# --------------------------------------------------------------------------- rollout suite

ROLLOUT_TASKS = 16
ROLLOUT_GROUP = 4
ROLLOUT_GEN_S = 0.02  # the stand-in engine's time per generation
ROLLOUT_TOOL_S = (0.05, 0.15)  # 100 ms ± 50 ms
ROLLOUT_REAL_TOKENS = (16, 96)  # real-engine run: new tokens per turn, uniform (seeded by the prompt)
# Real-engine run: the first 8 rule tasks (2-3 turns), whose conversations mostly fit tiny-random's
# 2048 positions; the HF engine re-reads the whole conversation every turn (no prefix cache).
ROLLOUT_REAL_TASKS = 8
ENGINE_MODEL = "smollm2-135m-instruct"
ENGINE_PROMPTS = 32
ENGINE_NEW_TOKENS = 64
ADAPTER_SWAPS = 5
PUSH_PROMPTS, PUSH_SAMPLES, PUSH_PREFIX_TOKENS, PUSH_NEW_TOKENS = 12, 4, 700, 64  # like a demo step
ENGINE_TOPICS = (
    "the water cycle", "how a bicycle works", "the history of the printing press", "why the sky is blue",
    "photosynthesis", "how vaccines work", "the rules of chess", "volcanoes", "black holes", "the stock market",
    "how airplanes fly", "the Roman Empire", "machine learning", "ocean tides", "the human heart", "electricity",
)  # fmt: skip


def rollout_config(cfg: Config, **rollout: Any) -> Config:
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=rollout)})


async def bench_modes(
    cfg: Config, rows: list[dict[str, Any]], cap: int | None, make_engine: Callable[[Any], Any], budget: int
) -> dict[str, Any]:
    """async vs lockstep over the same tasks, same engine kind, same seeded tool latencies."""
    from actors.episode_runner import EpisodeRunner
    from actors.models import load_tokenizer
    from serve_apps.tool_pool import LocalToolPool

    tokenizer = load_tokenizer(cfg.model)
    pool = await LocalToolPool.create(cfg.tools)
    out: dict[str, Any] = {}
    try:
        warm = EpisodeRunner(cfg, [expert_engine(tokenizer, rows, 0.0)], tokenizer, progress=False, tool_client=pool)
        await warm.run(rows, 1)  # first calls of each tool and template warm caches: not either mode's cost
        for mode in ("async", "lockstep"):
            client = LatentClient(pool, *ROLLOUT_TOOL_S)  # same seed: same latencies per mode
            run_cfg = rollout_config(cfg, mode=mode, max_total_tokens=budget)
            engine = make_engine(tokenizer)
            runner = EpisodeRunner(
                run_cfg, [engine], tokenizer, max_concurrent_episodes=cap, progress=False, tool_client=client
            )
            t = time.perf_counter()
            trajs = await runner.run(rows, ROLLOUT_GROUP)
            wall = time.perf_counter() - t
            bad = [tr for tr in trajs if tr.infra_fault or tr.finish_reason not in ("done", "token_budget")]
            if bad:
                raise RuntimeError(f"rollout benchmark: {len(bad)} episodes failed: {bad[0].finish_reason}")
            inner = getattr(engine, "engine", None)
            out[mode] = {
                "episodes": len(trajs),
                "wall_s": wall,
                "episodes_per_s": len(trajs) / wall,
                "turns_mean": statistics.fmean(tr.turns for tr in trajs),
                "token_budget_ends": sum(tr.finish_reason == "token_budget" for tr in trajs),
                "lockstep_wait_s_mean": statistics.fmean(tr.timings["wait_s"] for tr in trajs),
                "real_tokens": getattr(engine, "real_tokens", 0),
                "mean_batch": inner.stats().get("mean_batch_size", 0.0) if inner is not None else 0.0,
                # per episode, per turn: tool calls (each one waits a latency draw)
                "calls": [[len(m.get("calls") or []) for m in tr.env_metadata] for tr in trajs],
            }
    finally:
        await pool.close()
    return out


def predicted_ratio(calls: list[list[int]], cap: int | None, gen_s: float, runs: int = 300) -> float:
    """async/lockstep episodes-per-second ratio of an ideal runner (no overheads, unlimited engine) with
    these episodes: async = slots of `cap` episodes, each freed as soon as its episode ends; lockstep =
    waves of `cap`, each turn as long as its slowest live episode (generation + its calls' latencies)."""
    import heapq
    import random

    rng = random.Random(1)
    lo, hi = ROLLOUT_TOOL_S
    size = cap or len(calls)
    total_async = total_lock = 0.0
    for _ in range(runs):
        turns = [[gen_s + sum(rng.uniform(lo, hi) for _ in range(c)) for c in ep] for ep in calls]
        slots = [0.0] * size
        for ep in turns:
            heapq.heappush(slots, heapq.heappop(slots) + sum(ep))
        total_async += max(slots)
        for start in range(0, len(turns), size):
            wave = turns[start : start + size]
            total_lock += sum(max(ep[k] for ep in wave if k < len(ep)) for k in range(max(map(len, wave))))
    return total_lock / total_async


async def bench_engines(console: Console) -> dict[str, Any]:
    """HF vs vLLM on SmolLM2-135M: tokens/s on the same prompts, and LoRA adapter swap latency."""
    from actors.engines import vllm_available
    from actors.models import load_tokenizer
    from cluster.rollout_group import cpu_list, node_cores
    from configs.schema import SamplingConfig

    cfg = Config.model_validate(
        {
            "model": {"name": ENGINE_MODEL},
            "finetune": {"mode": "lora", "lora": {"r": 16}},
            "rollout": {
                "max_model_len": 1024,
                "hf_max_batch_size": ENGINE_PROMPTS,
                "vllm_kv_cache_gb": 1,
                "weight_push": "adapter",  # adapter swaps are measured here; merged pushes in bench_push_modes
            },
        }
    )
    tokenizer = load_tokenizer(cfg.model)
    prompts = []
    for i in range(ENGINE_PROMPTS):
        topic = ENGINE_TOPICS[i % len(ENGINE_TOPICS)]
        ask = "Explain in detail" if i < len(ENGINE_TOPICS) else "Write a long essay about"
        msgs = [{"role": "user", "content": f"{ask} {topic}."}]
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        prompts.append([int(t) for t in (out if isinstance(out, list) else out["input_ids"])])
    sampling = SamplingConfig(temperature=0, max_new_tokens=ENGINE_NEW_TOKENS, stop=[])
    adapters = [_smollm2_adapter(cfg, seed) for seed in range(ADAPTER_SWAPS)]
    report: dict[str, Any] = {"model": ENGINE_MODEL, "prompts": len(prompts), "new_tokens": ENGINE_NEW_TOKENS}
    backends = ["hf", "vllm"] if vllm_available() else ["hf"]
    for backend in backends:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(node_cores())  # one engine: every core
        engine_cfg = rollout_config(cfg, backend=backend)
        from actors.engines import make_engine

        engine = make_engine(engine_cfg)
        with console.status(f"engines: starting {backend}"):
            t = time.perf_counter()
            await engine.start()
            start_s = time.perf_counter() - t
        try:
            await engine.generate(prompts[0], sampling.model_copy(update={"max_new_tokens": 4}))  # warm-up
            with console.status(f"engines: {backend}, {len(prompts)} prompts x {ENGINE_NEW_TOKENS} tokens"):
                t = time.perf_counter()
                gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
                wall = time.perf_counter() - t
            swaps = []
            with console.status(f"engines: {backend}, {ADAPTER_SWAPS} adapter swaps"):
                for version, adapter in enumerate(adapters, start=1):
                    t = time.perf_counter()
                    await engine.load_adapter(version, adapter)
                    swaps.append(time.perf_counter() - t)
                lora_gen = await engine.generate(prompts[0], sampling)  # the adapter serves
        finally:
            await engine.shutdown()
        tokens = sum(len(g.token_ids) for g in gens)
        report[backend] = {
            "start_s": start_s,
            "tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "swap_ms": [s * 1e3 for s in swaps],
            "swap_median_ms": statistics.median(swaps) * 1e3,
            "lora_output_differs": lora_gen.token_ids != gens[0].token_ids,
        }
    if "vllm" in report:
        report["vllm_over_hf"] = report["vllm"]["tokens_per_s"] / report["hf"]["tokens_per_s"]
    return report


def _shared_prefix_prompts(tokenizer: Any, prefix_tokens: int, n: int) -> list[list[int]]:
    """`n` chat prompts that share a system message of about `prefix_tokens` tokens (like a run's tool
    list) and differ in the user's question, as token ids."""
    lines = ["You are a helpful assistant that answers by calling one of these tools."]
    k = 0
    while len(tokenizer.encode("\n".join(lines))) < prefix_tokens:
        topic = ENGINE_TOPICS[k % len(ENGINE_TOPICS)]
        lines.append(
            f"- tool_{k}(query: str, limit: int = 10): looks up facts about {topic} and returns them as a list "
            f"of records, newest first; fails with an error message when the query is empty."
        )
        k += 1
    prompts = []
    for i in range(n):
        msgs = [
            {"role": "system", "content": "\n".join(lines)},
            {
                "role": "user",
                "content": f"Question {i}: tell me the latest about {ENGINE_TOPICS[i % len(ENGINE_TOPICS)]}.",
            },
        ]
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        prompts.append([int(t) for t in (out if isinstance(out, list) else out["input_ids"])])
    return prompts


async def bench_push_modes(console: Console) -> dict[str, Any]:
    """vLLM, LoRA run: `rollout.weight_push` adapter vs merged on SmolLM2-135M. A real learner (r=16 on
    q,k,v,o, B non-zero) exports the adapter or the merged weights; an engine started for that mode loads
    them (push latency: export, and the engine's load) and plays a step like the demo's: PUSH_PROMPTS
    prompts x PUSH_SAMPLES samples sharing a ~PUSH_PREFIX_TOKENS-token prefix, PUSH_NEW_TOKENS new tokens
    at most (tokens/s counts the tokens generated: a sample may stop at EOS), temperature 1."""
    import torch

    from actors.engines import make_engine
    from actors.learner import Learner
    from actors.models import load_tokenizer
    from cluster.rollout_group import cpu_list, node_cores
    from configs.schema import SamplingConfig

    cfg = Config.model_validate(
        {
            "model": {"name": ENGINE_MODEL, "dtype": "bfloat16"},
            "finetune": {"mode": "lora", "lora": {"r": 16, "alpha": 32}},
            "learner": {"dtype": "bfloat16"},
            "rollout": {"backend": "vllm", "max_model_len": 2048, "vllm_kv_cache_gb": 1},
        }
    )
    learner = Learner(cfg)
    learner.setup()
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    prompts = _shared_prefix_prompts(load_tokenizer(cfg.model), PUSH_PREFIX_TOKENS, PUSH_PROMPTS)
    batch = [p for p in prompts for _ in range(PUSH_SAMPLES)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=PUSH_NEW_TOKENS, stop=[])
    report: dict[str, Any] = {
        "model": ENGINE_MODEL,
        "requests": len(batch),
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "new_tokens": PUSH_NEW_TOKENS,
    }
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(node_cores())  # one engine: every core
    for mode in ("adapter", "merged"):
        t = time.perf_counter()
        payload = learner.export_adapter() if mode == "adapter" else learner.export_weights()
        export_s = time.perf_counter() - t
        engine = make_engine(rollout_config(cfg, weight_push=mode))
        with console.status(f"push modes: starting vLLM ({mode})"):
            await engine.start()
        try:
            t = time.perf_counter()
            if mode == "adapter":
                await engine.load_adapter(1, payload)
            else:
                await engine.update_weights(1, payload)
            load_s = time.perf_counter() - t
            await engine.generate(batch[0], sampling.model_copy(update={"max_new_tokens": 4}))  # warm-up
            before = dict(engine.stats())
            with console.status(f"push modes: {mode}, {len(batch)} requests x {PUSH_NEW_TOKENS} tokens"):
                t = time.perf_counter()
                gens = await asyncio.gather(*(engine.generate(p, sampling) for p in batch))
                wall = time.perf_counter() - t
            after = engine.stats()
        finally:
            await engine.shutdown()
        tokens = sum(len(g.token_ids) for g in gens)
        queries = after.get("prefix_cache_queries", 0) - before.get("prefix_cache_queries", 0)
        hits = after.get("prefix_cache_hits", 0) - before.get("prefix_cache_hits", 0)
        report[mode] = {
            "export_s": export_s,
            "load_s": load_s,
            "tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "version": gens[0].version,
        }
    report["merged_over_adapter"] = report["merged"]["tokens_per_s"] / report["adapter"]["tokens_per_s"]
    return report


def _smollm2_adapter(cfg: Config, seed: int) -> dict[str, Any]:
    """A PEFT LoRA (r=16 on q,k,v,o) for SmolLM2 with non-zero B: {"config", "state_dict"}."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from actors.models import load_causal_lm

    torch.manual_seed(seed)
    lora = cfg.finetune.lora
    model = get_peft_model(
        load_causal_lm(cfg.model),
        LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules, init_lora_weights=False),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    return {"config": model.peft_config["default"].to_dict(), "state_dict": get_peft_model_state_dict(model)}


def suite_rollout(cfg: Config, calls: int, console: Console) -> dict[str, Any]:
    from actors.hf_engine import HFEngine

    with console.status(f"rollout: generating {ROLLOUT_TASKS} rule tasks"):
        rows = rule_rows(ROLLOUT_TASKS)
    report: dict[str, Any] = {
        "machine": machine(),
        "tool_latency_ms": [x * 1e3 for x in ROLLOUT_TOOL_S],
        "tasks": len(rows),
        "group_size": ROLLOUT_GROUP,
        "modes": {},
    }
    t0 = time.perf_counter()
    report["engines"] = asyncio.run(bench_engines(console))
    from actors.engines import vllm_available

    if vllm_available():
        report["push_modes"] = asyncio.run(bench_push_modes(console))

    # async vs lockstep: (1) scripted engine, fixed generation time: the tool latency alone;
    # (2) the real HF engine (tiny-random: prefill of multi-thousand-token conversations every turn
    # is affordable) for variable-length generations, batching included, same scripted episodes.
    tiny = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": "tiny-random"})})
    real_cfg = rollout_config(tiny, backend="hf", max_model_len=2048)  # tiny-random's context
    real_rows = rows[:ROLLOUT_REAL_TASKS]

    async def real_modes(cap: int | None) -> dict[str, Any]:
        engine = HFEngine(real_cfg)
        await engine.start()
        try:
            return await bench_modes(
                real_cfg,
                real_rows,
                cap,
                lambda tok: RealCostExpertEngine(_Fresh(engine), tok, real_rows, ROLLOUT_REAL_TOKENS),
                budget=real_cfg.rollout.max_model_len,
            )
        finally:
            await engine.shutdown()

    settings = {
        "scripted": (
            f"scripted, {ROLLOUT_GEN_S * 1e3:.0f} ms/generation",
            lambda cap: bench_modes(cfg, rows, cap, lambda tok: expert_engine(tok, rows, ROLLOUT_GEN_S), 32768),
        ),
        "hf-tiny": (
            f"HF tiny-random, {ROLLOUT_REAL_TASKS} tasks, "
            f"{ROLLOUT_REAL_TOKENS[0]}-{ROLLOUT_REAL_TOKENS[1]} tokens/turn",
            real_modes,
        ),
    }
    for key, (label, bench) in settings.items():
        # The real engine re-reads whole conversations each turn (no prefix cache): one setting only.
        for flight, cap in (("all at once", None), ("16 in flight", 16))[1 if key == "hf-tiny" else 0 :]:
            with console.status(f"rollout: async vs lockstep, {label}, {flight}"):
                r = asyncio.run(bench(cap))
            r["label"], r["in_flight"] = label, flight
            r["ratio"] = r["async"]["episodes_per_s"] / r["lockstep"]["episodes_per_s"]
            if key == "scripted":
                r["ideal_ratio"] = predicted_ratio(r["async"]["calls"], cap, ROLLOUT_GEN_S)
            for mode in ("async", "lockstep"):
                r[mode].pop("calls")
            report["modes"][f"{key}, {flight}"] = r
    report["wall_s"] = time.perf_counter() - t0
    return report


class _Fresh:
    """The shared engine under a fresh name per mode, so each mode's stats (mean batch) are its own."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._base = dict(engine.stats())

    async def generate(self, prompt_token_ids: list[int], sampling: Any) -> Any:
        return await self._engine.generate(prompt_token_ids, sampling)

    def stats(self) -> dict[str, Any]:
        now = self._engine.stats()
        batches = now.get("batches", 0) - self._base.get("batches", 0)
        requests = now.get("requests", 0) - self._base.get("requests", 0)
        return {"mean_batch_size": requests / batches if batches else 0.0}


def print_rollout(report: dict[str, Any], console: Console) -> None:
    m = report["machine"]
    console.print(f"machine: {m['cores']} cores, {m['cpu']}, {m['memory_gib']} GiB, Python {m['python']}")
    e = report["engines"]
    table = Table(title=f"engines on {e['model']}: {e['prompts']} prompts x {e['new_tokens']} new tokens, greedy")
    for col in ("backend", "start s", "tokens", "wall s", "tokens/s", "LoRA swap median ms", "swaps ms"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for backend in ("hf", "vllm"):
        if backend in e:
            r = e[backend]
            table.add_row(
                backend, f"{r['start_s']:.1f}", str(r["tokens"]), f"{r['wall_s']:.2f}", f"{r['tokens_per_s']:.0f}",
                f"{r['swap_median_ms']:.1f}", " ".join(f"{s:.0f}" for s in r["swap_ms"]),
            )  # fmt: skip
    console.print(table)
    if "vllm_over_hf" in e:
        console.print(f"vLLM / HF tokens/s: {e['vllm_over_hf']:.2f}x")
    if "push_modes" in report:
        pm = report["push_modes"]
        table = Table(
            title=f"vLLM, rollout.weight_push: {pm['requests']} requests of {pm['prompt_tokens'][0]}-"
            f"{pm['prompt_tokens'][1]} tokens (shared prefix) x {pm['new_tokens']} new tokens, temperature 1"
        )
        for col in ("push", "export s", "engine load s", "tokens", "wall s", "tokens/s", "prefix cache hits"):
            table.add_column(col, justify="left" if col == "push" else "right")
        for mode in ("adapter", "merged"):
            r = pm[mode]
            table.add_row(
                mode, f"{r['export_s']:.2f}", f"{r['load_s']:.2f}", str(r["tokens"]), f"{r['wall_s']:.2f}",
                f"{r['tokens_per_s']:.0f}", f"{r['prefix_cache_hit_rate']:.0%}",
            )  # fmt: skip
        console.print(table)
        console.print(f"merged / adapter tokens/s: {pm['merged_over_adapter']:.2f}x")
    table = Table(
        title=f"EpisodeRunner, {report['tasks']} tasks x {report['group_size']}, tool latency "
        f"{report['tool_latency_ms'][0]:.0f}-{report['tool_latency_ms'][1]:.0f} ms"
    )
    for col in ("engine", "in flight", "async eps/s", "lockstep eps/s", "async / lockstep", "ideal", "mean batch a/l"):
        table.add_column(col, justify="left" if col in ("engine", "in flight") else "right")
    for r in report["modes"].values():
        ideal = f"{r['ideal_ratio']:.2f}x" if "ideal_ratio" in r else "-"
        batch = (
            f"{r['async']['mean_batch']:.1f} / {r['lockstep']['mean_batch']:.1f}" if r["async"]["mean_batch"] else "-"
        )
        table.add_row(
            r["label"], r["in_flight"], f"{r['async']['episodes_per_s']:.2f}", f"{r['lockstep']['episodes_per_s']:.2f}",
            f"{r['ratio']:.2f}x", ideal, batch,
        )  # fmt: skip
    console.print(table)
    console.print(
        "goal: async >= 1.5x lockstep. ideal = the same episodes on a runner with no overheads and an unlimited "
        "engine (order statistics of the latencies); it bounds what the scripted runs can reach."
    )
    console.print(f"suite wall time: {report['wall_s']:.0f} s")


def suite_train(cfg: Config, calls: int, console: Console) -> dict[str, Any]:
    """The learner and the weight push, with their own sizes (`python -m jobs.bench_train --help`); prints itself."""
    from jobs.bench_train import run_train_suite

    return run_train_suite(None)


def suite_job(cfg: Config, calls: int, console: Console) -> dict[str, Any]:
    """A submitted ci-tiny run against the same run started locally (`python -m jobs.bench_job --help`)."""
    from jobs.bench_job import run_job_suite

    return run_job_suite(None)


SUITES = {
    "tools": (suite_tools, print_tools),
    "env": (suite_env, print_env),
    "rollout": (suite_rollout, print_rollout),
    "train": (suite_train, lambda report, console: None),
    "job": (suite_job, lambda report, console: None),
    "prompt": (suite_prompt, print_prompt),
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
