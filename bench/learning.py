"""Suite `learning`: does GRPO make the agent better, in every seed, and better than more supervised training?

    python -m bench --suite learning [--set learning.seeds=[0,1,2]] [--set learning.config=CFG] [--quick]

Per seed s of `learning.seeds`, two runs of `learning.config` (default configs/demo-cpu.yaml), each a fresh
`python -m jobs.train --run --fresh` process (HF_HUB_OFFLINE=1, W&B off), one after the other:
- GRPO:     the recipe as it is: base → warm start (sft_warmup.steps = S) → GRPO (train.steps), with
            train.seed=s and rollout.sampling.seed=s+1;
- SFT-more: the warm start alone, longer: train.steps=0 and sft_warmup.steps = S + extra, where
            extra = round(GRPO's time / the mean SFT step time), both from the GRPO run's metrics.jsonl
            (the sum of `timing/step_s`; `timing/sft_s` / S): the extra SFT costs what GRPO did.
Every run reads one copy of the task files (the first run generates them into the work folder; the
config's generation.seed is fixed, so every seed plays the same tasks). Each run's evals.json gives every
held-out set's success per stage and per task; jobs/stats.py pairs the stages by task (gain, 95% CI, tasks
gained and lost): GRPO − warm start, SFT-more − warm start, GRPO − SFT-more. Goals per seed: validation
gain ≥ 15 points with its CI above 0, validation success after GRPO ≥ 60%, the transfer CI's upper end ≥ 0
(GRPO costs no transfer); across seeds, the mean of each figure and how many seeds met each goal.

Files: out/learning.json, out/learning.md (figures over seeds: median [min, max]; per-seed lines below it),
out/learning.png (drawn here: per seed, grouped bars of each set's success) and out/learning-work/ (the
runs themselves: evals.json, metrics.jsonl, report; and seed-<s>.json, each finished seed's result).

A seed takes about an hour on 2 cores, so the suite can be run a seed at a time
(`--set learning.seeds=[1]`): a seed whose seed-<s>.json was written for the same recipe (the config as it
loads and the overrides, recipe.json) is read back, not rerun; `--set learning.reuse=false`, or another recipe,
empties the work folder first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.options import BenchOptions, LearningOptions
from bench.results import Row, SuiteResult, machine, spread
from cluster.local_cluster import ROOT, clean_env
from configs.loader import load_config, set_args
from jobs.held_out import EVAL_SETS
from jobs.stats import outcomes, paired_gain

WORK = "learning-work"
WARM, AFTER_GRPO = "after warm start", "after GRPO"
GAIN_GOAL, SUCCESS_GOAL = 0.15, 0.60
STAGE_KEYS = ("success_rate", "calls_right_rate", "mean_reward", "tasks", "step")
GOALS = {  # key → what it says (the table and notes)
    "validation_gain": f"validation GRPO − warm start ≥ {GAIN_GOAL * 100:.0f} pts, CI above 0",
    "validation_success": f"validation success after GRPO ≥ {SUCCESS_GOAL:.0%}",
    "transfer_kept": "transfer GRPO − warm start CI upper end ≥ 0",
    "grpo_beats_sft_more": "validation GRPO − SFT-more CI above 0",
}


def sizes(opts: BenchOptions) -> LearningOptions:
    return opts.learning.smoke() if opts.quick else opts.learning


def shared_data(config: Path, data_dir: Path) -> dict[str, str]:
    """`data.*` overrides pointing every run at one copy of the rule tasks (same file names, so the generator's
    `<stem>.<split>.jsonl` naming holds); none when the config reads fixed files."""
    cfg = load_config(config)
    if cfg.data.generate != "rule":
        return {}
    keys = ("train", "validation", "transfer")
    return {f"data.{k}": str(data_dir / Path(getattr(cfg.data, k)).name) for k in keys if getattr(cfg.data, k)}


def train_run(o: LearningOptions, name: str, storage: Path, seed: int, sets: dict[str, Any]) -> dict[str, Any]:
    """One `jobs.train` process; its wall time, timings (metrics.jsonl) and evaluations (evals.json)."""
    sets = {
        "run_name": name,
        "train.storage": str(storage),
        "train.seed": seed,
        "rollout.sampling.seed": seed + 1,
        "logging.wandb": "off",
        **o.sets,
        **sets,  # this run's own (the SFT-more run's train.steps=0) over the suite's
    }
    cmd = [sys.executable, "-m", "jobs.train", "--config", o.config, "--run", "--fresh"]
    cmd += set_args(sets)
    env = clean_env({"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")})
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=o.run_timeout_s)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        tail = (proc.stdout[-2000:] + "\n" + proc.stderr[-4000:]).strip()
        raise RuntimeError(f"learning: run {name} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    run_dir = storage / name
    evals_path = run_dir / "evals.json"
    if not evals_path.is_file():
        raise RuntimeError(f"learning: run {name} wrote no {evals_path} (jobs/train.py Driver._evaluate writes it)")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"run_name": name, "run_dir": str(run_dir), "wall_s": wall, **timings(records), "evals": evals_path}


def timings(records: list[dict[str, Any]]) -> dict[str, Any]:
    """SFT steps and the warm start's seconds (the tracker's `sft` phase), GRPO steps and their seconds."""
    steps = [r["timing/step_s"] for r in records if "timing/step_s" in r]
    return {
        "sft_steps": sum("sft/step" in r for r in records),
        "sft_s": sum(r.get("timing/sft_s", 0.0) for r in records),
        "grpo_steps": len(steps),
        "grpo_s": sum(steps),
    }


def stage_figures(evals: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """set → stage → the headline numbers (the per-task lists stay in the run's evals.json)."""
    return {s: {stage: {k: r.get(k) for k in STAGE_KEYS} for stage, r in stages.items()} for s, stages in evals.items()}


def gain(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """`after` − `before`, paired by task (jobs/stats.py)."""
    return dataclasses.asdict(paired_gain(outcomes(before["per_task"]), outcomes(after["per_task"])))


def stage(evals: dict[str, dict[str, Any]], name: str, set_name: str, stage_name: str) -> dict[str, Any]:
    try:
        return evals[set_name][stage_name]
    except KeyError:
        have = {s: list(v) for s, v in evals.items()}
        raise RuntimeError(f"learning: run {name} has no {set_name!r} stage {stage_name!r}; it has {have}") from None


def one_seed(o: LearningOptions, seed: int, storage: Path, data: dict[str, str], console: Console) -> dict[str, Any]:
    """The seed's GRPO run, then its SFT-more run sized by the first's timings, and their comparisons."""
    grpo = train_run(o, f"learning-s{seed}-grpo", storage, seed, data)
    if not grpo["sft_steps"] or not grpo["sft_s"] or not grpo["grpo_steps"]:
        raise RuntimeError(f"learning: {o.config} must run a warm start and GRPO steps; the run logged {grpo}")
    sft_step_s = grpo["sft_s"] / grpo["sft_steps"]
    extra = round(grpo["grpo_s"] / sft_step_s)
    console.print(
        f"seed {seed}: GRPO {grpo['grpo_steps']} steps in {grpo['grpo_s']:.1f} s; an SFT step {sft_step_s:.2f} s "
        f"→ SFT-more: {grpo['sft_steps']} + {extra} SFT steps"
    )
    sets = {**data, "train.steps": 0, "sft_warmup.steps": grpo["sft_steps"] + extra}
    more = train_run(o, f"learning-s{seed}-sft-more", storage, seed, sets)
    g_evals, m_evals = (json.loads(r.pop("evals").read_text()) for r in (grpo, more))
    grpo["stages"], more["stages"] = stage_figures(g_evals), stage_figures(m_evals)

    by_set: dict[str, dict[str, Any]] = {}
    for set_name in g_evals:
        warm = stage(g_evals, grpo["run_name"], set_name, WARM)
        after = stage(g_evals, grpo["run_name"], set_name, AFTER_GRPO)
        sft = stage(m_evals, more["run_name"], set_name, WARM)  # train.steps=0: its last stage is the warm start's
        by_set[set_name] = {
            "description": EVAL_SETS.get(set_name, warm.get("description", set_name)),
            "tasks": warm["tasks"],
            "warm_start": warm["success_rate"],
            "after_grpo": after["success_rate"],
            "sft_more": sft["success_rate"],
            "grpo_vs_warm": gain(warm, after),
            "sft_more_vs_warm": gain(warm, sft),
            "grpo_vs_sft_more": gain(sft, after),
        }
    val, tra = by_set.get("validation"), by_set.get("transfer")
    goals = {
        "validation_gain": bool(val)
        and val["grpo_vs_warm"]["gain"] >= GAIN_GOAL - 1e-9
        and val["grpo_vs_warm"]["ci_low"] > 0,
        "validation_success": bool(val) and val["after_grpo"] >= SUCCESS_GOAL - 1e-9,
        "transfer_kept": None if tra is None else tra["grpo_vs_warm"]["ci_high"] >= 0,  # None: no transfer set
        "grpo_beats_sft_more": bool(val) and val["grpo_vs_sft_more"]["ci_low"] > 0,
    }
    return {
        "seed": seed,
        "runs": {"grpo": grpo, "sft_more": more},
        "sft_step_s": sft_step_s,
        "extra_sft_steps": extra,
        "grpo_s": grpo["grpo_s"],
        "extra_sft_s": more["sft_s"] - grpo["sft_s"],  # the difference: both runs' first, slow step cancels
        "sets": by_set,
        "goals": goals,
    }


FIGURES = ("warm_start", "after_grpo", "sft_more")
GAINS = ("grpo_vs_warm", "sft_more_vs_warm", "grpo_vs_sft_more")
LABELS = {
    "warm_start": "warm start",
    "after_grpo": "after GRPO",
    "sft_more": "SFT-more",
    "grpo_vs_warm": "GRPO − warm start",
    "sft_more_vs_warm": "SFT-more − warm start",
    "grpo_vs_sft_more": "GRPO − SFT-more",
}


def across(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of each figure over seeds, and how many seeds met each goal (of those where it applies)."""
    mean: dict[str, Any] = {
        k: statistics.fmean(s[k] for s in seeds) for k in ("grpo_s", "extra_sft_s", "extra_sft_steps")
    }
    for set_name in seeds[0]["sets"]:
        per = [s["sets"][set_name] for s in seeds]
        mean[set_name] = {k: statistics.fmean(p[k] for p in per) for k in FIGURES}
        mean[set_name] |= {k: statistics.fmean(p[k]["gain"] for p in per) for k in GAINS}
    met = {
        g: {"met": sum(s["goals"][g] is True for s in seeds), "of": sum(s["goals"][g] is not None for s in seeds)}
        for g in GOALS
    }
    return {"mean": mean, "goals_met": met}


def pct(x: float) -> str:
    return f"{x:.1%}"


def pts(g: dict[str, Any]) -> str:
    return (
        f"{g['gain'] * 100:+.1f} pts (95% CI [{g['ci_low'] * 100:+.1f}, {g['ci_high'] * 100:+.1f}], "
        f"{g['gained']} gained / {g['lost']} lost)"
    )


def seed_lines(s: dict[str, Any]) -> list[str]:
    lines = []
    for set_name, f in s["sets"].items():
        lines.append(
            f"seed {s['seed']}, {set_name} ({f['tasks']} tasks): warm start {pct(f['warm_start'])} → after GRPO "
            f"{pct(f['after_grpo'])}: {pts(f['grpo_vs_warm'])}; SFT-more {pct(f['sft_more'])}: "
            f"{pts(f['sft_more_vs_warm'])} vs warm start; GRPO − SFT-more {pts(f['grpo_vs_sft_more'])}"
        )
    g, m = s["runs"]["grpo"], s["runs"]["sft_more"]
    lines.append(
        f"seed {s['seed']}, time: GRPO {g['grpo_steps']} steps in {s['grpo_s']:.1f} s; SFT-more {m['sft_steps']} SFT "
        f"steps ({g['sft_steps']} + {s['extra_sft_steps']}), the extra ones in {s['extra_sft_s']:.1f} s "
        f"(an SFT step: {s['sft_step_s']:.2f} s); whole runs {g['wall_s']:.0f} s and {m['wall_s']:.0f} s"
    )
    met = ", ".join(f"{GOALS[k]}: {'–' if v is None else 'yes' if v else 'no'}" for k, v in s["goals"].items())
    lines.append(f"seed {s['seed']}, goals: {met}")
    return lines


def table_rows(seeds: list[dict[str, Any]], summary: dict[str, Any]) -> list[Row]:
    """One row per figure, its spread over seeds (no baseline column: the comparisons are rows of their own,
    paired by task, which a ratio of two rates would hide)."""
    met = summary["goals_met"]

    def count(goal: str) -> str:
        return f"{met[goal]['met']}/{met[goal]['of']} seeds"

    goal_of = {
        ("validation", "after_grpo"): f"≥ {SUCCESS_GOAL:.0%}: {count('validation_success')}",
        ("validation", "grpo_vs_warm"): f"≥ {GAIN_GOAL * 100:.0f}, CI > 0: {count('validation_gain')}",
        ("validation", "grpo_vs_sft_more"): f"CI > 0: {count('grpo_beats_sft_more')}",
        ("transfer", "grpo_vs_warm"): f"CI upper ≥ 0: {count('transfer_kept')}",
    }
    rows = []
    for set_name in seeds[0]["sets"]:
        for k in FIGURES:
            values = [s["sets"][set_name][k] * 100 for s in seeds]
            rows.append(
                Row(f"{set_name}: success, {LABELS[k]}", "%", spread(values), goal=goal_of.get((set_name, k), ""))
            )
        for k in GAINS:
            values = [s["sets"][set_name][k]["gain"] * 100 for s in seeds]
            rows.append(Row(f"{set_name}: {LABELS[k]}", "points", spread(values), goal=goal_of.get((set_name, k), "")))
    rows.append(Row("GRPO wall time (its steps)", "s", spread([s["grpo_s"] for s in seeds]), better="lower"))
    rows.append(Row("extra SFT wall time (SFT-more)", "s", spread([s["extra_sft_s"] for s in seeds]), better="lower"))
    return rows


def notes(o: LearningOptions, seeds: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    first = seeds[0]
    out = [f"Held-out set `{n}`: {f['description']}." for n, f in first["sets"].items()]
    overrides = f" with {o.sets}" if o.sets else ""
    out.append(
        f"{o.config}{overrides}, seeds {o.seeds}. Per seed: GRPO = the recipe (warm start, then GRPO); warm start = "
        "that run's evaluation after its warm start; SFT-more = a second run with no GRPO and the warm start extended "
        "by as many SFT steps as GRPO's wall time buys (its mean SFT step). Gains are paired by task (jobs/stats.py: "
        "exact bootstrap 95% CI). The table: median [min, max] over seeds."
    )
    for s in seeds:
        out += seed_lines(s)
    for set_name, m in summary["mean"].items():
        if isinstance(m, dict):
            figures = ", ".join(f"{LABELS[k]} {pct(m[k])}" for k in FIGURES)
            gains = ", ".join(f"{LABELS[k]} {m[k] * 100:+.1f} pts" for k in GAINS)
            out.append(f"mean over {len(seeds)} seed(s), {set_name}: {figures}; {gains}")
    met = summary["goals_met"]
    out.append("goals met: " + "; ".join(f"{GOALS[g]}: {met[g]['met']}/{met[g]['of']} seeds" for g in GOALS))
    return out


def chart(seeds: list[dict[str, Any]], path: Path) -> None:
    """Per seed, grouped bars of success (warm start, after GRPO, SFT-more); one panel per held-out set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    set_names = list(seeds[0]["sets"])
    width = max(5.5, 1.5 + 1.6 * len(seeds))
    fig, axes = plt.subplots(1, len(set_names), figsize=(width * len(set_names), 4), squeeze=False)
    colors = {"warm_start": "#bbb", "after_grpo": "#2a6", "sft_more": "#48c"}
    for ax, set_name in zip(axes[0], set_names, strict=True):
        for j, k in enumerate(FIGURES):
            xs = [i + (j - 1) * 0.27 for i in range(len(seeds))]
            ys = [s["sets"][set_name][k] * 100 for s in seeds]
            bars = ax.bar(xs, ys, 0.25, color=colors[k], label=LABELS[k])
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        if set_name == "validation":  # the headline goal, for the eye
            ax.axhline(SUCCESS_GOAL * 100, color="#999", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(seeds)), [f"seed {s['seed']}" for s in seeds])
        ax.set_ylim(0, 105)
        ax.set_ylabel("success (final answer right), %")
        ax.set_title(f"{set_name}: {seeds[0]['sets'][set_name]['tasks']} tasks", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("suite learning: GRPO against its warm start and against SFT for the same wall time", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recipe(o: LearningOptions) -> dict[str, Any]:
    """What a seed's result depends on besides its seed: the config as it loads (comments and layout aside)
    and the runs' overrides."""
    loaded = json.dumps(load_config(ROOT / o.config).model_dump(mode="json"), sort_keys=True)
    return {"config": o.config, "config_sha256": hashlib.sha256(loaded.encode()).hexdigest(), "sets": o.sets}


def open_work(o: LearningOptions, work: Path) -> None:
    """The work folder for this recipe: kept when it holds the same recipe's seeds (and `reuse`), else emptied
    (the task files and runs of another recipe must not mix with this one's)."""
    mark = work / "recipe.json"
    want = recipe(o)
    if not (o.reuse and mark.is_file() and json.loads(mark.read_text()) == want):
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    mark.write_text(json.dumps(want, indent=1))


def seed_result(o: LearningOptions, seed: int, work: Path, data: dict[str, str], console: Console) -> dict[str, Any]:
    """The seed's result: read back from an earlier invocation of this recipe, or run now and written."""
    path = work / f"seed-{seed}.json"
    if path.is_file():
        done = json.loads(path.read_text())
        console.print(f"seed {seed}: finished {done['finished']}, read from {path} (learning.reuse=false reruns it)")
        return done
    result = one_seed(o, seed, (work / "runs").resolve(), data, console)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    path.write_text(json.dumps(result, indent=1))
    return result


def run(opts: BenchOptions, console: Console) -> SuiteResult:
    """Run the suite (see the module doc); it draws its own chart (results.chart has no grouped bars)."""
    o = sizes(opts)
    work = opts.out / WORK
    open_work(o, work)
    data = shared_data(ROOT / o.config, (work / "data").resolve())
    seeds = [seed_result(o, seed, work, data, console) for seed in o.seeds]
    summary = across(seeds)
    lines = notes(o, seeds, summary)
    for line in lines:
        console.print(line)
    opts.out.mkdir(parents=True, exist_ok=True)
    chart(seeds, opts.out / "learning.png")
    console.print(f"wrote {opts.out / 'learning.png'}")
    report = {
        "machine": machine(),
        "options": o.model_dump(),
        "quick": opts.quick,
        "work": str(work.resolve()),
        "goals": GOALS,
        "seeds": seeds,
        **summary,
    }
    return SuiteResult("learning", report, table_rows(seeds, summary), notes=lines)
