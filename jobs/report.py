"""The end-of-run report: `run_dir/report/` with `summary.md`, PNG plots by step and the final adapter.

`write_report(run_dir, history, evals, adapter=..., extra=...)`:

- `history`: the step records (`Tracker.history()`; records of one step are merged), keys as the
  driver logs them (`rollout/episode_reward`, `train/kl`, ...).
- `evals`: eval set name → {stage name → evaluation result}, stages in the order they ran. Sets are
  e.g. "validation" (held-out instances of the training templates: the headline, always shown
  first) and "transfer" (templates never trained on); any other name is shown too, in the given
  order. Stages are the milestones ("base", "after warm start", "after GRPO", ...) and, with
  `periodic: True`, the evaluations every k steps ("step 5", ...). Read from each result:
  `success_rate` (share of tasks whose final answer is right: what success means),
  `calls_right_rate` (share whose expected tool calls all ran), `mean_reward`, `turns`,
  `tool_error_rates` ({tool: fraction of its calls that failed}), `episodes`, `step` (the GRPO
  step it was taken at), `description` (what the set is); any of them missing shows as "–". With
  `per_task` (jobs/evaluate.py: task_id, template, complexity, success, calls_right, infra_fault)
  summary.md also compares the milestone stages on the same tasks (jobs/stats.py): each against the
  one before it (and the last against the first, with three or more), the gain in success rate
  with its 95% confidence interval (exact paired bootstrap over tasks), the tasks gained and lost
  and McNemar's p; and a table of success per template and stage (`comparison_lines`; the driver
  prints `console_lines`). Periodic stages are plotted, never compared: they are many, and
  comparing each would multiply the chances of a spurious "significant" gain.
- `extra`: optional; `health` is a list of findings (strings, or dicts shown as `key: value`
  pairs), `wall_time_s` the run's wall time (otherwise the sum of `timing/step_s`), `run_name`;
  any other scalar entries are listed under "Notes".

Plots (matplotlib's Agg canvas, no display needed): success rate (the rollouts' per step against
each eval set's held-out success at its evaluations' steps), reward, groups kept by the outcome
filter, KL and tokens/s by step. A plot with nothing to draw is skipped and summary.md says which
metric was missing; so it does when a plot lacks its main series (e.g. no rollout success).
"""

from __future__ import annotations

import itertools
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.stats import PairedGain, group_success, outcomes, paired_gain
from jobs.tracking import merge_by_step

REPORT_DIR = "report"
HEADLINE_SET = "validation"  # shown first everywhere: the held-out figure the run is judged by


@dataclass(frozen=True)
class PlotSpec:
    """One plot: history series by step and, with `eval_figure`, each eval set's `result[eval_figure]`
    at its evaluations' steps. The first of `series` is the plot's main one (its absence is noted)."""

    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]  # (history key, legend label)
    pct: bool = False
    eval_figure: str | None = None
    thin: tuple[str, ...] = ()  # secondary history series, drawn thin and dashed


PLOTS: dict[str, PlotSpec] = {
    "success_rate": PlotSpec(
        "Success (final answer right): training rollouts vs held-out evaluations",
        "success rate (%)",
        (
            ("rollout/success_rate", "training rollouts (answer right)"),
            ("rollout/calls_right_rate", "training rollouts (tool calls right)"),
        ),
        pct=True,
        eval_figure="success_rate",
        thin=("rollout/calls_right_rate",),
    ),
    "reward": PlotSpec(
        "Mean reward: training rollouts vs held-out evaluations",
        "mean reward",
        (("rollout/episode_reward", "training rollouts (episode)"),),
        eval_figure="mean_reward",
    ),
    "groups_kept": PlotSpec(
        "GRPO groups kept by the outcome filter",
        "groups kept (%)",
        (("rollout/groups_kept", "kept"),),
        pct=True,
    ),
    "kl": PlotSpec("KL to the reference", "KL", (("train/kl", "train"),)),
    "tokens_per_s": PlotSpec(
        "Throughput", "tokens / s", (("train/tokens_per_s", "learner"), ("rollout/tokens_per_s", "rollout"))
    ),
}

# Last-step figures shown first in summary.md (the rest follow in name order).
KEY_FIGURES = (
    "rollout/episode_reward",
    "rollout/success_rate",
    "rollout/calls_right_rate",
    "rollout/groups_kept",
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
_PCT_KEYS = ("_rate", "/groups_kept")  # key endings shown as percent


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


# --------------------------------------------------------------------------- eval sets and stages


def ordered_sets(evals: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The eval set names, the headline set first, then the rest in the given order; refuses the old
    flat {stage: result} shape, which would otherwise be read as sets of garbage."""
    for name, stages in evals.items():
        if not isinstance(stages, Mapping) or not all(isinstance(r, Mapping) for r in stages.values()):
            raise TypeError(f"evals[{name!r}] must map stage → result (evals is {{set: {{stage: result}}}})")
    return sorted(evals, key=lambda name: name != HEADLINE_SET)  # stable: the others keep their order


def set_description(name: str, stages: Mapping[str, Mapping[str, Any]]) -> str:
    """What the set is: the first `description` its results carry, else its name."""
    for result in stages.values():
        if result.get("description"):
            return f"{name}: {result['description']}"
    return name


def milestones(stages: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The stages that are not periodic evaluations (those every k steps)."""
    return {s: r for s, r in stages.items() if not r.get("periodic")}


def eval_table(stages: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The markdown table of one set's stages (see the module docstring for the keys read)."""
    lines = [
        "| stage | step | episodes | success (answer right) | calls right | mean reward | turns | tool error rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stage, result in stages.items():
        if not isinstance(result, Mapping):
            raise TypeError(f"stage {stage!r} must be a mapping of results, got {type(result).__name__}")
        errors = result.get("tool_error_rates") or {}
        if not isinstance(errors, Mapping):
            raise TypeError(f"stage {stage!r}: 'tool_error_rates' must map tool → rate, got {type(errors).__name__}")
        per_tool = ", ".join(f"{tool} {_num(rate, pct=True)}" for tool, rate in sorted(errors.items())) or "–"
        cells = [
            f"{stage} (periodic)" if result.get("periodic") else stage,
            _num(result.get("step")),
            _num(result.get("episodes")),
            _num(result.get("success_rate"), pct=True),
            _num(result.get("calls_right_rate"), pct=True),
            _num(result.get("mean_reward")),
            _num(result.get("turns")),
            per_tool,
        ]
        lines.append("| " + " | ".join(_md(c) for c in cells) + " |")
    return lines


def stage_pairs(stages: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, PairedGain]]:
    """(before, after, paired gain) for one set's milestone stages: each against the one before it, and
    the last against the first when there are three or more; only stages with `per_task` take part."""
    names = [s for s, r in milestones(stages).items() if r.get("per_task")]
    pairs = list(itertools.pairwise(names))
    if len(names) >= 3:
        pairs.append((names[0], names[-1]))
    tasks = {s: outcomes(stages[s]["per_task"]) for s in names}
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


def _milestone_per_task(stages: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    return {s: r["per_task"] for s, r in milestones(stages).items() if r.get("per_task")}


def comparison_lines(stages: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Markdown for one set: the paired gains between milestone stages and the success per template
    and milestone stage ([] without `per_task` in any milestone)."""
    per_task = _milestone_per_task(stages)
    if not per_task:
        return []
    pairs = stage_pairs(stages)
    lines: list[str] = []
    if pairs:
        lines += [
            "Paired by task: the gain is the change in success rate (final answer right) on the tasks both "
            f"stages scored; the {pairs[0][2].confidence:.0%} CI is an exact paired bootstrap over tasks "
            "(percentile); gained = failed before and solved after, lost = the reverse; p = exact McNemar test "
            "on those two counts. Periodic evaluations are not compared.",
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
    return [*lines, "Success per template (answer right: solved / scored tasks):", "", *template_table(per_task)]


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


def console_lines(evals: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """What the driver prints at the end of a run, per eval set (the headline first): a header, the
    paired gains between milestone stages, one line each, and the template table."""
    lines: list[str] = []
    for name in ordered_sets(evals):
        per_task = _milestone_per_task(evals[name])
        if not per_task:
            continue
        lines.append(f"== {set_description(name, evals[name])}")
        lines.append("paired by task (exact bootstrap 95% CI; McNemar p):")
        lines += [f"  {gain_sentence(a, b, g)}" for a, b, g in stage_pairs(evals[name])]
        lines += ["success per template (answer right: solved / scored):", *template_table(per_task)]
    return lines


# --------------------------------------------------------------------------- plots


def eval_points(stages: Mapping[str, Mapping[str, Any]], figure: str) -> list[tuple[str, float, float]]:
    """(stage, step, value) of each stage that has a numeric `step` and `figure`, in stage order."""
    out = []
    for stage, r in stages.items():
        step, value = r.get("step"), r.get(figure)
        if isinstance(step, int | float) and isinstance(value, int | float) and not isinstance(value, bool):
            out.append((stage, float(step), float(value)))
    return out


def plot_metric(
    path: Path,
    steps_rows: list[dict[str, Any]],
    spec: PlotSpec,
    evals: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
) -> dict[str, list[float]]:
    """Draw one plot to `path` (PNG); returns legend label → the steps drawn ({} = nothing, no file).

    Each eval set is one line with markers; its first stage (base) also gets a hollow square and its
    name, and when another stage shares its step (warm start is at step 0 too) it is left off the
    line, so the line starts where GRPO starts and the untrained point stays visible."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    scale = 100.0 if spec.pct else 1.0
    fig = Figure(figsize=(7.2, 4.0), dpi=100)
    FigureCanvasAgg(fig)  # the Agg canvas: no display, no global pyplot state
    ax = fig.add_subplot()
    drawn: dict[str, list[float]] = {}
    for i, (key, label) in enumerate(spec.series):
        points = [(r["step"], r[key]) for r in steps_rows if isinstance(r.get(key), int | float)]
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        if key in spec.thin:
            style: dict[str, Any] = {"linestyle": "--", "linewidth": 1.0, "alpha": 0.7}
        else:
            style = {"marker": "o" if len(xs) < 30 else None, "markersize": 3}
        color = "C0" if spec.eval_figure else f"C{i}"  # with eval lines: one colour for the rollouts' figures
        ax.plot(xs, [scale * y for y in ys], color=color, label=label, **style)
        drawn[label] = list(xs)
    if spec.eval_figure and evals:
        colors = (f"C{i}" for i in itertools.count(1))
        for name in ordered_sets(evals):
            pts = eval_points(evals[name], spec.eval_figure)
            if not pts:
                continue
            color = next(colors)
            first, rest = pts[0], pts[1:]
            ax.plot(
                [first[1]],
                [scale * first[2]],
                linestyle="none",
                marker="s",
                markersize=9,
                color=color,
                markerfacecolor="none",
                markeredgewidth=1.5,
            )
            ax.annotate(
                first[0],
                (first[1], scale * first[2]),
                textcoords="offset points",
                xytext=(7, -12),
                color=color,
                fontsize=8,
            )
            drawn[f"held-out {name}: {first[0]}"] = [first[1]]
            # base and warm start share step 0: a line between them would be a vertical jump, not progress
            line = rest if rest and any(p[1] == first[1] for p in rest) else pts
            ax.plot(
                [p[1] for p in line],
                [scale * p[2] for p in line],
                marker="o",
                markersize=5,
                linewidth=2,
                color=color,
                label=f"held-out {name}",
            )
            drawn[f"held-out {name}"] = [p[1] for p in line]
    if not drawn:
        return {}
    ax.set_title(spec.title, fontsize=10)
    ax.set_xlabel("GRPO step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(spec.ylabel)
    if spec.pct:
        ax.set_ylim(-3, 103)  # the whole 0–100% range: a move of a few points must not look like a leap
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
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


def _headline(evals: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """The paragraph's sentence on held-out success: each set's milestone stages, in order."""
    parts = []
    for name in ordered_sets(evals):
        shown = [(s, r.get("success_rate")) for s, r in milestones(evals[name]).items()]
        shown = [(s, r) for s, r in shown if isinstance(r, int | float)]
        if shown:
            parts.append(f"{name} " + ", ".join(f"{_num(r, pct=True)} {s}" for s, r in shown))
    return " Held-out success (final answer right): " + "; ".join(parts) + "." if parts else ""


def write_report(
    run_dir: Path,
    history: list[dict[str, Any]],
    evals: Mapping[str, Mapping[str, Mapping[str, Any]]],
    *,
    adapter: Path | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write run_dir/report/ (summary.md, PNG plots, adapter/) and return that folder. `evals` is
    {set: {stage: result}} (module docstring). Writing again replaces the plots and summary (and the
    adapter copy when one is given)."""
    run_dir = Path(run_dir)
    extra = dict(extra or {})
    sets = ordered_sets(evals)
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
    md += [text + _headline(evals), ""]

    # ---------------------------------------------------------------- evaluation
    md += ["## Evaluation", ""]
    if not any(evals[name] for name in sets):
        md += ["No evaluation was run.", ""]
    for name in sets:
        stages = evals[name]
        if not stages:
            continue
        md += [f"### {set_description(name, stages)}", "", *eval_table(stages), ""]
        if comparison := comparison_lines(stages):
            md += [f"#### {name}: milestone stages compared on the same tasks", "", *comparison, ""]

    # ---------------------------------------------------------------- last step
    md += ["## Last training step", ""]
    if rows:
        last_row = rows[-1]
        keys = [k for k in KEY_FIGURES if k in last_row]
        keys += sorted(k for k in last_row if k != "step" and k not in KEY_FIGURES)
        md += [f"Step {last_row['step']}.", "", "| metric | value |", "|---|---|"]
        md += [f"| {_md(k)} | {_md(_num(last_row[k], pct=k.endswith(_PCT_KEYS)))} |" for k in keys]
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
    missing, partial = [], []
    for stem, spec in PLOTS.items():
        path = out / f"{stem}.png"
        path.unlink(missing_ok=True)  # a stale plot from an earlier report must not survive
        drawn = plot_metric(path, rows, spec, evals)
        main_key, main_label = spec.series[0]
        if drawn:
            md += [f"![{spec.title}]({stem}.png)", ""]
            if main_label not in drawn:
                partial.append(f"{spec.title} has no {main_label} line (no `{main_key}` in the history)")
        else:
            what = " or ".join(f"`{k}`" for k, _ in spec.series) + " in the history"
            if spec.eval_figure:
                what += f", no evaluation with `step` and `{spec.eval_figure}`"
            missing.append(f"{spec.title} (no {what})")
    if partial:
        md += ["Incomplete: " + "; ".join(partial) + ".", ""]
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
    "HEADLINE_SET",
    "KEY_FIGURES",
    "PLOTS",
    "PlotSpec",
    "comparison_lines",
    "console_lines",
    "eval_points",
    "eval_table",
    "gain_sentence",
    "milestones",
    "ordered_sets",
    "plot_metric",
    "set_description",
    "stage_pairs",
    "template_table",
    "write_report",
]
