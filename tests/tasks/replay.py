"""Task rows' expert calls replayed on a tool pool, for the generators' tests."""

from __future__ import annotations

from typing import Any

from tasks.observation import result_text


async def longest_shown(pool: Any, rows: list[dict[str, Any]]) -> int:
    """The longest result any row's `tool_sequence` returns, rendered as the env shows it; every call must
    succeed."""
    longest = 0
    for row in rows:
        for step in row["reward_spec"]["ground_truth"]["tool_sequence"]:
            res = await pool.call_tool(step["server"], step["tool"], step["params"])
            assert res.ok, (row["reward_spec"]["ground_truth"]["task_id"], step, res.error)
            longest = max(longest, len(result_text(f"{step['server']}.{step['tool']}", res)))
    return longest
