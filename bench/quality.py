"""Suite `quality`: minutes of training until held-out success passes the warm start + 10 points, mcprl
against TRL 1.16's GRPOTrainer, on the same tasks from the same warm start.

    python -m bench --suite quality [--set quality.steps=30] [--set quality.eval_every=5] [--quick]
    python -m bench --suite quality --set quality.trl=false --set 'quality.mcprl_sets={rollout.backend: hf}'

The work is suite `e2e`'s (its section sets the model, LoRA, group size, tokens and turns; bench/e2e.py
says where the two trainers differ), from a warm start:
1. Tasks: rule tasks (polygon, simple), `train_tasks` of seed s to train on and `held_out_tasks` of seed s+1
   with every prompt the training file has left out: the same templates, instances training never saw.
2. Warm start: `jobs.train --set train.steps=0 --set sft_warmup.steps=S` (its `sft/` adapter). Both sides
   train that adapter on: mcprl with `finetune.init_adapter`, TRL with `--init-adapter`.
3. Each side trains `steps` GRPO steps and keeps its adapter after every step (mcprl: its checkpoints;
   TRL: `--save-every 1`; saving is outside the step times). Each side runs its own algorithm as configured:
   the figure compares what a user gets from each trainer, not one loss.
4. One evaluator scores the adapters, the warm start's included: `jobs.evaluate --adapter` on the held-out
   file (greedy; success = the final answer right), every `eval_every` steps, then each step before the first
   score at the target since the one scored before it (`scan`): the first pass to the step.
5. An ablation: `mcprl_sets` are `--set`s of mcprl's GRPO run alone (not of its warm start or the evaluator), and
   `trl=false` leaves TRL's side out; the same seed makes the same warm start, so runs that vary one set compare.
Figure: the training minutes (the sum of the step times up to that adapter's step: start-up, saving and
evaluation left out) at the first adapter whose held-out success is at least the warm start's + `target`.
A side that never gets there reads "not reached" with the minutes it trained. One held-out set of
`held_out_tasks` tasks, so a success moves in steps of 1/held_out_tasks; the first pass among several
evaluations is the earliest of noisy figures, hence each passing adapter's paired gain and 95% CI beside it.

Files: out/quality.json (each scored adapter's success, step and training time), out/quality.md, out/quality.png
(held-out success against training minutes, both sides).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from rich.console import Console

from bench.e2e import _run, run_mcprl, run_trl, sizes, write_tasks
from bench.options import BenchOptions, E2EOptions, QualityOptions
from bench.results import Curve, Row, SuiteResult, spread
from configs.loader import set_args, set_items
from jobs.stats import outcomes, paired_gain

SIDES = ("TRL", "mcprl")
Better = Literal["lower", "higher"]


def split_tasks(o: E2EOptions, q: QualityOptions, folder: Path) -> tuple[Path, Path]:
    """The training file (seed s) and the held-out file (seed s+1, without any prompt of the training file)."""
    train, pool, held = folder / "train.jsonl", folder / "held-out-pool.jsonl", folder / "held-out.jsonl"
    write_tasks(o.model_copy(update={"tasks": q.train_tasks, "seed": q.seed}), train)
    # Drawn with room to spare: a few of seed s+1's prompts can be seed s's too.
    write_tasks(o.model_copy(update={"tasks": 2 * q.held_out_tasks, "seed": q.seed + 1}), pool)
    seen = {json.dumps(json.loads(line)["prompt"]) for line in train.read_text().splitlines() if line.strip()}
    fresh = [
        line
        for line in pool.read_text().splitlines()
        if line.strip() and json.dumps(json.loads(line)["prompt"]) not in seen
    ]
    if len(fresh) < q.held_out_tasks:
        raise RuntimeError(
            f"quality: only {len(fresh)} held-out tasks unlike the training ones, {q.held_out_tasks} asked"
        )
    held.write_text("\n".join(fresh[: q.held_out_tasks]) + "\n")
    return train, held


def warm_start(o: E2EOptions, q: QualityOptions, train: Path, folder: Path) -> Path:
    """The SFT warm start both sides train on (mcprl's own, `sft_warmup` on expert trajectories)."""
    more = {"train.steps": 0, "sft_warmup.enabled": True, "sft_warmup.steps": q.warm_steps, "sft_warmup.lr": q.warm_lr}
    run_mcprl(o, train, folder, more)
    (adapter,) = folder.glob("*/sft")
    return adapter


def adapters(side: str, run: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    """(step, training seconds up to it, adapter folder) for every step of one side's run (each keeps its adapter)."""
    out, seconds = [], 0.0
    for i, step in enumerate(run["steps"], start=1):
        seconds += step["step_s"]
        if side == "TRL":
            path = step["adapter"]
        else:
            (path,) = folder.glob(f"*/checkpoints/step_{i}/adapter")
        out.append({"step": i, "train_s": seconds, "adapter": str(path)})
    return out


def scan(kept: list[dict[str, Any]], every: int, target: float, score: Callable[[dict[str, Any]], float]) -> list[int]:
    """The steps to score, scored in order by `score` (an adapter → its success): every `every`-th and the last;
    then, before the first of them at the target, the steps since the one before it, until one is at the target,
    so that the first pass is found to the step at the cost of at most `every` − 1 more evaluations."""
    grid = [a for a in kept if a["step"] % every == 0 or a is kept[-1]]
    success = {a["step"]: score(a) for a in grid}
    first = next((a for a in grid if success[a["step"]] >= target - 1e-9), None)
    if first is not None:
        for a in kept[max(0, first["step"] - every) : first["step"] - 1]:
            success[a["step"]] = score(a)
            if success[a["step"]] >= target - 1e-9:
                break
    return sorted(success)


def evaluate(o: E2EOptions, held: Path, adapter: str, out: Path) -> dict[str, Any]:
    """`jobs.evaluate` of one adapter on the held-out file: its success and per-task outcomes."""
    cmd = [sys.executable, "-m", "jobs.evaluate", "--config", o.config, "--tasks", str(held)]
    cmd += ["--adapter", adapter, "--out", str(out)]
    sets = {
        "model.name": o.model,
        "rollout.backend": o.mcprl_backend,
        "rollout.sampling.max_new_tokens": o.max_new_tokens,
    }
    cmd += set_args(sets)
    _run(cmd, f"evaluating {adapter} (python -m jobs.evaluate)")
    doc = json.loads(out.read_text())
    return {"success": doc["success_rate"], "outcomes": outcomes(doc["per_task"])}


def first_pass(points: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    return next((p for p in points if p["success"] >= target - 1e-9), None)


def run(opts: BenchOptions, console: Console) -> SuiteResult:
    o, _ = sizes(opts)
    q = opts.quality.smoke() if opts.quick else opts.quality
    sides = SIDES if q.trl else ("mcprl",)
    root = Path(tempfile.mkdtemp(prefix="mcprl-bench-quality-", dir="/tmp"))
    curves: dict[str, list[dict[str, Any]]] = {}
    steps_s: dict[str, list[float]] = {}
    try:
        train, held = split_tasks(o, q, root)
        console.print(
            f"tasks: {q.train_tasks} to train on, {q.held_out_tasks} held out (same templates, unseen instances)"
        )
        warm = warm_start(o, q, train, root / "warm")
        base = evaluate(o, held, str(warm), root / "warm.eval.json")
        target = base["success"] + q.target_points / 100
        console.print(f"warm start ({q.warm_steps} SFT steps): {base['success']:.1%} held out; target {target:.1%}")
        # Every step's adapter is kept (saving is outside the step times), so the first pass can be found to the step.
        more = {
            "mcprl": {**q.mcprl_sets, "finetune.init_adapter": str(warm), "train.checkpoint_every": 1},
            "TRL": {"init-adapter": str(warm), "save-every": 1},
        }
        for side in sides:
            folder = root / side
            folder.mkdir()
            o_side = o.model_copy(update={"steps": q.steps})
            console.print(f"{side}: {q.steps} GRPO steps from the warm start, scored every {q.eval_every}")
            result = (run_trl if side == "TRL" else run_mcprl)(o_side, train, folder, more[side])
            steps_s[side] = [s["step_s"] for s in result["steps"]]
            points: dict[int, dict[str, Any]] = {}

            def score(a: dict[str, Any], side: str = side, folder: Path = folder, points: dict = points) -> float:
                scored = evaluate(o, held, a["adapter"], folder / f"step_{a['step']}.eval.json")
                gain = paired_gain(base["outcomes"], scored["outcomes"])
                points[a["step"]] = {
                    **a,
                    "success": scored["success"],
                    "gain": gain.gain,
                    "ci": [gain.ci_low, gain.ci_high],
                }
                console.print(
                    f"{side} step {a['step']} ({a['train_s'] / 60:.1f} min of training): {scored['success']:.1%} "
                    f"held out, {gain.gain * 100:+.1f} points [{gain.ci_low * 100:+.1f}, {gain.ci_high * 100:+.1f}]"
                )
                return scored["success"]

            curves[side] = [points[step] for step in scan(adapters(side, result, folder), q.eval_every, target, score)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result_of(o, q, base["success"], target, curves, steps_s)


def result_of(
    o: E2EOptions,
    q: QualityOptions,
    warm: float,
    target: float,
    curves: dict[str, list[dict[str, Any]]],
    steps_s: dict[str, list[float]],
) -> SuiteResult:
    sides = [side for side in SIDES if side in curves]  # TRL's is left out with quality.trl=false
    passed = {side: first_pass(curves[side], target) for side in sides}
    trained_min = {side: math.fsum(steps_s[side]) / 60 for side in sides}
    trl = "TRL" in curves
    baseline = "TRL 1.16 GRPOTrainer" if trl else ""

    def beside(figure: str, unit: str, of: Callable[[str], Any], better: Better = "higher") -> Row:
        return Row(figure, unit, spread(of("mcprl")), spread(of("TRL")) if trl else None, baseline, better=better)

    rows = [
        beside("best held-out success", "% of tasks", lambda side: max(p["success"] for p in curves[side]) * 100),
        # the best alone would hide a side that passed the target and then lost it
        beside(f"held-out success after step {q.steps}", "% of tasks", lambda side: curves[side][-1]["success"] * 100),
        beside("training time per step", "s", lambda side: steps_s[side], better="lower"),
    ]
    label = f"training minutes to warm start + {q.target_points:g} points"
    if passed["mcprl"]:
        trl_pass = passed.get("TRL")
        rows.insert(
            0,
            Row(
                label,
                "min",
                spread(passed["mcprl"]["train_s"] / 60),
                spread(trl_pass["train_s"] / 60) if trl_pass else None,
                baseline if trl_pass else "",
                better="lower",
                goal="lower than TRL's" if trl else "",
            ),
        )

    def said(side: str) -> str:
        p = passed[side]
        if p is None:
            best = max(curves[side], key=lambda c: c["success"])
            return (
                f"{side}: not reached in {q.steps} steps ({trained_min[side]:.1f} min of training); best "
                f"{best['success']:.1%} at step {best['step']}"
            )
        return (
            f"{side}: reached at step {p['step']}, {p['train_s'] / 60:.1f} min of training: {p['success']:.1%}, "
            f"{p['gain'] * 100:+.1f} points, 95% CI [{p['ci'][0] * 100:+.1f}, {p['ci'][1] * 100:+.1f}]"
        )

    steps_note = ", ".join(f"~{statistics.median(steps_s[side]):.0f} s of {side}'s training" for side in sides[::-1])
    trainers = f"mcprl: {o.config}" + ("; TRL: bench/trl_baseline.py" if trl else "")
    notes = [
        f"Held out: {q.held_out_tasks} rule tasks of the training templates (polygon, simple) whose prompts the "
        f"{q.train_tasks} training tasks do not have; warm start {warm:.1%} after {q.warm_steps} SFT steps "
        f"(mcprl's sft_warmup), target {target:.1%}; one seed ({q.seed}).",
        *(said(side) for side in sides[::-1]),
        f"Each side's adapter is scored by `jobs.evaluate` (greedy, answer right) every {q.eval_every} steps, "
        "and before the first score at the target every step since the one scored before it, so a first pass is "
        f"found to the step (a step: {steps_note}). Training minutes sum the step times up to it "
        "(start-up, saving and evaluation left out).",
        f"Each side trains with its own algorithm as configured ({trainers}); the work and where it differs as "
        "in suite e2e.",
    ]
    if q.mcprl_sets:
        notes.append(f"mcprl's GRPO run with {set_items(q.mcprl_sets)} (quality.mcprl_sets; not its warm start)")
    if not trl:
        notes.append("TRL's side not run (quality.trl=false).")
    curve = Curve(
        "held-out success against training time",
        "minutes of training",
        "held-out success (%)",
        {
            side: [(0.0, spread(warm * 100))] + [(p["train_s"] / 60, spread(p["success"] * 100)) for p in curves[side]]
            for side in sides
        },
    )
    report = {
        "options": {"e2e": o.model_dump(), "quality": q.model_dump()},
        "warm_start_success": warm,
        "target": target,
        "reached": {
            side: passed[side] and {k: passed[side][k] for k in ("step", "train_s", "success")} for side in sides
        },
        "trained_minutes": trained_min,
        "step_s": steps_s,
        "points": curves,
    }
    return SuiteResult("quality", report, rows, [curve], notes)
