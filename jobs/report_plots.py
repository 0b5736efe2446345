"""The report's PNG plots (jobs/report.py): what each plot draws (`PLOTS`) and the drawing, on matplotlib's
Agg canvas (no display needed)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.report_tables import ordered_sets


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
