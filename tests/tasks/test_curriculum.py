"""The pass-rate curriculum: determinism with a two-step lag, exact resume, favouring tasks near 0.5."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from configs.loader import ConfigError, load_config
from tasks.curriculum import CurriculumSampler, make_sampler, template_pass_rates
from tasks.dataset import TaskSampler, task_id


def row(tid: str, template: str | None = None) -> dict[str, Any]:
    extra = {"template": template} if template else {}
    return {"prompt": [], "reward_spec": {"ground_truth": {"task_id": tid}}, "extra_info": extra}


def rows(n: int) -> list[dict[str, Any]]:
    return [row(f"t{i}") for i in range(n)]


def ids(batch: list[dict[str, Any]]) -> list[str]:
    return [task_id(r) for r in batch]


def mixed_outcomes(tids: list[str], step: int) -> dict[str, list[bool]]:
    """Varied outcomes per task, so that pass rates differ from task to task."""
    return {t: [(i + step + k) % 3 == 0 for k in range(4)] for i, t in enumerate(tids)}


def test_same_seed_same_batches_and_repeatable() -> None:
    data = rows(20)
    a, b = CurriculumSampler(data, 5, seed=3), CurriculumSampler(data, 5, seed=3)
    for step in range(6):
        assert ids(a.batch(step)) == ids(b.batch(step)) == ids(a.batch(step))
        a.record(step, mixed_outcomes(ids(a.batch(step)), step))
        b.record(step, mixed_outcomes(ids(b.batch(step)), step))
    assert ids(CurriculumSampler(data, 5, seed=4).batch(0)) != ids(a.batch(0))


def test_lag_of_two_steps() -> None:
    data = rows(30)
    tids = [task_id(r) for r in data]
    skewed = {t: [i % 2 == 0] * 8 for i, t in enumerate(tids)}  # half always right, half always wrong
    base, late = CurriculumSampler(data, 6, seed=1), CurriculumSampler(data, 6, seed=1)
    for s in range(3):
        base.record(s, mixed_outcomes(tids, s))
        late.record(s, mixed_outcomes(tids, s))
    step = 5
    late.record(step - 1, skewed)  # overlap: step s-1 recorded (or not) before step s is drawn
    late.record(step, skewed)
    assert ids(late.batch(step)) == ids(base.batch(step))
    base.record(step - 2, skewed)  # outcomes of step s-2 do count
    assert ids(base.batch(step)) != ids(late.batch(step))
    assert base.pass_rates(step) != late.pass_rates(step)


def test_restored_state_draws_the_same_batches() -> None:
    data = rows(25)
    original = CurriculumSampler(data, 4, seed=7, window=6)
    for step in range(8):
        original.record(step, mixed_outcomes(ids(original.batch(step)), step))
    restored = CurriculumSampler(data, 4, seed=7, window=6)
    restored.load_state(json.loads(json.dumps(original.state())))  # as it goes through a checkpoint file
    assert restored.state() == original.state()
    for step in range(8, 14):
        assert ids(restored.batch(step)) == ids(original.batch(step))
        outcomes = mixed_outcomes(ids(original.batch(step)), step)
        original.record(step, outcomes)
        restored.record(step, outcomes)


def test_rerecording_a_step_replaces_it() -> None:
    s = CurriculumSampler(rows(3), 2)
    s.record(0, {"t0": [True, False]})
    s.record(0, {"t0": [True, False]})
    assert s.pass_rates()["t0"] == pytest.approx(2 / 4)
    assert s.pass_rates()["t1"] == 0.5  # unseen


def test_pass_rate_window_and_band() -> None:
    s = CurriculumSampler(rows(3), 2, window=4)
    s.record(0, {"t0": [False] * 10, "t1": [True] * 10})
    s.record(1, {"t0": [True] * 4})  # the window keeps only these 4
    rates = s.pass_rates()
    assert rates["t0"] == pytest.approx(5 / 6) and rates["t1"] == pytest.approx(5 / 6)
    assert s.pass_rates(2) == {"t0": pytest.approx(1 / 6), "t1": pytest.approx(5 / 6), "t2": 0.5}
    assert s.tasks_in_band() == 3  # 5/6 and 0.5: all strictly inside (0.1, 0.9)
    wide = CurriculumSampler(rows(3), 2)  # window 16
    wide.record(0, {"t0": [False] * 16, "t1": [True, False] * 8})
    assert wide.tasks_in_band() == 2  # t0: 1/18 is out; t1 and unseen t2 (0.5) are in
    assert wide.tasks_in_band(1) == 3  # step 0 is not yet visible to step 1
    assert wide.tasks_in_band(low=0.6) == 0


def test_favours_tasks_near_half() -> None:
    n_each = 20
    data = [row(f"{kind}{i}") for kind in ("lo", "mid", "hi") for i in range(n_each)]
    s = CurriculumSampler(data, 4, seed=0)
    for step in (0, 1):  # 8 episodes a step: 0/8, 4/8, 8/8 each time
        s.record(step, {f"lo{i}": [False] * 8 for i in range(n_each)})
        s.record(step, {f"mid{i}": [True, False] * 4 for i in range(n_each)})
        s.record(step, {f"hi{i}": [True] * 8 for i in range(n_each)})
    drawn = Counter(task_id(r).rstrip("0123456789") for step in range(2, 402) for r in s.batch(step))
    assert drawn["mid"] >= 3 * drawn["lo"] and drawn["mid"] >= 3 * drawn["hi"]
    assert drawn["lo"] > 0 and drawn["hi"] > 0  # min_weight: solved and failed tasks still come back


def test_distinct_within_batch_and_wrap_around() -> None:
    data = rows(10)
    s = CurriculumSampler(data, 8, seed=2)
    s.record(0, mixed_outcomes([task_id(r) for r in data], 0))
    for step in range(6):
        assert len(set(ids(s.batch(step)))) == 8
    wide = CurriculumSampler(rows(3), 7, seed=2)
    batch = ids(wide.batch(0))
    assert len(batch) == 7
    assert sorted(batch[:3]) == ["t0", "t1", "t2"] and sorted(batch[3:6]) == ["t0", "t1", "t2"]
    assert len(set(batch[6:])) == 1


def test_template_pass_rates() -> None:
    step_rows = [row("a", "lookup"), row("b", "lookup"), row("c", "chain"), row("d"), row("e", "chain")]
    outcomes = {"a": [True, True, False], "b": [False], "c": [True], "d": [False, False]}  # e: all infra-failed
    assert template_pass_rates([*step_rows, row("a", "lookup")], outcomes) == {
        "(none)": 0.0,
        "chain": 1.0,
        "lookup": 0.5,
    }


def test_make_sampler_and_config() -> None:
    data = rows(4)
    plain = make_sampler(data, load_config().train)
    assert isinstance(plain, TaskSampler)
    plain.record(0, {"t0": [True]})  # the driver may call these on either sampler
    plain.load_state(plain.state())
    cfg = load_config(None, ["train.curriculum.enabled=true", "train.curriculum.window=4"]).train
    cur = make_sampler(data, cfg)
    assert isinstance(cur, CurriculumSampler) and cur.window == 4 and cur.min_weight == 0.02
    with pytest.raises(ConfigError, match=r"train\.curriculum\.window"):
        load_config(None, ["train.curriculum.window=0"])
    with pytest.raises(ConfigError, match=r"train\.curriculum\.min_weight"):
        load_config(None, ["train.curriculum.min_weight=0"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["train.curriculum.windw=3"])


@pytest.mark.parametrize("curriculum", [True, False])
def test_more_draws_new_tasks_deterministically(curriculum: bool) -> None:
    """A refill round's tasks: none already in the step, at most a batch, the same for the same call."""
    pool = rows(10)
    sampler = CurriculumSampler(pool, 4, seed=3) if curriculum else TaskSampler(pool, 4, seed=3)
    first = {task_id(r) for r in sampler.batch(0)}
    more = sampler.more(0, 1, first)
    assert len(more) == 4 and not first & {task_id(r) for r in more}
    assert [task_id(r) for r in sampler.more(0, 1, first)] == [task_id(r) for r in more]
    assert [task_id(r) for r in sampler.more(0, 2, first)] != [task_id(r) for r in more]  # another round, another draw
    taken = first | {task_id(r) for r in more}
    assert len(sampler.more(0, 2, taken)) == 2 and sampler.more(0, 3, {f"t{i}" for i in range(10)}) == []


def test_more_favours_tasks_near_half_as_batch_does() -> None:
    sampler = CurriculumSampler(rows(40), 4, seed=0)
    sampler.record(0, {f"t{i}": [True] * 8 if i < 30 else [True, False] * 4 for i in range(40)})  # t30-t39 in band
    drawn: Counter[str] = Counter()
    for r in range(1, 200):
        drawn.update(task_id(x) for x in sampler.more(2, r, set()))
    in_band, solved = (sum(drawn[f"t{i}"] for i in span) / len(span) for span in (range(30, 40), range(30)))
    assert in_band > 1.8 * solved  # weights 0.27 and 0.11 (p = 0.5 and 0.9)
