"""jobs/metric_names.py lists every key a training run logs, and nothing else: the keys come from the code that
makes them (the rollout's, the groups' and the advantages' figures computed on a small batch, an evaluation's
figures, the learner's metric names read from its source, and every key string in the driver's sources), no
training run needed."""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path
from typing import Any

from actors.rollout_metrics import rollout_metrics
from actors.trajectory import Trajectory
from cluster.metrics import STEP_FIGURES
from grpo.advantages import group_advantages
from grpo.groups import outcome_groups
from jobs.evaluate import evaluate_rows
from jobs.held_out import eval_figures
from jobs.metric_names import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2]
# The sources that build the keys the driver logs (the tracker adds timing/<phase>_s).
WRITERS = ["jobs/train_driver.py", "jobs/outcomes.py", "jobs/held_out.py", "jobs/tracking.py"]
# A family's keys made as f"<family>{k}" from a dict: the test makes the dict below.
FAMILIES = ("rollout/", "groups/", "adv/", "train/", "eval/", "timing/")


def _trajectories() -> list[Trajectory]:
    """A group of three played episodes (one right) and one lost to an infra fault."""
    out = []
    for i, right in enumerate((True, False, False)):
        t = Trajectory(task_id="t0", group_id=0, sample_index=i, prompt_ids=[1, 2, 3])
        t.add_turn([4, 5], [-0.1, -0.2], "answer", {"reward": 1.0 if right else 0.0}, version=1, finish="stop")
        t.reward = t.turn_rewards[0]
        t.tool_stats = {"turns": 1, "tool_calls": 1, "tool_ok": 1, "task_complete": right, "calls_right": right}
        out.append(t)
    out.append(Trajectory(task_id="t1", group_id=1, sample_index=0, infra_fault=True, finish_reason="engine_failed"))
    return out


class _Rollout:
    """The rollout group as evaluate_rows calls it."""

    async def run(self, rows: list[dict[str, Any]], group_size: int, sampling: Any) -> list[Trajectory]:
        return _trajectories()


def _learner_keys() -> set[str]:
    """The learner's train_step metric names, read from its source: keys of the dicts it builds and of `out[...]`,
    and the names of the per-token figures it accumulates (string tuples)."""
    tree = ast.parse((ROOT / "actors" / "learner" / "steps.py").read_text())
    found: set[str] = set()
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name in ("train_step", "_optimizer_step", "_ppo_targets")):
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Dict):
                found |= {k.value for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and isinstance(n.slice, ast.Constant):
                found.add(n.slice.value)
            elif isinstance(n, ast.Tuple) and n.elts and all(isinstance(e, ast.Constant) for e in n.elts):
                found |= {e.value for e in n.elts if isinstance(e.value, str)}
    return found


def _source_keys() -> tuple[set[str], set[str]]:
    """(key strings, f-string keys with each `{x}` as `<x>`) of the writers that start with a table's family."""
    prefixes = tuple({k.split("/", 1)[0] + "/" for k in METRIC_NAMES})
    plain: set[str] = set()
    formatted: set[str] = set()
    for path in WRITERS:
        tree = ast.parse((ROOT / path).read_text())
        pieces = {id(p) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for p in n.values}
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith(prefixes):
                if id(n) not in pieces:  # an f-string's literal part is no key of its own
                    plain.add(n.value)
            elif isinstance(n, ast.JoinedStr):
                text = "".join(
                    p.value if isinstance(p, ast.Constant) else f"<{ast.unparse(p.value)}>" for p in n.values
                )
                if text.startswith(prefixes):
                    formatted.add(text)
    return plain, formatted


def logged_keys() -> set[str]:
    """Every key the code logs, `<set>` and `<template>` standing for run-time names."""
    trajs = _trajectories()
    keys = {f"rollout/{k}" for k in rollout_metrics(trajs)}
    _, groups = outcome_groups([True, False, True, True], [0, 0, 1, 1])
    keys |= {f"groups/{k}" for k in groups}
    _, adv = group_advantages([1.0, 0.0, 0.5, 0.5], [0, 0, 1, 1])
    keys |= {f"adv/{k}" for k in adv}
    keys |= {f"train/{k}" for k in _learner_keys()}
    result = asyncio.run(evaluate_rows(_Rollout(), [{"prompt": []}], sampling=None))
    keys |= set(eval_figures(result, "<set>"))
    plain, formatted = _source_keys()
    plain |= {m.key for m in STEP_FIGURES if m.key}  # the exported figures name metrics.jsonl keys
    keys |= {re.sub(r"^eval/(validation|transfer)/", "eval/<set>/", k) for k in plain}
    for path in WRITERS:
        keys |= {f"timing/{name}_s" for name in re.findall(r"\.phase\(\"(\w+)\"", (ROOT / path).read_text())}
    return keys | {t for t in formatted if not t.startswith(FAMILIES)}  # a family's keys: from its dict above


def test_every_logged_key_has_a_meaning_and_no_listed_key_is_stale() -> None:
    keys = logged_keys()
    assert len(keys) > 60, f"only {len(keys)} keys found: the scan is broken"
    missing = sorted(keys - set(METRIC_NAMES))
    assert not missing, f"keys logged but not in jobs/metric_names.py: {missing}"
    stale = sorted(set(METRIC_NAMES) - keys)
    assert not stale, f"keys in jobs/metric_names.py that nothing logs: {stale}"
    assert all(meaning.strip() for meaning in METRIC_NAMES.values())


def test_the_scan_sees_every_family_the_driver_formats() -> None:
    """An f-string key of the driver is either a table pattern or a family whose dict the test computes: a new
    family (say f"judge/{k}") fails here until the test makes its keys."""
    _, formatted = _source_keys()
    assert "pass_rate/<template>" in formatted
    unknown = [t for t in formatted if not t.startswith(FAMILIES) and t not in METRIC_NAMES]
    assert not unknown, f"keys built at run time that neither the table nor this test knows: {unknown}"
