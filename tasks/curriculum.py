"""A pass-rate curriculum: draw each step's tasks by how often the policy recently solved them.

GRPO learns only from groups whose episodes differ in outcome; a task always solved or always failed
gives no signal. A task's pass rate p is the Beta(1,1)-smoothed share of its last `window` episodes
answered right, (successes + 1) / (n + 2) (0.5 when unseen); its draw weight is p·(1−p) + min_weight,
largest at p = 0.5 and never zero, so tasks near 0 or 1 still come back.

Determinism: `batch(step)` depends only on (rows, seed, step) and the outcomes recorded for steps
<= step − 2. The driver may draw step s+1 (overlapped rollout) before it records step s; with a lag of
two the batch is the same with or without overlap, and after a resume from `state()`.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tasks.dataset import DataError, TaskSampler, task_id

if TYPE_CHECKING:
    from configs.schema import TrainConfig

LAG = 2  # batch(step) sees outcomes of steps <= step - LAG
NO_TEMPLATE = "(none)"  # as jobs.stats names rows without a template
STATE_VERSION = 1


def template_of(row: Mapping[str, Any]) -> str:
    extra = row.get("extra_info")
    template = extra.get("template") if isinstance(extra, Mapping) else None
    return str(template) if template else NO_TEMPLATE


def template_pass_rates(rows: Iterable[Mapping[str, Any]], outcomes: Mapping[str, Sequence[bool]]) -> dict[str, float]:
    """{template: share of the step's episodes answered right}, for `curriculum/pass_rate/<template>`.

    `rows`: the step's batch; `outcomes`: as given to `record`. A task drawn twice (wrap-around) has its
    outcomes under one id, so each id counts once. Templates without scored episodes are left out."""
    right: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    seen: set[str] = set()
    for row in rows:
        tid = task_id(row)
        if tid in seen or not outcomes.get(tid):
            continue
        seen.add(tid)
        template = template_of(row)
        right[template] += sum(bool(o) for o in outcomes[tid])
        total[template] += len(outcomes[tid])
    return {t: right[t] / total[t] for t in sorted(total)}


class CurriculumSampler:
    """`batch_size` distinct tasks per step (wrapping when there are fewer rows), drawn by weighted
    sampling without replacement on pass-rate weights; the same interface as TaskSampler."""

    def __init__(
        self, rows: list[dict[str, Any]], batch_size: int, seed: int = 0, window: int = 16, min_weight: float = 0.02
    ) -> None:
        if not rows:
            raise DataError("no tasks to sample from")
        if batch_size < 1 or window < 1 or min_weight <= 0:
            raise ValueError(
                f"need batch_size >= 1, window >= 1, min_weight > 0; got {batch_size}, {window}, {min_weight}"
            )
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.window = window
        self.min_weight = min_weight
        self._ids = [task_id(r) for r in rows]
        # Kept per step (not folded into running counts) so the lag can be applied exactly for any step.
        self._outcomes: dict[int, dict[str, tuple[bool, ...]]] = {}

    # ------------------------------------------------------------------ outcomes

    def record(self, step: int, outcomes: Mapping[str, Sequence[bool]]) -> None:
        """The right/wrong outcomes of the episodes each task got at `step` (infrastructure failures left
        out). Recording a (step, task) again replaces it, so a step redone after a resume is not counted twice."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        kept = {str(tid): tuple(bool(o) for o in outs) for tid, outs in outcomes.items() if len(outs)}
        if kept:
            self._outcomes.setdefault(step, {}).update(kept)

    def state(self) -> dict[str, Any]:
        """JSON-serializable: the recorded outcomes by step."""
        return {
            "version": STATE_VERSION,
            "outcomes": {
                str(step): {tid: list(outs) for tid, outs in by_task.items()}
                for step, by_task in sorted(self._outcomes.items())
            },
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Replace the recorded outcomes with those of `state()` (e.g. from a checkpoint); {} clears them (a
        checkpoint written without the curriculum)."""
        if not state:
            self._outcomes = {}
            return
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"curriculum state: unknown version {state.get('version')!r}")
        self._outcomes = {
            int(step): {str(tid): tuple(bool(o) for o in outs) for tid, outs in by_task.items()}
            for step, by_task in state.get("outcomes", {}).items()
        }

    # ------------------------------------------------------------------ rates

    def _counts(self, upto: float) -> dict[str, tuple[int, int]]:
        """{task_id: (successes, episodes)} over each task's last `window` episodes at steps <= upto."""
        recent: dict[str, deque[bool]] = {}
        for step in sorted(s for s in self._outcomes if s <= upto):
            for tid, outs in self._outcomes[step].items():
                recent.setdefault(tid, deque(maxlen=self.window)).extend(outs)
        return {tid: (sum(d), len(d)) for tid, d in recent.items()}

    def pass_rates(self, step: int | None = None) -> dict[str, float]:
        """Smoothed pass rate per task of `rows`: those batch(step) draws by (outcomes of steps <= step − 2),
        or with `step` None, from all outcomes recorded so far."""
        counts = self._counts(math.inf if step is None else step - LAG)
        rates = {}
        for tid in self._ids:
            right, n = counts.get(tid, (0, 0))
            rates[tid] = (right + 1) / (n + 2)
        return rates

    def tasks_in_band(self, step: int | None = None, low: float = 0.1, high: float = 0.9) -> int:
        """Tasks whose smoothed pass rate lies strictly inside (low, high): those still giving signal."""
        return sum(low < p < high for p in self.pass_rates(step).values())

    # ------------------------------------------------------------------ drawing

    def batch(self, step: int) -> list[dict[str, Any]]:
        """The tasks of `step` (0-based): a pure function of (rows, seed, step, outcomes of steps <= step − 2)."""
        weights = self._weights(step)
        rng = random.Random(f"{self.seed}|curriculum|{step}")
        n = len(self.rows)
        out: list[dict[str, Any]] = []
        while len(out) < self.batch_size:  # rounds of distinct tasks: all rows, then the rest drawn again
            out += [self.rows[i] for i in _draw(weights, range(n), min(n, self.batch_size - len(out)), rng)]
        return out

    def more(self, step: int, round_: int, exclude: set[str]) -> list[dict[str, Any]]:
        """Up to `batch_size` more tasks for `step` (refill round `round_` >= 1), none of them in `exclude`,
        drawn by the same pass-rate weights as `batch(step)`; deterministic as it is."""
        candidates = [i for i, tid in enumerate(self._ids) if tid not in exclude]
        rng = random.Random(f"{self.seed}|curriculum|{step}|more{round_}")
        return [self.rows[i] for i in _draw(self._weights(step), candidates, self.batch_size, rng)]

    def _weights(self, step: int) -> list[float]:
        """Each row's draw weight at `step`: p·(1−p) + min_weight, p its smoothed pass rate."""
        rates = self.pass_rates(step)
        return [rates[tid] * (1 - rates[tid]) + self.min_weight for tid in self._ids]


def _draw(weights: Sequence[float], candidates: Iterable[int], k: int, rng: random.Random) -> list[int]:
    """k of `candidates` (indices into `weights`), a weighted sample without replacement (Efraimidis–Spirakis:
    the k largest keys log(u)/w), largest key first; one random number per candidate, in their order."""
    keys = {i: math.log(1.0 - rng.random()) / weights[i] for i in candidates}  # 1 - random() is in (0, 1]
    return heapq.nlargest(k, keys, key=keys.__getitem__)


def make_sampler(rows: list[dict[str, Any]], cfg_train: TrainConfig) -> TaskSampler | CurriculumSampler:
    """The run's sampler: the curriculum when `train.curriculum.enabled`, the plain shuffled stream otherwise."""
    cur = cfg_train.curriculum
    if cur.enabled:
        return CurriculumSampler(rows, cfg_train.tasks_per_step, cfg_train.seed, cur.window, cur.min_weight)
    return TaskSampler(rows, cfg_train.tasks_per_step, cfg_train.seed)
