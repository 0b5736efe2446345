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

The tables and sentences are built in `jobs/report_tables.py`, the plots drawn in `jobs/report_plots.py`;
this module writes the report and re-exports both modules' public names.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jobs.report_plots import PLOTS, PlotSpec, eval_points, plot_metric
from jobs.report_tables import (
    HEADLINE_SET,
    comparison_lines,
    console_lines,
    eval_table,
    fmt_num,
    gain_sentence,
    md_cell,
    milestones,
    ordered_sets,
    set_description,
    stage_pairs,
    template_table,
)
from jobs.tracking import merge_by_step

REPORT_DIR = "report"

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


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{s}s"


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
            parts.append(f"{name} " + ", ".join(f"{fmt_num(r, pct=True)} {s}" for s, r in shown))
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
        md += [f"| {md_cell(k)} | {md_cell(fmt_num(last_row[k], pct=k.endswith(_PCT_KEYS)))} |" for k in keys]
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
        md += ["## Notes", ""] + [f"- {k}: {fmt_num(v)}" for k, v in notes.items()] + [""]

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
