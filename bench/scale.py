"""Suite `scale`: how a GRPO step grows with its size, and async against lockstep rollouts on vLLM.

    python -m bench --suite scale [--quick] [--repeats 3] [--set scale.group_sizes=[2,4,8,16]]

1. Step time against group size G (`scale.group_sizes`, at `scale.sweep_tasks` tasks per step) and
   against tasks per step (`scale.tasks_per_step`, at G = `scale.sweep_group`): each point is a real
   run, `python -m jobs.train --config <scale.train_config> --run`, in a fresh process, with
   `repeats + 1` GRPO steps and no warm start, evaluation or intermediate checkpoint; the first step
   (lazy start-up costs) is left out, so the other steps are the point's repeats. The figures come from
   the run's metrics.jsonl: `timing/step_s`, its rollout and train phases, and `rollout/episodes`.
2. Async against lockstep EpisodeRunner rollouts on the real vLLM engine (in this process; its engine
   core is a spawned process), every tool call delayed by 100 ± 50 ms (uniform, seeded per repeat, the
   same draws for both modes). Each turn first generates a real, variable number of tokens on the real
   conversation (bench.doubles.RealCostExpertEngine), then answers with the task's expert call, so both
   modes play the same episodes. The modes alternate, `repeats` times; the engine's prefix cache is
   emptied before each mode's run, so neither inherits the other's cached prompts.
3. The control-plane and tool-pool sweeps of `bench.cplane` (their own module), when it is present.
"""

from __future__ import annotations

import asyncio
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

from bench import cplane
from bench.doubles import LatentClient, RealCostExpertEngine, rule_rows
from bench.options import BenchOptions, ScaleOptions
from bench.results import Curve, Row, SuiteResult, spread
from bench.rollout import ROLLOUT_GROUP, ROLLOUT_TOOL_S, predicted_ratio, rollout_config
from cluster.local_cluster import ROOT, clean_env
from configs.loader import set_args
from configs.schema import Config

# --------------------------------------------------------------------------- 1. step time against size

PHASES = {"step": "timing/step_s", "rollout": "timing/rollout_s", "train": "timing/train_s"}


def train_args(config: str, group: int, tasks: int, steps: int, folder: Path) -> list[str]:
    """jobs.train's arguments for one sweep point; every file it writes goes under `folder`, except the
    task file, shared by all points (the first point generates it)."""
    sets = {
        "train.group_size": group,
        "train.tasks_per_step": tasks,
        "train.steps": steps,
        "train.checkpoint_every": 0,  # only the final checkpoint, after the timed steps
        "train.storage": folder / "runs",
        "data.train": folder.parent / "data" / "tasks.train.jsonl",
        "data.validation": "",  # no evaluation: only steps are timed
        "sft_warmup.enabled": False,
        "logging.wandb": "off",
        "logging.sample_trajectories": 0,
    }
    return ["--config", config, "--run", *set_args(sets)]


def step_rows(run_folder: Path) -> list[dict[str, Any]]:
    """The GRPO steps' metric lines of a finished run (those with `timing/step_s`), in step order."""
    lines = (run_folder / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r for r in rows if "timing/step_s" in r]


def run_point(config: str, group: int, tasks: int, steps: int, folder: Path) -> dict[str, list[float]]:
    """One sweep point: a fresh jobs.train process; each figure's values over the steps after the first."""
    cmd = [sys.executable, "-m", "jobs.train", *train_args(config, group, tasks, steps, folder)]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        tail = proc.stdout[-2000:] + proc.stderr[-3000:]
        raise RuntimeError(
            f"scale: jobs.train at G={group}, {tasks} tasks/step failed (exit {proc.returncode}):\n{tail}"
        )
    run_name = yaml.safe_load((ROOT / config).read_text()).get("run_name", "mcprl")
    rows = step_rows(folder / "runs" / run_name)[1:]  # the first step pays lazy start-up costs
    if len(rows) != steps - 1:
        raise RuntimeError(
            f"scale: jobs.train at G={group}, {tasks} tasks/step logged {len(rows) + 1} of {steps} steps"
        )
    figures = {name: [r[key] for r in rows] for name, key in PHASES.items()}
    figures["episodes_per_s"] = [r["rollout/episodes"] / r["timing/step_s"] for r in rows]
    figures["episodes"] = [r["rollout/episodes"] for r in rows]
    return figures


def sweep_lines(s: ScaleOptions) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Sweep 1's two lines of (G, tasks per step) points: G varied at `sweep_tasks`, tasks varied at `sweep_group`."""
    return [(g, s.sweep_tasks) for g in s.group_sizes], [(s.sweep_group, b) for b in s.tasks_per_step]


def step_sweeps(s: ScaleOptions, repeats: int, console: Console) -> tuple[list[Row], list[Curve], dict[str, Any]]:
    """Sweep 1: every distinct (G, tasks) point once, each curve read from the points on its line."""
    g_line, b_line = sweep_lines(s)
    points = list(dict.fromkeys(g_line + b_line))
    steps = repeats + 1
    root = Path(tempfile.mkdtemp(prefix="mcprl-bench-scale-", dir="/tmp"))
    measured: dict[tuple[int, int], dict[str, list[float]]] = {}
    try:
        for i, (g, b) in enumerate(points, 1):
            with console.status(f"scale: jobs.train point {i}/{len(points)}: G={g}, {b} tasks/step, {steps} steps"):
                t = time.perf_counter()
                measured[(g, b)] = run_point(s.train_config, g, b, steps, root / f"g{g}-b{b}")
            f = measured[(g, b)]
            console.print(
                f"G={g:>3}, {b} tasks/step: {statistics.median(f['step']):.2f} s/step "
                f"(rollout {statistics.median(f['rollout']):.2f}, train {statistics.median(f['train']):.2f}), "
                f"{statistics.median(f['episodes_per_s']):.2f} episodes/s; process {time.perf_counter() - t:.0f} s"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows, curves = step_figures(s, measured)
    report = {
        "config": s.train_config,
        "steps_per_point": steps,
        "points": {f"G={g},tasks={b}": measured[(g, b)] for g, b in points},
    }
    return rows, curves, report


def step_figures(
    s: ScaleOptions, measured: dict[tuple[int, int], dict[str, list[float]]]
) -> tuple[list[Row], list[Curve]]:
    """Sweep 1's curves (each read from the points on its line) and its rows (the largest point of a line
    against its smallest), from each (G, tasks) point's measured figures."""
    g_line, b_line = sweep_lines(s)
    curves, rows = [], []
    for line, x_of, label, fixed in (
        (g_line, lambda p: p[0], "group size G", f"{s.sweep_tasks} tasks/step"),
        (b_line, lambda p: p[1], "tasks per step", f"G={s.sweep_group}"),
    ):
        line = sorted(set(line), key=x_of)
        curves.append(
            Curve(
                f"seconds per GRPO step against {label} ({fixed}; {s.train_config})",
                label,
                "seconds per step",
                {name: [(x_of(p), spread(measured[p][name])) for p in line] for name in PHASES},
            )
        )
        curves.append(
            Curve(
                f"episodes/s against {label} (over the whole step; {fixed})",
                label,
                "episodes per second",
                {"episodes/s": [(x_of(p), spread(measured[p]["episodes_per_s"])) for p in line]},
            )
        )
        if len(line) > 1:  # how much throughput the largest point gains over the smallest
            lo, hi = line[0], line[-1]
            rows.append(
                Row(
                    f"episodes/s, {label} {x_of(hi)} vs {x_of(lo)} ({fixed})",
                    "episodes/s",
                    spread(measured[hi]["episodes_per_s"]),
                    spread(measured[lo]["episodes_per_s"]),
                    f"{label} {x_of(lo)}",
                )
            )
    return rows, curves


# --------------------------------------------------------------------------- 2. async vs lockstep on vLLM


class ColdCacheEngine:
    """The shared vLLM engine, its prefix cache emptied before the first request of each mode's run (the
    two modes play the same conversations: the second would find them all cached), counting its own
    requests and generated tokens."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._reset: asyncio.Future | None = None
        self.tokens = self.requests = 0

    async def generate(self, prompt_token_ids: list[int], sampling: Any) -> Any:
        if self._reset is None:  # concurrent first requests all wait for the one reset
            self._reset = asyncio.ensure_future(self.engine.reset_prefix_cache())
        await self._reset
        out = await self.engine.generate(prompt_token_ids, sampling)
        self.tokens += len(out.token_ids)
        self.requests += 1
        return out

    def version(self) -> int:
        return self.engine.version()

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "tokens": self.tokens}


async def play_mode(
    cfg: Config,
    rows: list[dict[str, Any]],
    mode: str,
    engine: Any,
    tokenizer: Any,
    pool: Any,
    s: ScaleOptions,
    seed: int,
) -> dict[str, Any]:
    """One mode's EpisodeRunner run over `rows` x ROLLOUT_GROUP, every tool call delayed by a seeded
    100 ± 50 ms draw; the episodes/s and what the ideal bound needs (tool calls per turn, generation time)."""
    from actors.episode_runner import EpisodeRunner

    real = ColdCacheEngine(engine)
    scripted = RealCostExpertEngine(real, tokenizer, rows, s.vllm_tokens)
    runner = EpisodeRunner(
        rollout_config(cfg, mode=mode),
        [scripted],
        tokenizer,
        max_concurrent_episodes=s.vllm_in_flight,
        progress=False,
        tool_client=LatentClient(pool, *ROLLOUT_TOOL_S, seed=seed),
    )
    t = time.perf_counter()
    trajs = await runner.run(rows, ROLLOUT_GROUP)
    wall = time.perf_counter() - t
    bad = [tr for tr in trajs if tr.infra_fault or tr.finish_reason not in ("done", "token_budget")]
    if bad:
        raise RuntimeError(f"scale: {mode} rollout on vLLM: {len(bad)} episodes failed ({bad[0].finish_reason})")
    calls = [[len(m.get("calls") or []) for m in tr.env_metadata] for tr in trajs]
    if not any(map(any, calls)):  # e.g. expert answers cut short: the tool latency would not be measured
        raise RuntimeError(f"scale: {mode} rollout on vLLM made no tool call; see the episodes' parse errors")
    turns = sum(tr.turns for tr in trajs)
    return {
        "episodes": len(trajs),
        "wall_s": wall,
        "episodes_per_s": len(trajs) / wall,
        "real_tokens": real.tokens,
        "turns_mean": turns / len(trajs),
        "generate_s_per_turn": sum(tr.timings.get("generate_s", 0.0) for tr in trajs) / max(1, turns),
        "token_budget_ends": sum(tr.finish_reason == "token_budget" for tr in trajs),
        "calls": calls,
    }


def vllm_config(s: ScaleOptions) -> Config:
    return Config.model_validate(
        {
            "model": {"name": s.vllm_model, "dtype": "bfloat16"},
            "rollout": {
                "backend": "vllm",
                "max_model_len": 2048,  # tiny-random's positions; longer episodes end at the token budget (counted)
                "max_total_tokens": 2048,
                "vllm_kv_cache_gb": 1,
                # The expert's answers must fit a turn: the real generation's length is scale.vllm_tokens.
                "sampling": {"max_new_tokens": max(256, *s.vllm_tokens)},
            },
        }
    )


async def vllm_modes(s: ScaleOptions, repeats: int, console: Console) -> dict[str, Any]:
    """Sweep 2: one vLLM engine; `repeats` rounds of async and lockstep, the first mode alternating."""
    from actors.models import load_tokenizer
    from actors.vllm_engine import VLLMEngine
    from serve_apps.tool_pool import LocalToolPool

    cfg = vllm_config(s)
    rows = rule_rows(s.vllm_tasks)
    tokenizer = load_tokenizer(cfg.model)
    engine = VLLMEngine(cfg)
    with console.status(f"scale: starting vLLM ({s.vllm_model})"):
        await engine.start()
    pool = await LocalToolPool.create(cfg.tools)
    runs: dict[str, list[dict[str, Any]]] = {"async": [], "lockstep": []}
    try:
        await play_warm(cfg, rows, engine, tokenizer, pool, s)
        for i in range(repeats):
            for mode in ("async", "lockstep") if i % 2 == 0 else ("lockstep", "async"):
                with console.status(f"scale: vLLM {mode}, round {i + 1}/{repeats}"):
                    r = await play_mode(cfg, rows, mode, engine, tokenizer, pool, s, seed=i)
                runs[mode].append(r)
                console.print(f"vLLM {mode:>8} #{i + 1}: {r['episodes_per_s']:.2f} episodes/s ({r['wall_s']:.1f} s)")
    finally:
        await pool.close()
        await engine.shutdown()
    gen_s = statistics.fmean(r["generate_s_per_turn"] for rs in runs.values() for r in rs)
    calls = runs["async"][0]["calls"]
    return {
        "model": s.vllm_model,
        "tasks": len(rows),
        "group_size": ROLLOUT_GROUP,
        "in_flight": s.vllm_in_flight,
        "tokens_per_turn": list(s.vllm_tokens),
        "tool_latency_ms": [x * 1e3 for x in ROLLOUT_TOOL_S],
        "runs": {m: [{k: v for k, v in r.items() if k != "calls"} for r in rs] for m, rs in runs.items()},
        "generate_s_per_turn": gen_s,
        # Ideal runners (no overheads, an unlimited engine) on these episodes: at the measured generation
        # time per turn, and with free generation (the cap the tool latencies alone set).
        "ideal_ratio": predicted_ratio(calls, s.vllm_in_flight, gen_s),
        "ideal_ratio_free_generation": predicted_ratio(calls, s.vllm_in_flight, 0.0),
    }


async def play_warm(
    cfg: Config, rows: list[dict[str, Any]], engine: Any, tokenizer: Any, pool: Any, s: ScaleOptions
) -> None:
    """One untimed episode per task, real generation included: the tools' and templates' first calls and
    the engine's first real batches are neither mode's cost."""
    from actors.episode_runner import EpisodeRunner

    scripted = RealCostExpertEngine(ColdCacheEngine(engine), tokenizer, rows, s.vllm_tokens)
    await EpisodeRunner(cfg, [scripted], tokenizer, progress=False, tool_client=pool).run(rows, 1)


def vllm_rows(report: dict[str, Any]) -> tuple[list[Row], list[str]]:
    eps = {m: spread([r["episodes_per_s"] for r in rs]) for m, rs in report["runs"].items()}
    label = f"vLLM {report['model']}, {report['tasks']}x{report['group_size']} episodes"
    rows = [
        Row(
            f"episodes/s, async vs lockstep ({label})",
            "episodes/s",
            eps["async"],
            eps["lockstep"],
            "lockstep",
            goal=">= 1.5x",
        )
    ]
    ratio = eps["async"].median / eps["lockstep"].median
    ideal, free = report["ideal_ratio"], report["ideal_ratio_free_generation"]
    notes = [
        f"async vs lockstep on vLLM: {ratio:.2f}x measured (goal >= 1.5x). An overhead-free runner on the same "
        f"episodes, each turn's generation fixed at the measured {report['generate_s_per_turn'] * 1e3:.0f} ms, "
        f"would reach {ideal:.2f}x; with free generation {free:.2f}x, the bound the tool latencies alone set: "
        "lockstep waits each turn for the slowest of its episodes' calls (uniform 50-150 ms: toward 150 ms "
        "against a mean of 100 ms), so with near-equal turn counts async gains at most about "
        "(gen + 150) / (gen + 100) per turn, below 1.5x. The larger published gains (1.5-2.8x) come from "
        "episodes of very different lengths; these rule tasks take 2-3 turns. A measured ratio above the "
        "fixed-generation figure means generation itself overlapped better in async; one below it, that "
        "lockstep's full batches (every live episode generating at once) used the engine better than async's "
        "staggered ones. The model leaves batching out.",
        "async vs lockstep: both modes play the same scripted episodes (each turn's answer is the task's expert "
        "call; the real generation before it is discarded), the same seeded tool latencies, on one engine whose "
        "prefix cache is emptied before each mode's run.",
    ]
    return rows, notes


# --------------------------------------------------------------------------- the suite


def run(opts: BenchOptions, console: Console) -> SuiteResult:
    s = opts.scale.smoke() if opts.quick else opts.scale
    steps_repeats = 1 if opts.quick else opts.repeats
    mode_repeats = 2 if opts.quick else opts.repeats  # two: alternation runs in the smoke test too
    rows, curves, report = step_sweeps(s, steps_repeats, console)
    result = SuiteResult("scale", {"step_time": report}, rows, curves)
    result.notes.append(
        f"step time: each point is one `python -m jobs.train` process on {s.train_config} "
        f"({yaml.safe_load((ROOT / s.train_config).read_text())['model']['name']} model), no warm start, no "
        f"evaluation; its first step is left out and the {steps_repeats} after it are the repeats. Episodes/s "
        "is episodes over the whole step (rollout, train, push)."
    )
    from actors.engine_api import vllm_available

    if s.vllm == "on" or (s.vllm == "auto" and vllm_available()):
        vreport = asyncio.run(vllm_modes(s, mode_repeats, console))
        result.report["vllm_async_vs_lockstep"] = vreport
        vrows, vnotes = vllm_rows(vreport)
        result.rows += vrows
        result.notes += vnotes
    else:
        result.notes.append("async vs lockstep on vLLM: skipped (vLLM is not installed, or scale.vllm=off)")
    crows, ccurves, creport, cnotes = cplane.sweeps(opts, console)
    result.rows += crows
    result.curves += ccurves
    result.report["cplane"] = creport
    result.notes += cnotes
    return result
