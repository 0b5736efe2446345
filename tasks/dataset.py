"""Training data for a run: load the task files, send them through the gate, and sample batches.

The gate is the one `jobs.validate_tasks` applies (schema, tool inventory, params, duplicate ids):
a run refuses data with errors before any actor starts, naming the file, the row and the problem.

Batches are a pure function of (seed, step): the rows are shuffled once per epoch with
`Random(f"{seed}|epoch{e}")` and read as one stream, so step k always gets the same tasks. The data
position a checkpoint needs is just the step; a resumed run sees the batches an unbroken run would.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.inventory import Inventory
from tasks.io import TaskFileError, read_rows
from tasks.validate import LIVE_WRITE, validate_rows

log = logging.getLogger(__name__)

MAX_ISSUES_SHOWN = 10


class DataError(ValueError):
    """Task data that cannot be trained on; the message names the file and the rows."""


def load_tasks(
    path: str | Path, inventory: Inventory, what: str = "data.train", live_writes: Collection[str] = ()
) -> list[dict[str, Any]]:
    """The rows of `path` once they pass the gate; DataError otherwise (nothing is dropped silently).

    `live_writes`: tools that write to a live service (`tasks.inventory.live_writing_tools`); rows that
    plan such a call are logged as warnings (a live service cannot keep episodes apart)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what}: no such task file {path}")
    try:
        rows = read_rows(path)
    except TaskFileError as e:
        raise DataError(f"{what}: {e}") from None
    if not rows:
        raise DataError(f"{what}: {path} holds no rows")
    report = validate_rows(rows, inventory, live_writes=live_writes)
    for issue in [i for i in report.warnings if i.kind == LIVE_WRITE][:MAX_ISSUES_SHOWN]:
        log.warning("%s: %s", what, issue)
    if report.errors:
        shown = "\n".join(f"  {issue}" for issue in report.errors[:MAX_ISSUES_SHOWN])
        more = len(report.errors) - MAX_ISSUES_SHOWN
        raise DataError(
            f"{what}: {path} fails validation with {len(report.errors)} errors:\n{shown}"
            + (f"\n  ... and {more} more" if more > 0 else "")
            + f"\n(see: python -m jobs.validate_tasks --in {path})"
        )
    return rows


def task_id(row: Mapping[str, Any]) -> str:
    """A loaded row's task id (`reward_spec.ground_truth.task_id`)."""
    return str(row["reward_spec"]["ground_truth"]["task_id"])


@dataclass
class TaskSampler:
    """B tasks per step from an endless, epoch-wise shuffled stream of `rows`."""

    rows: list[dict[str, Any]]
    batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rows:
            raise DataError("no tasks to sample from")
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}|epoch{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all a step needs (plus the next)
        return self._orders[epoch]

    def batch(self, step: int) -> list[dict[str, Any]]:
        """The tasks of `step` (0-based); the same for the same (rows, batch_size, seed, step)."""
        n = len(self.rows)
        start = step * self.batch_size
        out = []
        for position in range(start, start + self.batch_size):
            epoch, index = divmod(position, n)
            out.append(self.rows[self._order(epoch)[index]])
        return out

    def more(self, step: int, round_: int, exclude: set[str]) -> list[dict[str, Any]]:
        """Up to `batch_size` more tasks for `step` (refill round `round_` >= 1), none of them in `exclude`,
        drawn uniformly; the same for the same (rows, seed, step, round_, exclude)."""
        candidates = [r for r in self.rows if task_id(r) not in exclude]
        random.Random(f"{self.seed}|step{step}|more{round_}").shuffle(candidates)
        return candidates[: self.batch_size]

    # The driver calls these on any sampler; the plain stream depends on (seed, step) alone.
    def record(self, step: int, outcomes: Mapping[str, Sequence[bool]]) -> None:
        """No-op: outcomes do not steer the plain stream."""

    def state(self) -> dict[str, Any]:
        """Nothing to save: the step is the whole data position."""
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """No-op (see `state`)."""
