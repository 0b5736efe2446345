"""Admission: what every generator's rows go through before they are kept.

In order, for each row (the first of several rows wins):
1. `check_row`: the schema, TaskRow's rules, known servers and tools, params valid for the tool;
2. a task_id that an earlier admitted row already has is a duplicate;
3. its tool_sequence is replayed against the (offline) pool, step by step: a step whose call is not ok
   (an unknown ticker, a sandbox error...) rejects the row, naming the step, the tool and the error;
4. near-duplicate user prompts among the rows still kept: the first is kept.

Rows are replayed one after another, in order, so a pool with state (the offline Slack workspace)
sees the same calls in the same order on every run.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from serve_apps.tool_pool import ToolPool
from tasks.inventory import Inventory
from tasks.schema import TaskRow
from tasks.similarity import near_duplicates
from tasks.validate import PARAMS, UNKNOWN_SERVER, UNKNOWN_TOOL, RowIssue, inspect_row, task_id_of

# Rejection reasons, worded to follow a count: "kept 183 of 200; rejected: 9 params do not validate".
FAILS_SCHEMA = "fail the schema"
UNKNOWN = "name an unknown server or tool"
BAD_PARAMS = "params do not validate"
CALL_FAILED = "a tool call failed offline"
DUPLICATE = "duplicate task_ids"
NEAR_DUPLICATES = "near-duplicates"


@dataclass(frozen=True)
class Rejection:
    task_id: str | None
    reason: str  # one of the reasons above
    detail: str = ""  # what exactly: the issues, or the failed step with its tool and error


@dataclass
class Admission:
    total: int = 0
    kept: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Rejections per reason, most frequent first."""
        return dict(Counter(r.reason for r in self.rejected).most_common())

    def summary(self) -> str:
        """e.g. "kept 183 of 200; rejected: 9 params do not validate, 5 a tool call failed offline"."""
        text = f"kept {len(self.kept)} of {self.total}"
        if self.rejected:
            text += "; rejected: " + ", ".join(f"{n} {reason}" for reason, n in self.counts().items())
        return text


async def admit(
    rows: list[dict[str, Any]], pool: ToolPool, inventory: Inventory, near_duplicate_threshold: float
) -> Admission:
    """The rows worth keeping, and why each of the others was turned away. Never raises for bad rows."""
    result = Admission(total=len(rows))
    passed: list[tuple[dict[str, Any], TaskRow]] = []  # the row as given (what is written) and as a TaskRow
    seen_ids: set[str] = set()
    with _quiet_tool_errors():
        for index, row in enumerate(rows):
            issues, task = inspect_row(row, index, inventory)
            if issues or task is None:
                detail = "; ".join(str(i) for i in issues[:3])
                result.rejected.append(Rejection(task_id_of(row), _reason(issues), detail))
                continue
            if task.task_id in seen_ids:
                detail = f"task_id {task.task_id!r} is already admitted"
                result.rejected.append(Rejection(task.task_id, DUPLICATE, detail))
                continue
            failure = await replay(task, pool)
            if failure:
                result.rejected.append(Rejection(task.task_id, CALL_FAILED, failure))
                continue
            seen_ids.add(task.task_id)
            passed.append((row, task))

    texts = [task.user_message for _, task in passed]
    drop = {}
    for i, j, score in near_duplicates(texts, near_duplicate_threshold):
        if i not in drop and j not in drop:  # a row already dropped keeps no one else out
            drop[j] = f"near-duplicate of {passed[i][1].task_id!r} (similarity {score:.2f})"
    for j, (row, task) in enumerate(passed):
        if j in drop:
            result.rejected.append(Rejection(task.task_id, NEAR_DUPLICATES, drop[j]))
        else:
            result.kept.append(row)
    return result


async def replay(task: TaskRow, pool: ToolPool) -> str | None:
    """Run a task's tool_sequence against the pool; None when every call is ok, else what failed."""
    for step in task.ground_truth.tool_sequence:
        result = await pool.call_tool(step.server, step.tool, step.params)
        if not result.ok:
            return f"step {step.step} {step.server}.{step.tool}: {result.error_kind}: {result.error}"
    return None


def _reason(issues: list[RowIssue]) -> str:
    kinds = {i.kind for i in issues}
    if kinds - {UNKNOWN_SERVER, UNKNOWN_TOOL, PARAMS}:
        return FAILS_SCHEMA
    if kinds & {UNKNOWN_SERVER, UNKNOWN_TOOL}:
        return UNKNOWN
    return BAD_PARAMS


@contextlib.contextmanager
def _quiet_tool_errors() -> Iterator[None]:
    """FastMCP logs every failing call with a traceback; here a failure is an expected verdict, reported
    as a rejection, so its log is silenced while admission runs (and restored after)."""
    logger = logging.getLogger("fastmcp")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
