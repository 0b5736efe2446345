"""The report's tables and sentences (jobs/report.py): eval sets and their stages, the milestone stages
compared on the same tasks (jobs/stats.py), success per template, the console's lines, and the number
formatting they share with the summary."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from jobs.stats import PairedGain, group_success, outcomes, paired_gain

HEADLINE_SET = "validation"  # shown first everywhere: the held-out figure the run is judged by


def fmt_num(value: Any, pct: bool = False) -> str:
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


def md_cell(text: Any) -> str:
    """A value safe inside a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


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
        per_tool = ", ".join(f"{tool} {fmt_num(rate, pct=True)}" for tool, rate in sorted(errors.items())) or "–"
        cells = [
            f"{stage} (periodic)" if result.get("periodic") else stage,
            fmt_num(result.get("step")),
            fmt_num(result.get("episodes")),
            fmt_num(result.get("success_rate"), pct=True),
            fmt_num(result.get("calls_right_rate"), pct=True),
            fmt_num(result.get("mean_reward")),
            fmt_num(result.get("turns")),
            per_tool,
        ]
        lines.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
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
                    f"{fmt_num(g.rate_before, pct=True)} → {fmt_num(g.rate_after, pct=True)}",
                    _points(g.gain),
                    f"[{_points(g.ci_low)}, {_points(g.ci_high)}]",
                    str(g.gained),
                    str(g.lost),
                    f"{g.p_value:.2g}",
                ]
            lines.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
        lines.append("")
    return [*lines, "Success per template (answer right: solved / scored tasks):", "", *template_table(per_task)]


def template_table(per_task: Mapping[str, Any]) -> list[str]:
    """Markdown: one row per template (complexity, tasks) with each stage's solved / scored tasks."""
    stages = list(per_task)
    lines = [
        "| template | complexity | tasks | " + " | ".join(md_cell(s) for s in stages) + " |",
        "|---|---|---|" + "---|" * len(stages),
    ]
    for row in group_success(per_task):
        cells = [row.group, row.complexity, str(row.tasks)]
        for s in stages:
            n = row.scored.get(s, 0)
            k = row.successes.get(s, 0)
            cells.append(f"{k}/{n} ({100 * k / n:.0f}%)" if n else "–")
        lines.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
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
