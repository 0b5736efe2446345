"""Score one action of one task with the configured LLM judge, and show the breakdown.

python -m jobs.try_judge --tasks FILE [--row N] [--action TEXT] [--config FILE] [--set KEY=VALUE ...]

The conversation is the task row's prompt (system + user) and one assistant turn: `--action`, or by
default a call of the task's first expected tool with its expected arguments
(`<tool_call>{"name": "server.tool", "arguments": {...}}</tool_call>`). The judge runs in this process
(no Ray) with `reward.judge` from the config; OPENAI_MODEL, OPENAI_BACKEND and OPENAI_BASE_URL override
its endpoint unless `--set reward.judge.openai.<key>` names it. Prints each score, its weight and its
share of the total, the total and the rubric's range, and the tokens spent (0 when the answer came
from the cache).

Exit status: 0 scored; 1 the judge failed (unreachable, or an answer outside the schema);
2 bad input (options, config, task file, a missing API key for a non-local endpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from pydantic import ValidationError

from configs.loader import ConfigError, apply_openai_env
from configs.schema import Config
from envs.parsing import format_tool_call
from jobs.cli import base_parser, setup, usage_error
from tasks.io import TaskFileError, read_rows
from tasks.schema import TaskRow


def build_parser() -> argparse.ArgumentParser:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tasks", required=True, metavar="FILE", help="task file (.jsonl, .json or .parquet)")
    p.add_argument("--row", type=int, default=0, help="0-based row of the file (default 0)")
    p.add_argument("--action", help="the assistant turn to judge (default: the expected first tool call)")
    return p


def load_row(path: str, index: int) -> TaskRow:
    try:
        rows = read_rows(path)
    except TaskFileError as e:
        usage_error(str(e))
    if not 0 <= index < len(rows):
        usage_error(f"--row {index}: {path} has {len(rows)} rows (0..{len(rows) - 1})")
    try:
        return TaskRow.model_validate(rows[index])
    except ValidationError as e:
        usage_error(f"{path} row {index} is not a valid task: {e.errors()[0]['msg']}")


def default_action(row: TaskRow) -> str:
    first = row.reward_spec.ground_truth.tool_sequence[0]
    return format_tool_call(f"{first.server}.{first.tool}", first.params)


def conversation_of(row: TaskRow, action: str) -> list[dict[str, Any]]:
    return [*(m.model_dump() for m in row.prompt), {"role": "assistant", "content": action}]


async def run(cfg: Config, row: TaskRow, action: str) -> int:
    from envs.judge import Judge, reward_range
    from tasks.openai_client import MissingAPIKey

    jc = cfg.reward.judge
    try:
        judge = Judge(jc)
    except MissingAPIKey as e:
        usage_error(f"{e} (the judge's endpoint is reward.judge.openai.base_url)")
    except ValueError as e:  # a rubric with unknown scores
        usage_error(str(e))
    try:
        truth = row.reward_spec.ground_truth.model_dump(mode="json")
        result = await judge.score(conversation_of(row, action), action, truth, jc.rubric)
        usage = judge.usage()
    finally:
        await judge.aclose()

    print(f"task {row.task_id}: {row.user_message}")
    print(f"action: {action}")
    print(f"judge: {jc.openai.model} via {jc.openai.backend} at {judge.client.base_url}")
    if result.get("infra_fault"):
        print(f"judge failed (infrastructure fault, not scored): {result.get('judge_error')}")
        return 1
    print(f"{'score':<12} {'value':>7} {'weight':>7} {'share':>7}")
    for name, value in result["components"].items():
        weight = jc.rubric.get(name, 0.0)
        print(f"{name:<12} {value:>7.3f} {weight:>7.3f} {weight * value:>7.3f}")
    lo, hi = reward_range(jc.rubric)
    print(f"total        {result['total_reward']:>7.3f}   (range {lo:.2f} .. {hi:.2f})")
    print(
        f"tokens: {usage['total_tokens']} (prompt {usage['prompt_tokens']}, completion {usage['completion_tokens']}), "
        f"requests {usage['requests']}, cache hits {usage['cache_hits']}, retries {usage['retries']}"
    )
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cfg = setup(args)
    try:
        apply_openai_env(cfg.reward.judge.openai, "reward.judge.openai", args.overrides, os.environ)
    except ConfigError as e:
        usage_error(str(e))
    row = load_row(args.tasks, args.row)
    action = args.action if args.action is not None else default_action(row)
    if not action.strip():
        usage_error("--action is empty")
    sys.exit(asyncio.run(run(cfg, row, action)))


if __name__ == "__main__":
    main()
