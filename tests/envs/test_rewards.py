"""envs/rewards.py: each component with the default weights, ranges, the outcome, determinism, infra faults."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from configs.schema import HeuristicWeights
from envs.parsing import ParseError, ToolCall
from envs.rewards import (
    COMPONENTS,
    STEP_MAX,
    STEP_MIN,
    RewardState,
    answer_matches,
    clip_step,
    numbers_in,
    reward_heuristic,
)
from tasks.schema import GroundTruth

GT = GroundTruth.model_validate(
    {
        "task_id": "t1",
        "complexity": "medium",
        "max_turns": 6,
        "success": {"must_call_tool": "polygon.previous_close"},
        "tool_sequence": [
            {"step": 1, "server": "polygon", "tool": "previous_close", "params": {"ticker": "NVDA"}},
            {"step": 2, "server": "python", "tool": "run_python", "params": {"code": "print(1)"}},
        ],
        "limits": {"max_servers": 2, "max_tools": 2},
        "final_answer": {"value": 186.52, "tolerance": 0.01},
    }
)


@dataclass
class Result:
    ok: bool = True
    error_kind: str | None = None
    text: str = "{}"
    error: str | None = None
    latency_ms: float = 1.0

    @property
    def infra_fault(self) -> bool:
        return self.error_kind in ("upstream", "unavailable")


def call(name="polygon.previous_close", **args):
    server, tool = name.split(".")
    return ToolCall(server, tool, args)


def score(action, result=None, state=None, gt=GT):
    state = state if state is not None else RewardState()
    name = action.name if isinstance(action, ToolCall) else None
    return reward_heuristic(action, name, result, gt, state), state


def nonzero(r):
    return {k: v for k, v in r["components"].items() if v}


def test_perfect_first_call():
    r, state = score(call(ticker="NVDA"), Result())
    assert nonzero(r) == {
        "allowed_tool": 0.2,
        "must_call_first": 0.4,
        "expected_next": 0.2,
        "params_match": 0.1,
        "tool_ok": 0.1,
    }
    assert r["total_reward"] == pytest.approx(1.0)
    assert state.next_step == 1 and state.calls_run == 1 and not r["task_complete"] and not r["infra_fault"]
    assert set(r["components"]) == set(COMPONENTS)  # every component, always


def test_params_compared_loosely_but_must_all_be_there():
    r, _ = score(call(ticker=" nvda ", extra=1), Result())
    assert r["components"]["params_match"] == 0.1
    r, _ = score(call(ticker="AAPL"), Result())
    assert r["components"]["params_match"] == 0 and r["components"]["expected_next"] == 0.2
    r, _ = score(call(), Result())
    assert r["components"]["params_match"] == 0


def test_sequence_advances_and_completes():
    state = RewardState()
    score(call(ticker="NVDA"), Result(), state)
    r, _ = score(call("python.run_python", code="print(1)"), Result(), state)
    assert nonzero(r) == {"allowed_tool": 0.2, "expected_next": 0.2, "params_match": 0.1, "tool_ok": 0.1}
    # The calls are right, the task is not done: success is a right final answer.
    assert not r["task_complete"] and state.sequence_done(GT)
    assert not score("It is 3.", state=state)[0]["task_complete"]
    assert score("It is 186.52.", state=state)[0]["task_complete"]


def test_without_final_answer_the_calls_complete_the_task():
    gt = GT.model_copy(update={"final_answer": None})
    state = RewardState()
    score(call(ticker="NVDA"), Result(), state, gt=gt)
    r, _ = score(call("python.run_python", code="print(1)"), Result(), state, gt=gt)
    assert r["task_complete"]


def test_first_call_wrong_then_must_call_first_is_gone():
    state = RewardState()
    r, _ = score(call("fmp.company_profile", symbol="X"), Result(), state)
    assert nonzero(r) == {}  # a tool the task does not need earns nothing, though it ran
    r, _ = score(call(ticker="NVDA"), Result(), state)
    assert "must_call_first" not in nonzero(r) and r["components"]["expected_next"] == 0.2


def test_out_of_order_call_is_allowed_but_not_expected():
    r, state = score(call("python.run_python", code="print(1)"), Result())
    assert nonzero(r) == {"allowed_tool": 0.2, "tool_ok": 0.1} and state.next_step == 0


def test_exact_repeat_earns_nothing_more():
    state = RewardState()
    score(call("python.run_python", code="x"), Result(), state)
    r, _ = score(call("python.run_python", code="x"), Result(), state)
    assert r["total_reward"] == 0


def test_penalties():
    w = HeuristicWeights()
    r, state = score(ParseError("malformed", "bad json"))
    assert nonzero(r) == {"malformed": w.malformed} and state.calls_run == 0
    r, _ = score(ParseError("unknown_tool", "no such tool"))
    assert nonzero(r) == {"unknown_tool": w.unknown_tool}
    for kind in ("empty", "too_long", "no_action", "too_many_calls"):
        assert nonzero(score(ParseError(kind, "x"))[0]) == {"malformed": w.malformed}
    r, state = score(call(ticker="NVDA"), Result(ok=False, error_kind="invalid_arguments"))
    assert nonzero(r) == {"malformed": w.malformed} and state.calls_run == 0 and state.next_step == 0
    r, _ = score(call("polygon.nope"), Result(ok=False, error_kind="unknown_tool"))
    assert nonzero(r) == {"unknown_tool": w.unknown_tool}
    r, state = score(call(ticker="NVDA"), Result(ok=False, error_kind="timeout"))
    assert nonzero(r) == {"timeout": w.timeout} and state.calls_run == 0


def test_failed_run_earns_choice_but_not_progress():
    r, state = score(call(ticker="NVDA"), Result(ok=False, error_kind="sandbox"))
    assert nonzero(r) == {"allowed_tool": 0.2, "must_call_first": 0.4} and state.next_step == 0


@pytest.mark.parametrize("kind", ["upstream", "unavailable"])
def test_infra_fault_scores_zero_and_is_flagged(kind):
    r, state = score(call(ticker="NVDA"), Result(ok=False, error_kind=kind))
    assert r["total_reward"] == 0 and not nonzero(r) and r["infra_fault"]
    assert state.calls_run == 0  # the first-call bonus is still there for the retry
    r, _ = score(call(ticker="NVDA"), Result(), state)
    assert r["components"]["must_call_first"] == 0.4


def test_outcome_numbers():
    assert score("The close was $186.52.")[0]["components"]["outcome"] == 1.0
    assert score("186.525")[0]["components"]["outcome"] == 1.0  # within tolerance
    assert score("about 186.6")[0]["components"]["outcome"] == 0.0
    assert score("no idea", state=RewardState(calls_tried=1))[0]["total_reward"] == 0.0
    r, state = score("It closed at 186.52")
    assert r["task_complete"] and state.answered


def test_an_answer_before_any_try_is_a_guess():
    w = HeuristicWeights()
    assert nonzero(score("no idea")[0]) == {"guess": w.guess}
    assert nonzero(score("It closed at 186.52")[0]) == {"guess": w.guess, "outcome": w.outcome}
    no_tools = GT.model_copy(update={"tool_sequence": []})
    assert nonzero(score("no idea", gt=no_tools)[0]) == {}
    # a rejected call, an unreadable turn or a call that ran: each is a try, and beats the guess
    for first, result in [
        (call(ticker="NVDA"), Result(ok=False, error_kind="invalid_arguments")),
        (ParseError("no_action", "x"), None),
        (call("polygon.nope"), Result(ok=False, error_kind="unknown_tool")),
    ]:
        r1, state = score(first, result)
        r2, _ = score("no idea", state=state)
        assert "guess" not in nonzero(r2)
        assert r1["total_reward"] + r2["total_reward"] > score("no idea")[0]["total_reward"]


def test_outcome_thousands_and_text():
    gt = GT.model_copy(update={"final_answer": GT.final_answer.model_copy(update={"value": 6101217.0, "tolerance": 0})})
    assert score("Volume: 6,101,217 shares", gt=gt)[0]["components"]["outcome"] == 1.0
    assert numbers_in("a -1.5e3 b 2,000.25 c .5") == [-1500.0, 2000.25, 0.5]
    text_gt = GT.model_copy(update={"final_answer": GT.final_answer.model_copy(update={"value": "Tesla,  Inc."})})
    assert answer_matches("the company is TESLA, INC. (TSLA)", text_gt)
    assert not answer_matches("Tesla Motors", text_gt)


def test_outcome_cannot_be_won_by_listing_numbers():
    spam = " ".join(str(i) for i in range(1000)) + " 186.52"
    assert score(spam)[0]["components"]["outcome"] == 0.0


def test_no_final_answer_pays_outcome_after_the_sequence():
    gt = GT.model_copy(update={"final_answer": None})
    assert score("done", gt=gt)[0]["components"]["outcome"] == 0.0
    state = RewardState(next_step=2)
    assert score("done", state=state, gt=gt)[0]["components"]["outcome"] == 1.0


def test_ground_truth_as_dict():
    r, _ = score(call(ticker="NVDA"), Result(), gt=GT.model_dump())
    assert r["total_reward"] == pytest.approx(1.0)


def _random_events(seed: int):
    rng = random.Random(seed)
    names = ["polygon.previous_close", "python.run_python", "fmp.company_profile", "polygon.nope"]
    kinds = [None, None, None, "invalid_arguments", "unknown_tool", "timeout", "sandbox", "upstream", "unavailable"]
    state = RewardState(calls_run=rng.randint(0, 2), next_step=rng.randint(0, 2), seen_calls=set(), answered=False)
    events = []
    for _ in range(rng.randint(1, 6)):
        roll = rng.random()
        if roll < 0.15:
            events.append((ParseError(rng.choice(["malformed", "unknown_tool", "no_action"]), "x"), None))
        elif roll < 0.3:
            events.append((rng.choice(["186.52", "0", "x", "186.53 and 7"]), None))
        else:
            kind = rng.choice(kinds)
            args = rng.choice([{}, {"ticker": "NVDA"}, {"code": "print(1)"}, {"ticker": "x"}])
            events.append((call(rng.choice(names), **args), Result(ok=kind is None, error_kind=kind)))
    return state, events


def _turn_total(state, events):
    comps = {k: 0.0 for k in COMPONENTS}
    for action, result in events:
        name = action.name if isinstance(action, ToolCall) else None
        r = reward_heuristic(action, name, result, GT, state)
        assert -0.5 - 1e-9 <= r["total_reward"] <= 1.0 + 1e-9  # one event, default weights
        for k, v in r["components"].items():
            comps[k] += v
    return clip_step(sum(comps.values())), comps


def test_step_reward_within_bounds_over_random_turns():
    for seed in range(2000):
        state, events = _random_events(seed)
        total, _ = _turn_total(state, events)
        assert STEP_MIN <= total <= STEP_MAX


def test_deterministic():
    for seed in range(200):
        a = _turn_total(*_random_events(seed))
        b = _turn_total(*_random_events(seed))
        assert a == b


# --------------------------------------------------------------------------- must_call_tool: a server


SERVER_GT = GT.model_copy(update={"success": GT.success.model_copy(update={"must_call_tool": "polygon"})})
# A server-only must_call pays a first call to any tool of that server that the task needs.
OPEN_SERVER_GT = GroundTruth.model_validate(
    {
        **SERVER_GT.model_dump(),
        "limits": {"max_servers": 1, "max_tools": 3},
        "tool_sequence": [
            {"step": i + 1, "server": "polygon", "tool": tool, "params": {"ticker": "NVDA"}}
            for i, tool in enumerate(("previous_close", "ticker_details", "daily_aggregates"))
        ],
    }
)


@pytest.mark.parametrize("tool", ["previous_close", "ticker_details", "daily_aggregates"])
def test_server_only_must_call_pays_for_any_tool_of_that_server(tool):
    r, _ = score(call(f"polygon.{tool}", ticker="NVDA"), Result(), gt=OPEN_SERVER_GT)
    assert r["components"]["must_call_first"] == 0.4
    r, _ = score(call(f"polygon.{tool}", ticker="NVDA"), Result(), gt=SERVER_GT)  # only the tools the task needs
    assert r["components"]["must_call_first"] == (0.4 if tool == "previous_close" else 0)
    r, _ = score(call(f"polygon.{tool}", ticker="NVDA"), Result(), gt=GT)  # the tool form: only that tool
    assert r["components"]["must_call_first"] == (0.4 if tool == "previous_close" else 0)


def test_server_only_must_call_not_for_another_server_nor_a_later_call():
    r, state = score(call("python.run_python", code="print(1)"), Result(), gt=SERVER_GT)
    assert r["components"]["must_call_first"] == 0 and r["components"]["allowed_tool"] == 0.2
    r, _ = score(call("polygon.ticker_details", ticker="NVDA"), Result(), state, gt=SERVER_GT)
    assert r["components"]["must_call_first"] == 0  # only the first call that ran counts
    r, _ = score(call("polygonx.previous_close", ticker="NVDA"), Result(), gt=SERVER_GT)  # a prefix is no match
    assert r["components"]["must_call_first"] == 0


def test_server_only_must_call_in_mcp_tool_env():
    """MCPToolEnv's heuristic on a server-only row, against the real polygon server in process."""
    from configs.schema import ToolsConfig
    from envs.mcp_tool_env import MCPToolEnv, run_sync
    from envs.parsing import format_tool_call
    from envs.tool_client import set_tool_client
    from serve_apps.tool_pool import LocalToolPool

    tools = ToolsConfig.model_validate({"servers": {"tavily": {"enabled": False}, "slack": {"enabled": False}}})
    row = {
        "data_source": "mcprl/test",
        "prompt": [{"role": "user", "content": "What was NVDA's last close?"}],
        "reward_spec": {"ground_truth": OPEN_SERVER_GT.model_dump()},
    }
    pool = run_sync(LocalToolPool.create(tools))
    set_tool_client(pool)
    try:
        rewards = {}
        for name in ("polygon.ticker_details", "fmp.company_profile"):
            env = MCPToolEnv({}, row)
            env.init(row["prompt"])
            args = {"ticker": "NVDA"} if name.startswith("polygon") else {"symbol": "NVDA"}
            out = env.step(format_tool_call(name, args))
            assert [c["ok"] for c in out["metadata"]["calls"]] == [True], out["metadata"]
            rewards[name] = out["metadata"]["reward_components"]["must_call_first"]
    finally:
        set_tool_client(None)
        run_sync(pool.close())
    assert rewards == {"polygon.ticker_details": 0.4, "fmp.company_profile": 0.0}


@pytest.mark.parametrize("must_call", ["polygon.previous_close", "polygon"])
def test_no_component_pays_a_tool_the_task_does_not_need(must_call):
    """The demo's GRPO learned to make its most frequent call (daily_aggregates) on every task: it ran, and
    tool_ok paid for it. Neither a first call on the must-call server nor a clean run pays an unneeded tool."""
    gt = GT.model_copy(update={"success": GT.success.model_copy(update={"must_call_tool": must_call})})
    state = RewardState()
    r, _ = score(
        call("polygon.daily_aggregates", ticker="NVDA", start="2026-01-01", end="2026-01-02"), Result(), state, gt
    )
    assert r["total_reward"] == 0 and nonzero(r) == {}
    r, _ = score(call(ticker="NVDA"), Result(), state, gt)  # the needed call still earns what it earns
    assert r["components"]["tool_ok"] == 0.1 and r["components"]["expected_next"] == 0.2
