"""A trainer that is not ours, driving MCPToolEnv the way SkyRL's generator does.

    python -m tests.envs.skyrl_harness ENV_CONFIG.yaml ROWS.jsonl [--threads 4]

Run in a fresh process: nothing of mcprl is set up beforehand, no tool client is registered. The env
config comes from YAML (SkyRL reads its `env_config` from its own YAML), every env is built with
`skyrl_gym.make(env_class, env_config=..., extras=row)`, and `init` / `step` / `close` run in a thread
pool through `loop.run_in_executor`, several episodes at once. Each episode plays the row's expert
turns (the calls of its tool_sequence, then the answer). Prints one JSON object: per episode the
rewards, the done flags, the observations and the env's metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import skyrl_gym
import yaml

import envs
from envs.parsing import expert_turns
from tasks.io import read_rows


async def episode(loop: asyncio.AbstractEventLoop, pool: ThreadPoolExecutor, env_config: Any, row: dict) -> dict:
    env = await loop.run_in_executor(pool, lambda: skyrl_gym.make(row["env_class"], env_config=env_config, extras=row))
    messages, info = await loop.run_in_executor(pool, env.init, row["prompt"])
    steps = []
    for action in expert_turns(row):
        out = await loop.run_in_executor(pool, env.step, action)
        steps.append(
            {
                "reward": out["reward"],
                "done": out["done"],
                "observations": [m["content"] for m in out["observations"]],
                "infra_fault": out["metadata"].get("infra_fault"),
            }
        )
        if out["done"]:
            break
    await loop.run_in_executor(pool, env.close)
    return {
        "task_id": info["task_id"],
        "system": messages[0]["content"] if messages[0]["role"] == "system" else "",
        "tools_shown": info["tools"],
        "steps": steps,
        "metrics": env.get_metrics(),
    }


async def main(config_path: str, rows_path: str, threads: int) -> None:
    env_config = yaml.safe_load(open(config_path))
    rows = read_rows(rows_path)
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = await asyncio.gather(*(episode(loop, pool, env_config, row) for row in rows))
    print(json.dumps({"episodes": results}))


if __name__ == "__main__":
    envs.register_env()  # as a SkyRL user's entry point does, before skyrl_gym.make
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("env_config")
    parser.add_argument("rows")
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(main(args.env_config, args.rows, args.threads))
