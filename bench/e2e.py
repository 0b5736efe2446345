"""Suite `e2e`: mcprl's GRPO step against TRL 1.16's GRPOTrainer on the same work, side by side.

    python -m bench --suite e2e [--repeats 3] [--set e2e.steps=5] [--quick]

The work (issue 13's hand comparison, made identical where the two trainers allow): SmolLM2-135M-Instruct,
LoRA r=16 (alpha 32) on q,k,v,o, polygon rule tasks (one file, written here, read by both), the offline
tools, 2 tasks x G=4 per step, <= 64 new tokens per turn, <= 2 turns, temperature 1, lr 1e-4, no warm
start, no KL, no evaluation. Each side is a fresh process, as a user runs it:
- mcprl: `python -m jobs.train --config configs/bench-e2e.yaml --run --fresh --set ...`; its per-step
  figures come from the run's metrics.jsonl (`timing/step_s`, `rollout/episodes`, `rollout/episode_tokens`,
  `rollout/episode_reward`);
- TRL: `python -m bench.trl_baseline ...` (bench/trl_baseline.py says what it shares with mcprl), which
  writes the same per-step figures from a TrainerCallback.
Repeats alternate the order (TRL first on even repeats). Figures per run: the median step time (the first
step left out as warm-up), episodes/s and tokens/s over those steps (tokens: prompt + completion of every
episode, all turns, tool results included), the last step's mean reward, and the time outside the steps
(the process's wall time less its steps: start-up and teardown). Each run's console, its lines stamped with the
seconds since the run's start, is kept in `<out>/e2e-runs/<side>-<repeat>.log` (mcprl's metrics.jsonl beside it).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.options import BenchOptions, E2EOptions
from bench.results import Row, SuiteResult, spread
from cluster.local_cluster import ROOT, clean_env
from configs.loader import set_args

SIDES = ("TRL", "mcprl")
QUICK = {"model": "tiny-random", "steps": 2, "max_new_tokens": 8, "observation_tokens": 64, "mcprl_backend": "hf"}
RUN_TIMEOUT_S = 3600
CONSOLE = "console.log"  # each run's time-stamped output, kept under <out>/e2e-runs/ (and mcprl's metrics.jsonl)


def sizes(opts: BenchOptions) -> tuple[E2EOptions, int]:
    """The e2e section and the repeats, with `--quick`'s smoke sizes where `--set` did not choose."""
    e2e = opts.e2e
    if not opts.quick:
        return e2e, opts.repeats
    chosen = e2e.model_fields_set
    e2e = e2e.model_copy(update={k: v for k, v in QUICK.items() if k not in chosen})
    return e2e, opts.repeats if "repeats" in opts.model_fields_set else 1


def write_tasks(o: E2EOptions, path: Path) -> None:
    """The rule tasks both trainers draw from: polygon only, simple, at most `max_turns` turns."""
    cmd = [sys.executable, "-m", "jobs.generate_tasks", "--config", o.config, "--method", "rule"]
    cmd += ["--n", str(o.tasks), "--seed", str(o.seed), "--domains", "polygon", "--complexities", "simple"]
    cmd += ["--max-turns", str(o.max_turns), "--out", str(path)]
    _run(cmd, "generating the tasks")


def _run(cmd: list[str], what: str, log: Path | None = None) -> float:
    """Run `cmd` from the checkout in a fresh process; its wall time, or an error with its output's tail.
    `log`: its output (stdout and stderr) is kept there, each line stamped with the seconds since its start, so
    that a slow run can be read phase by phase afterwards."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mcprl-e2e-") as scratch:
        log = log or Path(scratch) / CONSOLE
        with log.open("w") as out:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )

            def stamp() -> None:
                assert proc.stdout is not None
                for line in proc.stdout:
                    out.write(f"{time.monotonic() - t0:8.2f} {line}")
                    out.flush()

            reader = threading.Thread(target=stamp, daemon=True)
            reader.start()
            try:
                code = proc.wait(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            reader.join()
        if code != 0:
            tail = log.read_text()[-6000:].strip()
            raise RuntimeError(f"e2e: {what} failed (exit {code}): {' '.join(cmd)}\n{tail}")
    return time.monotonic() - t0


def run_mcprl(o: E2EOptions, tasks: Path, folder: Path, more: dict[str, Any] | None = None) -> dict[str, Any]:
    """One `jobs.train` run (`more`: further `--set`s); its per-step figures from metrics.jsonl."""
    sets = {
        "model.name": o.model,
        "data.train": str(tasks),
        "data.validation": "",
        "train.storage": str(folder),
        "train.steps": o.steps,
        "train.tasks_per_step": o.tasks_per_step,
        "train.group_size": o.group_size,
        "train.seed": o.seed,
        "rollout.backend": o.mcprl_backend,
        "rollout.sampling.max_new_tokens": o.max_new_tokens,
        "rollout.sampling.temperature": o.temperature,
        "finetune.lora.r": o.lora_r,
        "finetune.lora.alpha": 2 * o.lora_r,
        "learner.optim.lr": o.lr,
        **(more or {}),
    }
    cmd = [sys.executable, "-m", "jobs.train", "--config", o.config, "--run", "--fresh"]
    cmd += set_args(sets)
    wall = _run(cmd, "mcprl's run (python -m jobs.train)", folder / CONSOLE)
    (metrics,) = folder.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [
        {
            "step_s": r["timing/step_s"],
            "episodes": r["rollout/episodes"],
            "tokens": r["rollout/episode_tokens"] * r["rollout/episodes"],
            "turns": r["rollout/episode_len"],
            "reward": r["rollout/episode_reward"],
        }
        for r in rows
        if "timing/step_s" in r
    ]
    return {"wall_s": wall, "steps": steps, "generation": f"mcprl {o.mcprl_backend} engine (Ray actor)"}


def run_trl(o: E2EOptions, tasks: Path, folder: Path, more: dict[str, Any] | None = None) -> dict[str, Any]:
    """One `bench.trl_baseline` run (`more`: further options); its per-step figures from the JSON it writes."""
    out = folder / "trl.json"
    args = {
        "tasks": tasks,
        "out": out,
        "model": o.model,
        "steps": o.steps,
        "tasks-per-step": o.tasks_per_step,
        "group-size": o.group_size,
        "max-new-tokens": o.max_new_tokens,
        "max-turns": o.max_turns,
        "observation-tokens": o.observation_tokens,
        "lora-r": o.lora_r,
        "lora-alpha": 2 * o.lora_r,
        "lr": o.lr,
        "temperature": o.temperature,
        "seed": o.seed,
        **(more or {}),
    }
    cmd = [sys.executable, "-m", "bench.trl_baseline", *[a for k, v in args.items() for a in (f"--{k}", str(v))]]
    wall = _run(cmd, "TRL's run (python -m bench.trl_baseline)", folder / CONSOLE)
    return {**json.loads(out.read_text()), "wall_s": wall}


def keep_console(folder: Path, into: Path, name: str) -> None:
    """A run's time-stamped console, and mcprl's metrics.jsonl (its phases' timings per step), out of the temporary
    folder the suite deletes."""
    into.mkdir(parents=True, exist_ok=True)
    if (folder / CONSOLE).exists():
        shutil.copyfile(folder / CONSOLE, into / f"{name}.log")
    for metrics in folder.glob("*/metrics.jsonl"):
        shutil.copyfile(metrics, into / f"{name}.metrics.jsonl")


def figures(run: dict[str, Any], expected_steps: int) -> dict[str, float]:
    """One run's figures; the first step is warm-up (model load into the engine, first compile)."""
    steps = run["steps"]
    if len(steps) != expected_steps:
        raise RuntimeError(f"e2e: a run logged {len(steps)} steps, expected {expected_steps}")
    timed = steps[1:]
    seconds = math.fsum(s["step_s"] for s in timed)
    return {
        "step_s": statistics.median(s["step_s"] for s in timed),
        "episodes_per_s": sum(s["episodes"] for s in timed) / seconds,
        "tokens_per_s": sum(s["tokens"] for s in timed) / seconds,
        "tokens_per_step": statistics.mean(s["tokens"] for s in timed),
        "turns_per_episode": statistics.mean(s["turns"] for s in steps),
        "reward_last": steps[-1]["reward"],
        "outside_steps_s": run["wall_s"] - math.fsum(s["step_s"] for s in steps),
    }


ROWS = (  # key, figure, unit, better
    ("step_s", "wall time per step", "s", "lower"),
    ("episodes_per_s", "episodes/s end to end", "1/s", "higher"),
    ("tokens_per_s", "tokens/s end to end", "tokens/s", "higher"),
    ("reward_last", "reward after N steps (noisy)", "mean, last step", "higher"),
    ("outside_steps_s", "start-up + teardown", "s", "lower"),
)


def run(opts: BenchOptions, console: Console) -> SuiteResult:
    o, repeats = sizes(opts)
    root = Path(tempfile.mkdtemp(prefix="mcprl-bench-e2e-", dir="/tmp"))
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    try:
        tasks = root / "tasks.jsonl"
        write_tasks(o, tasks)
        for i in range(repeats):
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                folder = root / f"{side}-{i}"
                folder.mkdir()
                try:
                    result = (run_trl if side == "TRL" else run_mcprl)(o, tasks, folder)
                finally:
                    keep_console(folder, opts.out / "e2e-runs", f"{side}-{i + 1}")
                result["figures"] = figures(result, o.steps)
                runs[side].append(result)
                f = result["figures"]
                console.print(
                    f"{side} #{i + 1}: {f['step_s']:.1f} s/step, {f['tokens_per_s']:.0f} tokens/s, "
                    f"reward {f['reward_last']:.3f}, {f['outside_steps_s']:.1f} s outside the steps"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def values(side: str, key: str) -> list[float]:
        return [r["figures"][key] for r in runs[side]]

    rows = [
        Row(figure, unit, spread(values("mcprl", key)), spread(values("TRL", key)), "TRL 1.16 GRPOTrainer", better)
        for key, figure, unit, better in ROWS
    ]
    rows[0].goal = "≤ 0.5× TRL's (ratio ≥ 2)"
    step_ratio = rows[0].ratio
    console.print(f"TRL / mcprl step time: {step_ratio:.2f}× (goal ≥ 2×)" if step_ratio else "no step-time ratio")
    tokens = {side: statistics.median(values(side, "tokens_per_step")) for side in SIDES}
    turns = {side: statistics.median(values(side, "turns_per_episode")) for side in SIDES}
    report = {
        "options": o.model_dump(),
        "repeats": repeats,
        "quick": opts.quick,
        "step_time_ratio_trl_over_mcprl": step_ratio,
        "tokens_per_step": tokens,
        "turns_per_episode": turns,
        "generation": {side: runs[side][0]["generation"] for side in SIDES},
        "runs": runs,
    }
    dtype = runs["TRL"][0].get("dtype", "bfloat16")
    return SuiteResult("e2e", report, rows, notes=notes(o, tokens, turns, dtype))


def notes(o: E2EOptions, tokens: dict[str, float], turns: dict[str, float], dtype: str) -> list[str]:
    """Where the two sides do not do identical work."""
    return [
        f"Precision: both sides compute in {dtype} (the configs say bfloat16; actors/precision.py: float32 on a CPU "
        "where torch has no bf16 kernels).",
        f"Generation: mcprl uses its {o.mcprl_backend} engine (a Ray actor, LoRA pushed after every step); TRL uses "
        "transformers' generate in the trainer's process (no vLLM: TRL 1.16 supports vLLM ≤ 0.31, this venv has 0.32).",
        f"Tokens per step (median): mcprl {tokens['mcprl']:.0f}, TRL {tokens['TRL']:.0f}; assistant turns per "
        f"episode: mcprl {turns['mcprl']:.2f}, TRL {turns['TRL']:.2f}. The same prompts and "
        "tool block (SmolLM2's template with mcprl's tool block, envs/chat_template.py), but the episodes differ: "
        "mcprl ends an episode on <answer>, on max_turns or when a task without a final answer is done; TRL ends "
        "it when a turn makes no tool call, and drops a tool result that would overflow its completion budget "
        f"(max_turns x max_new_tokens + {o.observation_tokens} tokens for the whole multi-turn completion; each "
        f"turn is also capped at {o.max_new_tokens} new tokens).",
        "Reward: TRL's completions are replayed through MCPToolEnv (the same parser, tool calls and heuristic "
        "reward, summed over turns as mcprl does), so each tool call runs twice on TRL's side (once in its loop, "
        "once when scored; offline servers, ~ms each). TRL's parser (its Qwen3 `<tool_call>` JSON template) "
        "splits calls from text before the replay reformats them in mcprl's syntax.",
        "Loss: both GRPO, group-normalised advantages, clip 0.2/0.28, token-mean loss (TRL loss_type dapo), no KL, "
        "one optimizer step per batch; mcprl's learner is a separate Ray actor (FSDP2, 1 worker), TRL's is in process.",
        "Task order: both draw from the same file, each with its own sampler (seeded), so the steps' tasks differ.",
        "Reward after N steps is the last step's mean over 8 episodes: noisy, and N is small.",
    ]
