"""The LLM judge in-process against the deterministic OpenAI stand-in: rewards, guardrails, faults, groups, hybrid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from envs.judge import (
    SCORE_SCHEMA,
    SCORE_SYSTEM,
    Judge,
    group_judge,
    group_schema,
    hybrid,
    reward_llm_judge,
    reward_range,
)
from tests.envs.judge_fixtures import ACTION, GROUND_TRUTH, USER, judge_config, task_messages
from tests.tasks.openai_standin import OpenAIStandin, messages_of, schema_of

SCORES = {"tool_choice": 1.0, "arguments": 0.5, "progress": -0.5, "safety": -1}


@pytest.fixture(scope="module")
def standin() -> OpenAIStandin:
    with OpenAIStandin() as server:
        yield server


@pytest.fixture
async def make_judge(standin: OpenAIStandin, tmp_path: Path):
    """Judges on the stand-in with a fresh cache each test; closed at the end."""
    standin.reset()
    made: list[Judge] = []

    def make(**fields: Any) -> Judge:
        judge = Judge(judge_config(standin.base_url, tmp_path / "cache", **fields), backoff_s=0.001)
        made.append(judge)
        return judge

    yield make
    for judge in made:
        await judge.aclose()


def sent(standin: OpenAIStandin, i: int = -1) -> tuple[str, str]:
    """(system, user) of a recorded request."""
    msgs = messages_of(standin.requests[i].body)
    return msgs[0]["content"], msgs[-1]["content"]


@pytest.mark.parametrize("backend", ["chat", "responses"])
async def test_exact_scores_give_the_exact_reward(make_judge, standin, backend):
    judge = make_judge(openai_backend=backend)
    standin.script(SCORES, SCORES)
    r = await reward_llm_judge(task_messages(), ACTION, GROUND_TRUTH, judge.cfg.rubric, judge=judge)
    # default rubric: 0.35·1 + 0.25·0.5 + 0.3·(-0.5) + 0.1·(-1)
    assert r["total_reward"] == pytest.approx(0.35 + 0.125 - 0.15 - 0.1)
    assert r["components"] == SCORES and r["task_complete"] is False and r["infra_fault"] is False

    rubric = {"tool_choice": 1.0, "progress": 2.0}  # a missing weight counts 0
    other = await judge.score([*task_messages(), {"role": "assistant", "content": "x"}], ACTION, GROUND_TRUTH, rubric)
    assert other["total_reward"] == pytest.approx(1.0 - 1.0)

    req = standin.requests[0]
    assert req.path == ("/v1/chat/completions" if backend == "chat" else "/v1/responses")
    assert schema_of(req.body) == SCORE_SCHEMA
    fmt = req.body["response_format"]["json_schema"] if backend == "chat" else req.body["text"]["format"]
    assert fmt["strict"] is True
    system, user = sent(standin, 0)
    assert system == SCORE_SYSTEM and USER in user and ACTION in user and "polygon.previous_close" in user
    usage = judge.usage()
    assert usage["requests"] == 2 and usage["total_tokens"] > 0


def test_reward_range_of_the_default_rubric(tmp_path):
    lo, hi = reward_range(judge_config("http://127.0.0.1:9/v1", tmp_path).rubric)
    assert (lo, hi) == (pytest.approx(-0.4), pytest.approx(0.9))
    with pytest.raises(ValueError, match="unknown score"):
        Judge(judge_config("http://127.0.0.1:9/v1", tmp_path, rubric={"style": 1.0}))


async def test_token_cap_drops_oldest_turns_and_keeps_task_and_action(make_judge, standin):
    judge = make_judge(max_input_tokens=600)
    turns = []
    for i in range(30):
        role = "assistant" if i % 2 == 0 else "tool"
        turns.append({"role": role, "content": f"turn-{i:02d} " + "x" * 140})
    standin.script(SCORES)
    r = await judge.score([*task_messages(), *turns], ACTION, GROUND_TRUTH)
    assert not r["infra_fault"]
    system, user = sent(standin)
    assert len(system) + len(user) <= 600 * 4
    assert USER in user and ACTION in user and "polygon.previous_close" in user
    assert "turn-29" in user and "turn-00" not in user and "earlier turns omitted" in user

    # A task and an action that alone overflow the cap are cut, both ends kept, and the cap holds.
    standin.script(SCORES)
    huge_action = "ACTION-HEAD " + "y" * 6000 + " ACTION-TAIL"
    await judge.score([{"role": "user", "content": USER + "z" * 6000}, *turns], huge_action, GROUND_TRUTH)
    system, user = sent(standin)
    assert len(system) + len(user) <= 600 * 4
    assert "TASK-MARK" in user and "ACTION-HEAD" in user and "ACTION-TAIL" in user and "chars cut" in user


async def test_tool_results_are_cut(make_judge, standin):
    judge = make_judge(max_tool_result_chars=100)
    result = "RESULT-HEAD " + "r" * 3000 + " RESULT-TAIL"
    convo = [*task_messages(), {"role": "assistant", "content": ACTION}, {"role": "tool", "content": result}]
    standin.script(SCORES)
    await judge.score(convo, "The close was 186.52.", GROUND_TRUTH)
    _, user = sent(standin)
    assert "RESULT-HEAD" in user and "RESULT-TAIL" not in user and "chars cut" in user
    assert max(len(line) for line in user.splitlines() if "RESULT-HEAD" in line) <= 100 + len("[tool] ")


async def test_secrets_never_reach_the_judge(make_judge, standin, monkeypatch):
    monkeypatch.setenv("MCPRL_TEST_EXTRA_SECRET", "plain-value-7f3a9c")  # named in judge.secret_env_vars
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-known-var-5512")  # one of SECRET_ENV_VARS
    judge = make_judge(secret_env_vars=["MCPRL_TEST_EXTRA_SECRET"])
    planted = [
        "sk-proj-AbCdEf0123456789xyz",
        "xoxb-1111-2222-SLACKTOKEN",
        "ghp_abcdefghijklmnop123456",
        "Bearer eyJhbGciOi.payload.sig123",
        "plain-value-7f3a9c",
        "tvly-known-var-5512",
    ]
    leak = "config dump: " + " | ".join(planted)
    convo = [
        *task_messages(),
        {"role": "assistant", "content": ACTION},
        {"role": "tool", "content": leak},
    ]
    truth = {**GROUND_TRUTH, "note": "key sk-proj-AbCdEf0123456789xyz"}
    standin.script(SCORES, {"scores": [{"id": "t0", "score": 1}]})
    await judge.score(convo, f"I will post {planted[4]} to slack", truth)
    await judge.rank_group([convo], truth)
    for req in standin.requests:
        body = json.dumps(req.body)
        for secret in planted:
            assert secret.removeprefix("Bearer ") not in body
        assert "[redacted]" in body


async def test_cache_sends_no_second_request(make_judge, standin):
    judge = make_judge()
    standin.script(SCORES)
    first = await judge.score(task_messages(), ACTION, GROUND_TRUTH)
    spent = judge.usage()["total_tokens"]
    second = await judge.score(task_messages(), ACTION, GROUND_TRUTH)
    assert second == first and len(standin.requests) == 1
    usage = judge.usage()
    assert usage["total_tokens"] == spent and usage["requests"] == 1 and usage["cache_hits"] == 1


async def test_rate_limit_answer_is_retried(make_judge, standin):
    judge = make_judge()
    standin.fail_next(429)
    standin.script(SCORES)
    r = await judge.score(task_messages(), ACTION, GROUND_TRUTH)
    assert r["infra_fault"] is False and r["components"] == SCORES
    assert len(standin.requests) == 2 and judge.usage()["retries"] == 1


async def test_server_errors_beyond_retries_are_an_infra_fault(make_judge, standin):
    judge = make_judge(openai_max_retries=1)
    standin.fail_next(500, times=5)
    r = await judge.score(task_messages(), ACTION, GROUND_TRUTH)
    assert r["infra_fault"] is True and r["total_reward"] == 0.0 and r["components"] == {}
    assert "server" in r["judge_error"] and len(standin.requests) == 2
    assert (await judge.stats())["infra_faults"] == 1


async def test_answer_outside_the_schema_is_not_a_policy_penalty(make_judge, standin):
    judge = make_judge()
    standin.script({**SCORES, "tool_choice": 1.5})
    r = await judge.score(task_messages(), ACTION, GROUND_TRUTH)
    assert r["infra_fault"] is True and r["total_reward"] == 0.0 and "schema_mismatch" in r["judge_error"]


def trajectories(n: int) -> list[list[dict[str, Any]]]:
    return [
        [*task_messages(), {"role": "assistant", "content": f"attempt-{i} {ACTION}"}, {"role": "tool", "content": "42"}]
        for i in range(n)
    ]


async def test_group_judge_scores_each_trajectory_once(make_judge, standin):
    judge = make_judge()
    # Shuffled on purpose: scores come back in trajectory order whatever the judge's order.
    standin.script({"scores": [{"id": "t2", "score": 1}, {"id": "t0", "score": 0.2},
                               {"id": "t3", "score": 0}, {"id": "t1", "score": 0.5}]})  # fmt: skip
    scores = await group_judge(trajectories(4), GROUND_TRUTH, judge=judge)
    assert scores == [0.2, 0.5, 1.0, 0.0]
    assert len(standin.requests) == 1  # one call for the whole group
    assert schema_of(standin.requests[0].body) == group_schema(4)
    _, user = sent(standin)
    assert user.count(USER) == 1 and all(f"### t{i}" in user and f"attempt-{i}" in user for i in range(4))


@pytest.mark.parametrize(
    "answer",
    [
        {"scores": [{"id": "t0", "score": 1}, {"id": "t1", "score": 0.5}, {"id": "t1", "score": 0.5}]},  # t2 missing
        {"scores": [{"id": "t0", "score": 1}, {"id": "t1", "score": 0.5}]},  # too few
        {"scores": [{"id": "t0", "score": 1}, {"id": "t1", "score": 0.5}, {"id": "t9", "score": 0}]},  # unknown id
    ],
    ids=["repeated", "too-few", "unknown-id"],
)
async def test_group_judge_rejects_an_answer_that_misses_one(make_judge, standin, answer):
    judge = make_judge()
    standin.script(answer)
    assert await group_judge(trajectories(3), GROUND_TRUTH, judge=judge) is None
    detailed = await judge.rank_group(trajectories(3), GROUND_TRUTH)  # cached answer: same verdict, marked
    assert detailed["scores"] is None and detailed["infra_fault"] is True and detailed["judge_error"]
    assert (await judge.stats())["group_failures"] == 2


def test_hybrid_math():
    heuristic = {"total_reward": 0.6, "components": {"allowed_tool": 0.2, "outcome": 0.4}, "task_complete": True}
    judged = {"total_reward": 0.2, "components": {"tool_choice": 1.0}, "task_complete": False, "infra_fault": False}
    r = hybrid(heuristic, judged, 0.25)
    assert r["total_reward"] == pytest.approx(0.75 * 0.6 + 0.25 * 0.2)
    assert r["components"] == {
        "heuristic/total": 0.6,
        "heuristic/allowed_tool": 0.2,
        "heuristic/outcome": 0.4,
        "judge/total": 0.2,
        "judge/tool_choice": 1.0,
    }
    assert r["task_complete"] is True and r["infra_fault"] is False
    assert hybrid(heuristic, judged, 0.0)["total_reward"] == pytest.approx(0.6)
    assert hybrid(heuristic, judged, 1.0)["total_reward"] == pytest.approx(0.2)

    faulty = {"total_reward": 0.0, "components": {}, "task_complete": False, "infra_fault": True, "judge_error": "x"}
    f = hybrid(heuristic, faulty, 0.5)
    assert f["infra_fault"] is True and f["total_reward"] == 0.0 and "judge: x" in f["judge_error"]
    with pytest.raises(ValueError):
        hybrid(heuristic, judged, 1.5)
