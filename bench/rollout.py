"""Suite `rollout`, side by side in one run:

- engines: HF vs vLLM tokens/s on SmolLM2-135M-Instruct, the same 32 chat prompts x 64 new tokens, greedy,
  all requests at once (the batch `--repeats` times on one started engine); then LoRA adapter swap latency
  (`load_adapter` of an r=16 q,k,v,o adapter, 5 swaps, median). Both engines run in this process (vLLM
  spawns its engine core), one after the other.
- push modes (vLLM only): `rollout.weight_push` adapter vs merged for a LoRA run: a real learner's adapter,
  or its merged weights, pushed to an engine started for that mode (export s, engine load s), then a
  demo-like step: 12 prompts x 4 samples sharing a ~700-token prefix, 64 new tokens, temperature 1
  (generated tokens/s, prefix-cache hit rate).
- async vs lockstep: EpisodeRunner episodes per second, same tasks (16 rule templates x group 4), every
  tool call delayed by 100 ms ± 50 ms (uniform, seeded) on top of the in-process pool; all episodes at
  once and at most 16 in flight; `--repeats` times, the modes alternating. Two engines: a scripted
  stand-in that answers each turn with the task's expert call after a fixed 20 ms (a model would make
  calls that mostly never reach a tool, hiding the tool latency this is about), and the real HF engine on
  tiny-random doing a real generation of 16-96 tokens (seeded by the prompt) on the real conversation
  before answering with the expert call. "ideal" is the ratio an overhead-free runner with an unlimited
  engine would get on the same episodes (simulated from the order statistics of the latencies):
  lockstep waits for the slowest episode of each turn, and with uniform 50-150 ms latencies and equal
  turn counts that caps async/lockstep below (gen + 150) / (gen + 100) ms.

    python -m bench --suite rollout [--repeats 3] [--set rollout.vllm=off]

`--quick`: tiny-random everywhere, a handful of prompts and tasks, HF only.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.doubles import LatentClient, RealCostExpertEngine, expert_engine, rule_rows
from bench.options import BenchOptions
from bench.results import Row, SuiteResult, machine, machine_line, spread
from configs.schema import Config

ROLLOUT_GEN_S = 0.02  # the stand-in engine's time per generation
ROLLOUT_TOOL_S = (0.05, 0.15)  # 100 ms ± 50 ms
ROLLOUT_REAL_TOKENS = (16, 96)  # real-engine run: new tokens per turn, uniform (seeded by the prompt)


@dataclass(frozen=True)
class Sizes:
    tasks: int = 16
    group: int = 4
    # Real-engine run: the first 8 rule tasks (2-3 turns), whose conversations mostly fit tiny-random's
    # 2048 positions; the HF engine re-reads the whole conversation every turn (no prefix cache).
    real_tasks: int = 8
    engine_model: str = "smollm2-135m-instruct"
    engine_prompts: int = 32
    engine_new_tokens: int = 64
    swaps: int = 5
    # like a demo step: 12 prompts x 4 samples sharing a ~700-token prefix, 64 new tokens
    push_prompts: int = 12
    push_samples: int = 4
    push_prefix_tokens: int = 700
    push_new_tokens: int = 64


QUICK = Sizes(
    tasks=4, group=2, real_tasks=2, engine_model="tiny-random", engine_prompts=4, engine_new_tokens=8, swaps=2,
    push_prompts=2, push_samples=2, push_prefix_tokens=100, push_new_tokens=8,
)  # fmt: skip
ROLLOUT_GROUP = Sizes().group


ENGINE_TOPICS = (
    "the water cycle", "how a bicycle works", "the history of the printing press", "why the sky is blue",
    "photosynthesis", "how vaccines work", "the rules of chess", "volcanoes", "black holes", "the stock market",
    "how airplanes fly", "the Roman Empire", "machine learning", "ocean tides", "the human heart", "electricity",
)  # fmt: skip


def rollout_config(cfg: Config, **rollout: Any) -> Config:
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=rollout)})


async def bench_modes(
    cfg: Config,
    rows: list[dict[str, Any]],
    cap: int | None,
    make_engine: Callable[[Any], Any],
    budget: int,
    group: int = ROLLOUT_GROUP,
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
            trajs = await runner.run(rows, group)
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


async def bench_engines(console: Console, sizes: Sizes, repeats: int, backends: list[str]) -> dict[str, Any]:
    """HF vs vLLM: tokens/s on the same prompts (the batch `repeats` times), and LoRA adapter swap latency."""
    from actors.models import load_tokenizer
    from configs.schema import SamplingConfig

    cfg = Config.model_validate(
        {
            "model": {"name": sizes.engine_model},
            "finetune": {"mode": "lora", "lora": {"r": 16}},
            "rollout": {
                "max_model_len": 1024,
                "hf_max_batch_size": sizes.engine_prompts,
                "vllm_kv_cache_gb": 1,
                "weight_push": "adapter",  # adapter swaps are measured here; merged pushes in bench_push_modes
            },
        }
    )
    tokenizer = load_tokenizer(cfg.model)
    prompts = []
    for i in range(sizes.engine_prompts):
        topic = ENGINE_TOPICS[i % len(ENGINE_TOPICS)]
        ask = "Explain in detail" if i < len(ENGINE_TOPICS) else "Write a long essay about"
        msgs = [{"role": "user", "content": f"{ask} {topic}."}]
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        prompts.append([int(t) for t in (out if isinstance(out, list) else out["input_ids"])])
    sampling = SamplingConfig(temperature=0, max_new_tokens=sizes.engine_new_tokens, stop=[])
    adapters = [lora_adapter(cfg, seed) for seed in range(sizes.swaps)]
    report: dict[str, Any] = {
        "model": sizes.engine_model,
        "prompts": len(prompts),
        "new_tokens": sizes.engine_new_tokens,
    }
    for backend in backends:
        engine_cfg = rollout_config(cfg, backend=backend)
        from actors.engines import make_engine

        engine = make_engine(engine_cfg)
        with console.status(f"engines: starting {backend}"):
            t = time.perf_counter()
            await engine.start()
            start_s = time.perf_counter() - t
        try:
            await engine.generate(prompts[0], sampling.model_copy(update={"max_new_tokens": 4}))  # warm-up
            walls = []
            for i in range(repeats):
                with console.status(
                    f"engines: {backend}, {len(prompts)} prompts x {sizes.engine_new_tokens} tokens ({i + 1}/{repeats})"
                ):
                    t = time.perf_counter()
                    gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
                    walls.append(time.perf_counter() - t)
            swaps = []
            with console.status(f"engines: {backend}, {sizes.swaps} adapter swaps"):
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
            "wall_s": walls,
            "tokens_per_s": [tokens / w for w in walls],
            "swap_ms": [s * 1e3 for s in swaps],
            "swap_median_ms": statistics.median(swaps) * 1e3,
            "lora_output_differs": lora_gen.token_ids != gens[0].token_ids,
        }
    if "vllm" in report:
        report["vllm_over_hf"] = statistics.median(report["vllm"]["tokens_per_s"]) / statistics.median(
            report["hf"]["tokens_per_s"]
        )
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


async def bench_push_modes(console: Console, sizes: Sizes, repeats: int) -> dict[str, Any]:
    """vLLM, LoRA run: `rollout.weight_push` adapter vs merged on SmolLM2-135M. A real learner (r=16 on
    q,k,v,o, B non-zero) exports the adapter or the merged weights; an engine started for that mode loads
    them (push latency: export, and the engine's load) and plays a step like the demo's (see Sizes): prompts
    x samples sharing a long prefix, at most `push_new_tokens` new tokens (tokens/s counts the tokens
    generated: a sample may stop at EOS), temperature 1."""
    import torch

    from actors.engines import make_engine
    from actors.learner import Learner
    from actors.models import load_tokenizer
    from configs.schema import SamplingConfig

    cfg = Config.model_validate(
        {
            "model": {"name": sizes.engine_model, "dtype": "bfloat16"},
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
    prompts = _shared_prefix_prompts(load_tokenizer(cfg.model), sizes.push_prefix_tokens, sizes.push_prompts)
    batch = [p for p in prompts for _ in range(sizes.push_samples)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=sizes.push_new_tokens, stop=[])
    report: dict[str, Any] = {
        "model": sizes.engine_model,
        "requests": len(batch),
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "new_tokens": sizes.push_new_tokens,
    }
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
            walls = []
            for i in range(repeats):
                with console.status(
                    f"push modes: {mode}, {len(batch)} requests x {sizes.push_new_tokens} tokens ({i + 1}/{repeats})"
                ):
                    t = time.perf_counter()
                    gens = await asyncio.gather(*(engine.generate(p, sampling) for p in batch))
                    walls.append(time.perf_counter() - t)
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
            "wall_s": walls,
            "tokens_per_s": [tokens / w for w in walls],  # tokens of the last repeat: they vary little
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "version": gens[0].version,
        }
    report["merged_over_adapter"] = statistics.median(report["merged"]["tokens_per_s"]) / statistics.median(
        report["adapter"]["tokens_per_s"]
    )
    return report


def lora_adapter(cfg: Config, seed: int) -> dict[str, Any]:
    """A PEFT LoRA (r=16 on q,k,v,o) for the config's model with non-zero B: {"config", "state_dict"}."""
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


def run(opts: BenchOptions, console: Console) -> SuiteResult:
    from actors.engine_api import vllm_available
    from actors.hf_engine import HFEngine

    cfg = opts.mcprl_config()
    sizes = QUICK if opts.quick else Sizes()
    want_vllm = opts.rollout.vllm == "on" or (opts.rollout.vllm == "auto" and not opts.quick)
    if want_vllm and not vllm_available():
        if opts.rollout.vllm == "on":
            raise RuntimeError("bench rollout: rollout.vllm=on but vllm is not installed")
        want_vllm = False
    with console.status(f"rollout: generating {sizes.tasks} rule tasks"):
        rows = rule_rows(sizes.tasks)
    report: dict[str, Any] = {
        "machine": machine(),
        "tool_latency_ms": [x * 1e3 for x in ROLLOUT_TOOL_S],
        "tasks": len(rows),
        "group_size": sizes.group,
        "modes": {},
    }
    report["engines"] = asyncio.run(
        bench_engines(console, sizes, opts.repeats, ["hf", "vllm"] if want_vllm else ["hf"])
    )
    if want_vllm:
        report["push_modes"] = asyncio.run(bench_push_modes(console, sizes, opts.repeats))

    # async vs lockstep: (1) scripted engine, fixed generation time: the tool latency alone;
    # (2) the real HF engine (tiny-random: prefill of multi-thousand-token conversations every turn
    # is affordable) for variable-length generations, batching included, same scripted episodes.
    tiny = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": "tiny-random"})})
    real_cfg = rollout_config(tiny, backend="hf", max_model_len=2048)  # tiny-random's context
    real_rows = rows[: sizes.real_tasks]

    async def real_modes(cap: int | None) -> dict[str, Any]:
        engine = HFEngine(real_cfg)
        await engine.start()
        try:
            return await bench_modes(
                real_cfg, real_rows, cap,
                lambda tok: RealCostExpertEngine(_Fresh(engine), tok, real_rows, ROLLOUT_REAL_TOKENS),
                budget=real_cfg.rollout.max_model_len, group=sizes.group,
            )  # fmt: skip
        finally:
            await engine.shutdown()

    def scripted(cap: int | None) -> Any:
        return bench_modes(cfg, rows, cap, lambda tok: expert_engine(tok, rows, ROLLOUT_GEN_S), 32768, sizes.group)

    settings = {
        "scripted": (f"scripted, {ROLLOUT_GEN_S * 1e3:.0f} ms/generation", scripted, len(rows)),
        "hf-tiny": (
            f"HF tiny-random, {len(real_rows)} tasks, {ROLLOUT_REAL_TOKENS[0]}-{ROLLOUT_REAL_TOKENS[1]} tokens/turn",
            real_modes,
            len(real_rows),
        ),
    }
    for key, (label, bench, tasks) in settings.items():
        # The real engine re-reads whole conversations each turn (no prefix cache): one setting only.
        for flight, cap in (("all at once", None), ("16 in flight", 16))[1 if key == "hf-tiny" else 0 :]:
            runs = []
            for i in range(opts.repeats):
                with console.status(f"rollout: async vs lockstep, {label}, {flight} ({i + 1}/{opts.repeats})"):
                    runs.append(asyncio.run(bench(cap)))
            r: dict[str, Any] = {"label": label, "in_flight": flight, "tasks": tasks}
            for mode in ("async", "lockstep"):
                r[mode] = {k: [run[mode][k] for run in runs] for k in runs[0][mode] if k != "calls"}
            r["ratio"] = [run["async"]["episodes_per_s"] / run["lockstep"]["episodes_per_s"] for run in runs]
            if key == "scripted":
                r["ideal_ratio"] = predicted_ratio(runs[0]["async"]["calls"], cap, ROLLOUT_GEN_S)
            report["modes"][f"{key}, {flight}"] = r
    show(report, console)
    return SuiteResult("rollout", report, rollout_rows(report))


def rollout_rows(report: dict[str, Any]) -> list[Row]:
    e = report["engines"]
    rows = []
    if "vllm" in e:
        rows.append(
            Row(f"generated tokens/s, {e['prompts']} prompts at once ({e['model']})", "tokens/s",
                spread(e["vllm"]["tokens_per_s"]), spread(e["hf"]["tokens_per_s"]), "HF engine (ours: vLLM)")
        )  # fmt: skip
    for backend in ("hf", "vllm"):
        if backend in e:
            rows.append(Row(f"LoRA adapter swap, {backend}", "ms", spread(e[backend]["swap_ms"]), better="lower"))
    if "push_modes" in report:
        pm = report["push_modes"]
        rows.append(
            Row(f"demo-like step tokens/s, vLLM, {pm['requests']} requests sharing a prefix", "tokens/s",
                spread(pm["merged"]["tokens_per_s"]), spread(pm["adapter"]["tokens_per_s"]),
                "weight_push adapter (ours: merged)")
        )  # fmt: skip
    for r in report["modes"].values():
        ideal = f"; ideal {r['ideal_ratio']:.2f}x" if "ideal_ratio" in r else ""
        rows.append(
            Row(f"episodes/s, {r['label']}, {r['in_flight']}", "episodes/s", spread(r["async"]["episodes_per_s"]),
                spread(r["lockstep"]["episodes_per_s"]), "lockstep (ours: async)", goal=f">= 1.5x{ideal}")
        )  # fmt: skip
    return rows


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


def show(report: dict[str, Any], console: Console) -> None:
    m = report["machine"]
    console.print(f"machine: {machine_line(m)}, Python {m['python']}")
    e = report["engines"]
    table = Table(title=f"engines on {e['model']}: {e['prompts']} prompts x {e['new_tokens']} new tokens, greedy")
    for col in ("backend", "start s", "tokens", "wall s", "tokens/s", "LoRA swap median ms", "swaps ms"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for backend in ("hf", "vllm"):
        if backend in e:
            r = e[backend]
            table.add_row(
                backend, f"{r['start_s']:.1f}", str(r["tokens"]), f"{median(r['wall_s']):.2f}",
                f"{median(r['tokens_per_s']):.0f}",
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
        a, lk = r["async"], r["lockstep"]
        batch = f"{median(a['mean_batch']):.1f} / {median(lk['mean_batch']):.1f}" if median(a["mean_batch"]) else "-"
        table.add_row(
            r["label"], r["in_flight"], f"{median(a['episodes_per_s']):.2f}", f"{median(lk['episodes_per_s']):.2f}",
            f"{median(r['ratio']):.2f}x", ideal, batch,
        )  # fmt: skip
    console.print(table)
    console.print(
        "goal: async >= 1.5x lockstep. ideal = the same episodes on a runner with no overheads and an unlimited "
        "engine (order statistics of the latencies); it bounds what the scripted runs can reach."
    )
