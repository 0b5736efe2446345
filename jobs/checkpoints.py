"""A run's checkpoints in storage: <run>/checkpoints/step_N, complete once meta.json is there (the learner
writes it last), and the retention rule of `train.keep_checkpoints`.

Retention keeps the newest K complete checkpoints, the best one by evaluation success (the evaluation every
`train.eval_every` steps; ties go to the newer step), and any the caller protects (the one the run resumed
from). The newest complete checkpoint is never deleted. A checkpoint is deleted meta.json first: a deletion
cut short leaves a folder without meta.json, which `latest_checkpoint` skips and the next pruning removes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from cluster import storage

log = logging.getLogger(__name__)

PREFIX = "step_"


def checkpoint_path(run: str, step: int) -> str:
    return storage.join(run, "checkpoints", f"{PREFIX}{step}")


def checkpoint_steps(run: str) -> tuple[list[int], list[int]]:
    """(complete, incomplete) steps of `run`'s checkpoint folders, each ascending; incomplete: no meta.json
    (a save or a deletion that died)."""
    names = storage.list_names(storage.join(run, "checkpoints"))
    steps = sorted(int(n[len(PREFIX) :]) for n in names if n.startswith(PREFIX) and n[len(PREFIX) :].isdigit())
    complete, incomplete = [], []
    for step in steps:
        whole = storage.exists(storage.join(checkpoint_path(run, step), "meta.json"))
        (complete if whole else incomplete).append(step)
    return complete, incomplete


def latest_checkpoint(run: str) -> str | None:
    """The newest complete checkpoint of `run`, or None."""
    complete, _ = checkpoint_steps(run)
    return checkpoint_path(run, complete[-1]) if complete else None


def retained(
    complete: Iterable[int], keep_last: int, success: Mapping[int, float], protect: Iterable[int] = ()
) -> set[int]:
    """The complete checkpoints (steps) to keep: all when `keep_last` is 0; else the newest `keep_last`,
    the best by `success` (step → evaluation success rate; ties: the newer) and those in `protect`."""
    if keep_last < 0:
        raise ValueError(f"train.keep_checkpoints must be >= 0, got {keep_last}")
    steps = sorted(set(complete))
    if keep_last == 0 or not steps:
        return set(steps)
    keep = set(steps[-keep_last:]) | (set(protect) & set(steps))
    evaluated = [s for s in steps if s in success]
    if evaluated:
        keep.add(max(evaluated, key=lambda s: (success[s], s)))
    return keep


def prune_checkpoints(run: str, keep_last: int, success: Mapping[int, float], protect: Iterable[int] = ()) -> list[int]:
    """Delete `run`'s checkpoints that `retained` does not keep, and the incomplete folders older than the
    newest complete checkpoint (an incomplete newer one is left alone). Returns the deleted steps."""
    if keep_last == 0:
        return []
    complete, incomplete = checkpoint_steps(run)
    if not complete:
        return []
    keep = retained(complete, keep_last, success, protect)
    doomed = sorted([s for s in complete if s not in keep] + [s for s in incomplete if s < complete[-1]])
    for step in doomed:
        folder = checkpoint_path(run, step)
        storage.delete(storage.join(folder, "meta.json"))  # first: from here on it is not a checkpoint
        storage.delete(folder)
        log.info("checkpoint retention: deleted %s", folder)
    return doomed
