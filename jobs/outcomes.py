"""What one GRPO step's episodes come to, before the learner sees them (jobs/train_driver.py's `Driver` uses these):
whether each succeeded, the scores group advantages rank, the outcomes the curriculum draws by, the group
judge's rewards."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from configs.schema import Config

if TYPE_CHECKING:
    from envs.judge import JudgeLike


def succeeded(traj: Any) -> bool:
    """The episode's outcome: its final answer is right (the env's task_complete)."""
    return bool(traj.tool_stats.get("task_complete"))


def ranked_scores(cfg: Config, trajs: list[Any]) -> list[float]:
    """What group advantages rank: the summed reward, or outcome first (algorithm.outcome_first)."""
    from grpo.groups import outcome_first_scores

    shaping = cfg.algorithm.outcome_first
    if shaping is None or cfg.reward.backend != "heuristic":
        return [t.reward for t in trajs]
    paid = [float(t.tool_stats.get("reward/outcome", 0.0)) for t in trajs]
    return outcome_first_scores([t.reward for t in trajs], paid, [succeeded(t) for t in trajs], shaping)


def record_outcomes(
    sampler: Any, step: int, trajs: list[Any], tasks: list[dict[str, Any]], metrics: dict[str, float]
) -> None:
    """Each task's outcomes go to the sampler (the curriculum draws by them); per-template pass rates are logged."""
    from tasks.curriculum import CurriculumSampler, template_pass_rates

    outcomes: dict[str, list[bool]] = {}
    for t in trajs:
        outcomes.setdefault(t.task_id, []).append(succeeded(t))
    sampler.record(step, outcomes)
    for template, rate in sorted(template_pass_rates(tasks, outcomes).items()):
        metrics[f"pass_rate/{template}"] = rate
    if isinstance(sampler, CurriculumSampler):
        metrics["curriculum/tasks_in_band"] = float(sampler.tasks_in_band())


async def judge_groups(trajs: list[Any], tasks: list[dict[str, Any]], judge: JudgeLike) -> list[Any]:
    """group_judge: one judge call per group scores its episodes; groups it cannot score are dropped."""
    from envs.judge import group_judge

    groups: dict[int, list[Any]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    # All groups at once: the deployment batches them.
    ranked = await asyncio.gather(
        *(
            group_judge([t.messages for t in members], tasks[g]["reward_spec"]["ground_truth"], judge=judge)
            for g, members in groups.items()
        )
    )
    kept = []
    for members, scores in zip(groups.values(), ranked, strict=True):
        if scores is None:
            continue
        for t, s in zip(members, scores, strict=True):
            t.reward = float(s)
        kept += members
    return kept
