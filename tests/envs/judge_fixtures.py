"""What the judge tests share: a task's ground truth and conversation, and a judge config for a local server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from configs.schema import JudgeConfig
from tasks.schema import GroundTruth

SYSTEM = "You are a financial research assistant that calls tools."
USER = "TASK-MARK: What was NVDA's previous close?"
ACTION = '<tool_call>{"name": "polygon.previous_close", "arguments": {"ticker": "NVDA"}}</tool_call>'

GROUND_TRUTH: dict[str, Any] = GroundTruth.model_validate(
    {
        "task_id": "t-judge-1",
        "complexity": "simple",
        "max_turns": 4,
        "success": {"must_call_tool": "polygon.previous_close"},
        "tool_sequence": [{"step": 1, "server": "polygon", "tool": "previous_close", "params": {"ticker": "NVDA"}}],
        "limits": {"max_servers": 1, "max_tools": 1},
        "final_answer": {"value": 186.52, "tolerance": 0.01, "description": "NVDA close"},
    }
).model_dump()


def task_messages() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


def judge_config(base_url: str, cache: Path, **fields: Any) -> JudgeConfig:
    """A judge config pointing at `base_url`; `fields` override JudgeConfig (or `openai_<field>` its openai)."""
    openai = {k.removeprefix("openai_"): v for k, v in fields.items() if k.startswith("openai_")}
    rest = {k: v for k, v in fields.items() if not k.startswith("openai_")}
    return JudgeConfig.model_validate(
        {
            "openai": {
                "base_url": base_url,
                "model": "judge-standin",
                "api_key_env": "MCPRL_TEST_JUDGE_KEY",  # unset: a loopback server needs none
                "temperature": 0,
                "cache_dir": str(cache),
                "max_retries": 2,
                **openai,
            },
            **rest,
        }
    )
