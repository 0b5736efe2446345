"""The end-of-run report: `run_dir/report/` with `summary.md`, PNG plots by step and the final adapter.

`write_report(run_dir, history, evals, adapter=..., extra=...)`:

- `history`: the step records (`Tracker.history()`; records of one step are merged), keys as the
  driver logs them (`rollout/episode_reward`, `train/kl`, ...).
- `evals`: stage name → evaluation result, in the order to show (e.g. "base", "after warm start",
  "after GRPO"). Read from each result: `success_rate` (0..1), `mean_reward`, `turns` (mean turns
  per episode) and `tool_error_rates` ({tool: fraction of its calls that failed}); any of them
  missing shows as "–". `episodes` (tasks played), when present, is shown too. With `per_task`
  (jobs/evaluate.py: task_id, template, complexity, success, infra_fault per task) summary.md also
  compares the stages on the same tasks (jobs/stats.py): each stage against the one before it (and
  the last against the first, with three or more), the gain in success rate with its 95% confidence
  interval (exact paired bootstrap over tasks), the tasks gained and lost and McNemar's p; and a
  table of success per template and stage (`comparison_lines`, also printed by the driver).
- `extra`: optional; `health` is a list of findings (strings, or dicts shown as `key: value`
  pairs), `wall_time_s` the run's wall time (otherwise the sum of `timing/step_s`), `run_name`;
  any other scalar entries are listed under "Notes".

Plots (matplotlib's Agg canvas, no display needed): reward, success rate, KL and tokens/s by step,
each with the series it has (rollout and eval figures side by side); a plot with none of its
metrics in the history is skipped and summary.md says which metric was missing.
"""

from __future__ import annotations

import itertools
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jobs.stats import PairedGain, group_success, outcomes, paired_gain
from jobs.tracking import merge_by_step

REPORT_DIR = "report"

# file stem → (title, y label, [(metric, legend label)], as percent)
PLOTS: dict[str, tuple[str, str, list[tuple[str, str]], bool]] = {
    "reward": (
        "Reward",
        "mean reward",
        [("rollout/episode_reward", "rollout (episode)"), ("eval/mean_reward", "eval")],
        False,
    ),
    "success_rate": (
        "Success rate",
        "success rate (%)",
        [("rollout/success_rate", "rollout"), ("eval/success_rate", "eval")],
        True,
    ),
    "kl": ("KL to the reference", "KL", [("train/kl", "train")], False),
    "tokens_per_s": (
        "Throughput",
        "tokens / s",
        [("train/tokens_per_s", "learner"), ("rollout/tokens_per_s", "rollout")],
        False,
    ),
}

# Last-step figures shown first in summary.md (the rest follow in name order).
KEY_FIGURES = (
    "rollout/episode_reward",
    "rollout/success_rate",
    "rollout/tool_success_rate",
    "rollout/tool_timeout_rate",
    "rollout/parse_failure_rate",
    "rollout/episode_len",
    "train/policy_loss",
    "train/kl",
    "train/entropy",
    "train/grad_norm",
    "train/clip_frac",
    "train/lr",
    "train/tokens_per_s",
    "rollout/tokens_per_s",
    "timing/step_s",
)


def _num(value: Any, pct: bool = False) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if pct:
        return f"{100 * value:.1f}%"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{s}s"


def _md(text: Any) -> str:
    """A value safe inside a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def eval_table(evals: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The markdown table of the evaluation stages (see the module docstring for the keys read)."""
    lines = [
        "| stage | episodes | success rate | mean reward | turns | tool error rate |",
        "|---|---|---|---|---|---|",
    ]
    for stage, result in evals.items():
        if not isinstance(result, Mapping):
            raise TypeError(f"evals[{stage!r}] must be a mapping of results, got {type(result).__name__}")
        errors = result.get("tool_error_rates") or {}
        if not isinstance(errors, Mapping):
            raise TypeError(f"evals[{stage!r}]['tool_error_rates'] must map tool → rate, got {type(errors).__name__}")
        per_tool = ", ".join(f"{tool} {_num(rate, pct=True)}" for tool, rate in sorted(errors.items())) or "–"
        cells = [
            stage,
            _num(result.get("episodes")),
            _num(result.get("success_rate"), pct=True),
            _num(result.get("mean_reward")),
            _num(result.get("turns")),
            per_tool,
        ]
        lines.append("| " + " | ".join(_md(c) for c in cells) + " |")
    return lines


def stage_pairs(evals: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, PairedGain]]:
    """(before, after, paired gain) for each stage against the one before it, and the last against the
    first when there are three or more; only stages with `per_task` take part."""
    stages = [s for s, r in evals.items() if isinstance(r, Mapping) and r.get("per_task")]
    pairs = list(itertools.pairwise(stages))
    if len(stages) >= 3:
        pairs.append((stages[0], stages[-1]))
    tasks = {s: outcomes(evals[s]["per_task"]) for s in stages}
    return [(a, b, paired_gain(tasks[a], tasks[b])) for a, b in pairs]


def _points(x: float, sign: bool = True) -> str:
    return f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}"


def gain_sentence(before: str, after: str, g: PairedGain) -> str:
    """One line for the console: `after GRPO − after warm start: +6.2 points, 95% CI [...]`."""
    if not g.n:
        return f"{after} − {before}: no task scored in both"
    return (
        f"{after} − {before}: {_points(g.gain)} points, {g.confidence:.0%} CI [{_points(g.ci_low)}, "
        f"{_points(g.ci_high)}]; {g.gained} task(s) gained, {g.lost} lost of {g.n} (McNemar p = {g.p_value:.2g})"
    )


def comparison_lines(evals: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Markdown: the paired gains between stages and the success per template and stage ([] without
    `per_task` in any stage)."""
    pairs = stage_pairs(evals)
    per_task = {s: r["per_task"] for s, r in evals.items() if isinstance(r, Mapping) and r.get("per_task")}
    if not per_task:
        return []
    lines: list[str] = []
    if pairs:
        lines += [
            "Paired by task: the gain is the change in success rate on the tasks both stages scored; the "
            f"{pairs[0][2].confidence:.0%} CI is an exact paired bootstrap over tasks (percentile); gained = "
            "failed before and solved after, lost = the reverse; p = exact McNemar test on those two counts.",
            "",
            "| comparison | tasks | success before → after | gain (points) | 95% CI (points) | gained | lost | p |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for before, after, g in pairs:
            if not g.n:
                cells = [f"{after} − {before}", "0", "–", "–", "–", "0", "0", "–"]
            else:
                cells = [
                    f"{after} − {before}",
                    str(g.n),
                    f"{_num(g.rate_before, pct=True)} → {_num(g.rate_after, pct=True)}",
                    _points(g.gain),
                    f"[{_points(g.ci_low)}, {_points(g.ci_high)}]",
                    str(g.gained),
                    str(g.lost),
                    f"{g.p_value:.2g}",
                ]
            lines.append("| " + " | ".join(_md(c) for c in cells) + " |")
        lines.append("")
    return [*lines, "Success per template (solved / scored tasks):", "", *template_table(per_task)]


def template_table(per_task: Mapping[str, Any]) -> list[str]:
    """Markdown: one row per template (complexity, tasks) with each stage's solved / scored tasks."""
    stages = list(per_task)
    lines = [
        "| template | complexity | tasks | " + " | ".join(_md(s) for s in stages) + " |",
        "|---|---|---|" + "---|" * len(stages),
    ]
    for row in group_success(per_task):
        cells = [row.group, row.complexity, str(row.tasks)]
        for s in stages:
            n = row.scored.get(s, 0)
            k = row.successes.get(s, 0)
            cells.append(f"{k}/{n} ({100 * k / n:.0f}%)" if n else "–")
        lines.append("| " + " | ".join(_md(c) for c in cells) + " |")
    return lines


def console_lines(evals: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What the driver prints at the end of a run: the paired gains, one line each, and the template table."""
    per_task = {s: r["per_task"] for s, r in evals.items() if isinstance(r, Mapping) and r.get("per_task")}
    if not per_task:
        return []
    lines = ["paired by task (exact bootstrap 95% CI; McNemar p):"]
    lines += [f"  {gain_sentence(a, b, g)}" for a, b, g in stage_pairs(evals)]
    return [*lines, "success per template (solved / scored):", *template_table(per_task)]


def plot_metric(
    path: Path, steps_rows: list[dict[str, Any]], spec: tuple[str, str, list[tuple[str, str]], bool]
) -> list[str]:
    """Draw one plot to `path` (PNG); returns the metrics it drew ([] = nothing to draw, no file)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    title, ylabel, series, pct = spec
    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    FigureCanvasAgg(fig)  # the Agg canvas: no display, no global pyplot state
    ax = fig.add_subplot()
    drawn = []
    for key, label in series:
        points = [(r["step"], r[key]) for r in steps_rows if isinstance(r.get(key), int | float)]
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        ys = [100 * y for y in ys] if pct else list(ys)
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        drawn.append(key)
    if not drawn:
        return []
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(drawn) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    return drawn


def _health_lines(health: Any) -> list[str]:
    items = health if isinstance(health, list | tuple) else [health]
    lines = []
    for item in items:
        if isinstance(item, Mapping):
            lines.append("- " + "; ".join(f"{k}: {v}" for k, v in item.items()))
        else:
            lines.append(f"- {item}")
    return lines


def write_report(
    run_dir: Path,
    history: list[dict[str, Any]],
    evals: dict[str, dict[str, Any]],
    *,
    adapter: Path | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write run_dir/report/ (summary.md, PNG plots, adapter/) and return that folder. Writing again
    replaces the plots and summary (and the adapter copy when one is given)."""
    run_dir = Path(run_dir)
    extra = dict(extra or {})
    out = run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    rows = merge_by_step(list(history))
    run_name = extra.pop("run_name", None) or run_dir.name

    # ---------------------------------------------------------------- the paragraph
    wall = extra.pop("wall_time_s", None)
    if wall is None:
        step_times = [r["timing/step_s"] for r in rows if isinstance(r.get("timing/step_s"), int | float)]
        wall = math.fsum(step_times) if step_times else None
    md = [f"# Run report: {run_name}", ""]
    trained = [r for r in rows if any(k.startswith("train/") for k in r)]  # step 0 holds evaluations only
    if trained:
        first, last = trained[0]["step"], trained[-1]["step"]
        text = f"{len(trained)} training step{'s' if len(trained) != 1 else ''} were logged (steps {first}–{last})"
    else:
        text = "No training step was logged"
    text += f", in {_duration(wall)} of wall time." if wall is not None else "; the wall time is unknown."
    if evals:
        stages = list(evals)
        rates = [evals[s].get("success_rate") for s in stages]
        if all(isinstance(r, int | float) for r in rates):
            text += " Success rate on the evaluation tasks: " + ", ".join(
                f"{_num(r, pct=True)} {s}" for s, r in zip(stages, rates, strict=True)
            )
            text += "."
    md += [text, ""]

    # ---------------------------------------------------------------- evaluation
    md += ["## Evaluation", ""]
    md += eval_table(evals) if evals else ["No evaluation was run."]
    md.append("")
    if comparison := comparison_lines(evals):
        md += ["### Stages compared on the same tasks", "", *comparison, ""]

    # ---------------------------------------------------------------- last step
    md += ["## Last training step", ""]
    if rows:
        last_row = rows[-1]
        keys = [k for k in KEY_FIGURES if k in last_row]
        keys += sorted(k for k in last_row if k != "step" and k not in KEY_FIGURES)
        md += [f"Step {last_row['step']}.", "", "| metric | value |", "|---|---|"]
        md += [f"| {_md(k)} | {_md(_num(last_row[k], pct=k.endswith('_rate')))} |" for k in keys]
    else:
        md.append("No figures.")
    md.append("")

    # ---------------------------------------------------------------- health
    health = extra.pop("health", None)
    md += ["## Training health", ""]
    md += _health_lines(health) if health else ["No findings were reported."]
    md.append("")

    # ---------------------------------------------------------------- plots
    md += ["## Plots", ""]
    missing = []
    for stem, spec in PLOTS.items():
        path = out / f"{stem}.png"
        path.unlink(missing_ok=True)  # a stale plot from an earlier report must not survive
        if plot_metric(path, rows, spec):
            md += [f"![{spec[0]}]({stem}.png)", ""]
        else:
            missing.append(f"{spec[0]} (no {' or '.join(f'`{k}`' for k, _ in spec[2])} in the history)")
    if missing:
        md += ["Not plotted: " + "; ".join(missing) + ".", ""]

    # ---------------------------------------------------------------- adapter
    if adapter is not None:
        adapter = Path(adapter)
        if not adapter.exists():
            raise FileNotFoundError(f"write_report: the adapter {adapter} does not exist")
        dest = out / "adapter"
        if dest.exists():
            shutil.rmtree(dest)
        if adapter.is_dir():
            shutil.copytree(adapter, dest)
        else:
            dest.mkdir()
            shutil.copy2(adapter, dest / adapter.name)
        md += ["## Adapter", "", f"The final adapter is in `adapter/` (copied from `{adapter}`).", ""]

    # ---------------------------------------------------------------- the rest
    notes = {k: v for k, v in extra.items() if isinstance(v, str | int | float | bool)}
    if notes:
        md += ["## Notes", ""] + [f"- {k}: {_num(v)}" for k, v in notes.items()] + [""]

    (out / "summary.md").write_text("\n".join(md), encoding="utf-8")
    return out


__all__ = [
    "PLOTS",
    "comparison_lines",
    "console_lines",
    "eval_table",
    "gain_sentence",
    "stage_pairs",
    "template_table",
    "write_report",
]
