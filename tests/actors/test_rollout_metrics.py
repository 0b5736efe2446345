"""rollout_metrics and sample_rows on hand-built trajectories with hand-computed figures."""

from __future__ import annotations

import math
from typing import Any

import pytest

from actors.rollout_metrics import (
    conversation_text,
    prefix_cache_counts,
    prefix_cache_hit_rate,
    rollout_metrics,
    sample_rows,
)
from actors.trajectory import FINISH_REASONS, Trajectory

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it


def traj(
    *,
    reward_turns: list[float],
    mask: list[int],
    prompt_len: int = 10,
    stats: dict[str, Any] | None = None,
    finish: str = "done",
    infra: bool = False,
    restarts: int = 0,
    index: int = 0,
    messages: list[dict[str, str]] | None = None,
) -> Trajectory:
    """A well-formed trajectory (it passes Trajectory.check) with the given shape."""
    turns = len(reward_turns)
    t = Trajectory(
        task_id=f"t{index}",
        group_id=0,
        sample_index=index,
        prompt_ids=list(range(prompt_len)),
        response_ids=[7] * len(mask),
        loss_mask=mask,
        rollout_logprobs=[-0.5 if m else 0.0 for m in mask],
        messages=messages or [{"role": "user", "content": "q"}],
        turn_rewards=reward_turns,
        reward=math.fsum(reward_turns),
        versions=[0] * turns,
        turn_finish=["stop"] * turns,
        appended_eot=[False] * turns,
        env_metadata=[{}] * turns,
        tool_stats=stats or {},
        infra_fault=infra,
        finish_reason=finish,  # type: ignore[arg-type]
        restarts=restarts,
    )
    t.check()
    return t


def stats(turns: int, calls: int, ok: int, timeouts: int = 0, parse: int = 0, infra: int = 0, done: bool = False):
    return {
        "turns": turns,
        "tool_calls": calls,
        "tool_ok": ok,
        "timeouts": timeouts,
        "parse_failures": parse,
        "infra_faults": infra,
        "task_complete": float(done),
        "calls_right": float(done),
    }


@pytest.fixture
def batch() -> list[Trajectory]:
    a = traj(reward_turns=[0.5, 0.5], mask=[1, 1, 1, 0, 0, 1], stats=stats(2, 2, 2, done=True), index=0)
    b = traj(
        reward_turns=[-0.2, 0.2],
        mask=[1, 1, 0, 1],
        stats=stats(2, 3, 1, timeouts=1, parse=1),
        finish="max_turns",
        restarts=1,
        index=1,
    )
    c = traj(  # spoiled by the infrastructure: counted, not scored
        reward_turns=[0.0],
        mask=[1, 1],
        prompt_len=8,
        stats=stats(1, 1, 0, infra=1),
        finish="engine_failed",
        infra=True,
        restarts=2,
        index=2,
    )
    return [a, b, c]


def test_rollout_metrics_exact(batch):
    m = rollout_metrics(batch)
    expected = {
        "episodes": 3,
        "generated_tokens": 4 + 3 + 2,
        "infra_faults": 1,
        "restarts": 3,
        "finish/done": 1 / 3,
        "finish/max_turns": 1 / 3,
        "finish/token_budget": 0.0,
        "finish/engine_failed": 1 / 3,
        # scored: a (reward 1.0) and b (reward 0.0)
        "episode_reward": 0.5,
        "episode_reward_std": 0.5,
        "episode_len": 2.0,
        "episode_tokens": ((10 + 6) + (10 + 4)) / 2,
        "success_rate": 0.5,
        "calls_right_rate": 0.5,
        "tool_success_rate": 3 / 5,  # pooled: (2 + 1) ok of (2 + 3) calls
        "tool_timeout_rate": 1 / 5,
        "parse_failure_rate": 1 / 4,  # 1 failure in 2 + 2 turns
    }
    assert m.keys() == expected.keys()
    for k, v in expected.items():
        assert m[k] == pytest.approx(v), k
    assert {f"finish/{r}" for r in FINISH_REASONS} <= m.keys()


def test_pooled_rate_differs_from_mean_of_rates(batch):
    a, b, _ = batch
    # per-episode rates 1.0 and 1/3 average to 2/3; pooled over calls it is 3/5
    assert rollout_metrics([a, b])["tool_success_rate"] == pytest.approx(0.6)


def test_empty_and_all_infra(batch):
    assert rollout_metrics([]) == {}
    only_infra = rollout_metrics([batch[2]])
    assert only_infra["infra_faults"] == 1 and only_infra["finish/engine_failed"] == 1.0
    assert "episode_reward" not in only_infra and "success_rate" not in only_infra


def test_no_calls_no_turns_gives_zero_rates():
    t = traj(reward_turns=[], mask=[], stats=stats(0, 0, 0), finish="token_budget")
    m = rollout_metrics([t])
    assert m["tool_success_rate"] == 0.0 and m["tool_timeout_rate"] == 0.0 and m["parse_failure_rate"] == 0.0
    assert m["finish/token_budget"] == 1.0 and m["episode_tokens"] == 10


def test_rejects_non_trajectories(batch):
    with pytest.raises(TypeError, match="Trajectory"):
        rollout_metrics([batch[0], {"reward": 1.0}])  # type: ignore[list-item]


def test_sample_rows_spread_over_rewards():
    rewards = [0.1, 0.9, 0.5, 0.3, 0.7]
    trajs = [traj(reward_turns=[r], mask=[1], stats=stats(1, 1, 1), index=i) for i, r in enumerate(rewards)]
    rows = sample_rows(trajs, 3)
    assert [r["reward"] for r in rows] == pytest.approx([0.9, 0.5, 0.1])  # best, middle, worst
    assert [r["task_id"] for r in rows] == ["t1", "t2", "t0"]
    assert set(rows[0]) == {
        "task_id",
        "sample_index",
        "reward",
        "turns",
        "finish_reason",
        "infra_fault",
        "conversation",
    }
    assert rows[0]["turns"] == 1 and rows[0]["finish_reason"] == "done"
    assert len(sample_rows(trajs, 10)) == 5
    assert sample_rows(trajs, 0) == [] and sample_rows([], 3) == []
    assert len({r["task_id"] for r in sample_rows(trajs, 4)}) == 4
    with pytest.raises(ValueError, match="n must be"):
        sample_rows(trajs, -1)


def test_conversation_text_is_cut():
    msgs = [
        {"role": "system", "content": "S" * 50},
        {"role": "user", "content": "begin " + "x" * 10_000},
        {"role": "assistant", "content": "y" * 10_000 + " the end"},
    ]
    t = traj(reward_turns=[1.0], mask=[1], stats=stats(1, 1, 1), messages=msgs)
    text = sample_rows([t], 1, max_chars=1000)[0]["conversation"]
    assert text.startswith("system: SSS") and text.endswith("the end")
    assert "characters cut" in text and len(text) < 1100
    short = conversation_text([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert short == "user: hi\nassistant: yo"


def test_prefix_cache_hit_rate_is_per_interval_and_survives_a_restart() -> None:
    engines = [
        {"engine_id": "a", "prefix_cache_queries": 100, "prefix_cache_hits": 60},
        {"engine_id": "b", "prefix_cache_queries": 50, "prefix_cache_hits": 10},
        {"backend": "hf", "engine_id": "c"},  # counts nothing: left out
        {"dead": True},
    ]
    first = prefix_cache_counts(engines)
    assert first == {"a": (100, 60), "b": (50, 10)}
    assert prefix_cache_hit_rate(first, {}) == pytest.approx(70 / 150)
    later = prefix_cache_counts(
        [
            {"engine_id": "a", "prefix_cache_queries": 200, "prefix_cache_hits": 150},  # +100 queries, +90 hits
            {"engine_id": "b", "prefix_cache_queries": 20, "prefix_cache_hits": 0},  # restarted: from 0
        ]
    )
    assert prefix_cache_hit_rate(later, first) == pytest.approx(90 / 120)
    assert prefix_cache_hit_rate(later, later) is None  # nothing looked up in between
    assert prefix_cache_hit_rate({}, {}) is None  # no vLLM engine
