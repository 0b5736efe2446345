"""A training run's held-out evaluations (jobs/train.py): which sets it plays, one console line per set, the
figures it logs, and the milestones printed when the run ends. `jobs/evaluate.py` plays the episodes."""

from __future__ import annotations

from typing import Any

from configs.schema import Config
from jobs.evaluate import evaluate_rows, greedy

# What each held-out set measures (the report and evals.json say it beside the figures).
EVAL_SETS = {
    "validation": "held-out instances (tickers, phrasings) of the training templates",
    "transfer": "templates never trained on",
}


def eval_figures(result: dict[str, Any], name: str) -> dict[str, float]:
    """An evaluation's numbers as `eval/<set>/...` metrics (its per-task and per-tool tables stay out of the log)."""
    skip = ("step",)
    return {
        f"eval/{name}/{k}": v
        for k, v in result.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k not in skip
    }


def eval_sets(cfg: Config, pf: Any, periodic: bool) -> dict[str, list[dict[str, Any]]]:
    """The held-out sets, headline first: validation (data.validation) and transfer (data.transfer). The
    evaluations every eval_every steps play the headline set only: they draw its curve."""
    n = cfg.train.eval_tasks
    sets = {"validation": pf.validation_rows[:n], "transfer": [] if periodic else pf.transfer_rows[:n]}
    return {name: rows for name, rows in sets.items() if rows}


async def play_held_out(
    cfg: Config, pf: Any, rollout: Any, tracker: Any, label: str, step: int, periodic: bool = False
) -> dict[str, dict[str, Any]]:
    """Every held-out set played greedily by the engines' current policy: {set: result}, one console line
    each. Each result records the GRPO step it was taken at (the report's curve)."""
    out: dict[str, dict[str, Any]] = {}
    for name, rows in eval_sets(cfg, pf, periodic).items():
        with tracker.phase("eval"):
            result = await evaluate_rows(rollout, rows, greedy(cfg))
        result.update({"step": step, "periodic": periodic, "description": EVAL_SETS.get(name, name)})
        out[name] = result
        print(
            f"eval [{label}] {name}: answer right {result['success_rate']:.1%}, calls right "
            f"{result['calls_right_rate']:.1%}, mean reward {result['mean_reward']:.3f}, turns "
            f"{result['turns']:.2f} on {result['tasks']} held-out tasks",
            flush=True,
        )
    return out


def milestone_lines(evals: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Per held-out set, the success rate at each milestone stage (the periodic evaluations left out)."""
    lines = []
    for name, by_stage in evals.items():
        milestones = {stage: e for stage, e in by_stage.items() if not e.get("periodic")}
        stages = ", ".join(f"{stage} {e['success_rate']:.1%}" for stage, e in milestones.items())
        lines.append(f"answer right on held-out {name} tasks ({EVAL_SETS.get(name, name)}): {stages}")
    return lines
