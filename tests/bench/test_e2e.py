"""Suite `e2e` run as a user runs it: `python -m bench --suite e2e --quick` in a fresh process, which
itself starts TRL's GRPOTrainer and `jobs.train` (tiny-random, 2 steps each, on their own embedded
processes; no Ray cluster of the test session is joined)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.bench.suite_run import run_suite

pytest.importorskip("trl", reason="TRL is the baseline: pip install -e '.[bench]'")


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(600)
def test_e2e_quick_writes_sensible_figures(tmp_path: Path) -> None:
    proc = run_suite(tmp_path, "e2e", timeout=580)
    assert "TRL / mcprl step time" in proc.stdout

    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert (tmp_path / "e2e.png").stat().st_size > 0
    table = (tmp_path / "e2e.md").read_text()
    assert "wall time per step" in table and "TRL 1.16 GRPOTrainer" in table

    rows = {r["figure"]: r for r in doc["rows"]}
    assert set(rows) == {
        "wall time per step",
        "episodes/s end to end",
        "tokens/s end to end",
        "reward after N steps (noisy)",
        "start-up + teardown",
    }
    for row in rows.values():
        for side in (row["ours"], row["baseline"]):
            assert side["n"] == 1 and all(math.isfinite(v) for v in side["values"])
    for name in ("wall time per step", "episodes/s end to end", "tokens/s end to end", "start-up + teardown"):
        assert rows[name]["ours"]["median"] > 0 and rows[name]["baseline"]["median"] > 0
        assert rows[name]["ratio"] > 0
    assert rows["reward after N steps (noisy)"]["ratio"] is None or rows["reward after N steps (noisy)"]["ratio"] > 0

    report = doc["report"]
    assert report["options"]["model"] == "tiny-random" and report["options"]["steps"] == 2
    for side in ("TRL", "mcprl"):
        (run,) = report["runs"][side]
        # Every step played tasks_per_step x group_size episodes, each with a prompt of hundreds of tokens.
        assert [s["episodes"] for s in run["steps"]] == [4 * 2, 4 * 2]
        assert all(s["tokens"] > 8 * 100 for s in run["steps"])
        assert all(-5 <= s["reward"] <= 5 and 1 <= s["turns"] <= 2 for s in run["steps"])
    # The same prompts on both sides: per-episode tokens within a factor of each other (the episodes differ).
    per_step = report["tokens_per_step"]
    assert 0.25 < per_step["TRL"] / per_step["mcprl"] < 4
    assert "TRL" in " ".join(doc["notes"]) and doc["notes"]

    # Each run's console is kept, its lines stamped with the seconds since the run's start, in order.
    for side in ("TRL", "mcprl"):
        lines = (tmp_path / "e2e-runs" / f"{side}-1.log").read_text().splitlines()
        stamps = [float(line.split()[0]) for line in lines if line.strip()]
        assert stamps and stamps == sorted(stamps) and stamps[-1] < 580
    assert "step 2 |" in (tmp_path / "e2e-runs" / "mcprl-1.log").read_text()
    metrics = (tmp_path / "e2e-runs" / "mcprl-1.metrics.jsonl").read_text().splitlines()
    assert sum("timing/train_s" in json.loads(line) for line in metrics) == 2


@pytest.fixture(scope="module")
def polygon(rule_tasks: Callable[..., list[dict[str, Any]]]) -> Iterator[tuple[Any, list[dict[str, Any]]]]:
    """The offline polygon server in this process, and one rule task that calls it (bench.doubles.rule_rows(12)'s
    tasks, made in this process)."""
    from configs.schema import BuiltinServers, ToolsConfig
    from envs.mcp_tool_env import run_sync
    from serve_apps.tool_pool import LocalToolPool

    cfg = ToolsConfig.model_validate({"servers": {n: {"enabled": n == "polygon"} for n in BuiltinServers.model_fields}})
    pool = run_sync(LocalToolPool.create(cfg))
    rows = [
        r
        for r in rule_tasks("--n", "12", "--seed", "0")
        if {s["server"] for s in r["reward_spec"]["ground_truth"]["tool_sequence"]} == {"polygon"}
    ]
    assert rows, "rule tasks on polygon alone"
    yield pool, rows
    run_sync(pool.close())


def test_trl_is_shown_the_prompt_mcprl_renders(polygon: tuple[Any, list[dict[str, Any]]]) -> None:
    from actors.models import load_tokenizer
    from bench.trl_baseline import pool_tools
    from configs.schema import EnvConfig, ModelConfig
    from envs.chat_template import served_chat_template
    from envs.mcp_tool_env import MCPToolEnv
    from envs.prompting import render

    pool, rows = polygon
    env_cfg = EnvConfig()
    tokenizer = load_tokenizer(ModelConfig(name="tiny-random"))
    ours = MCPToolEnv({"env": env_cfg}, rows[0], tool_client=pool)
    messages, _ = ours.init()
    ours.close()
    expected = render(tokenizer, messages)  # SmolLM2's template ignores tools: the env put them in the system message

    tools = pool_tools(pool, {"polygon"}, env_cfg)
    assert {t.__name__ for t in tools} == {
        "polygon.previous_close",
        "polygon.daily_aggregates",
        "polygon.ticker_details",
    }
    tokenizer.chat_template = served_chat_template(tokenizer, env_cfg)
    shown = tokenizer.apply_chat_template(rows[0]["prompt"], tools=tools, add_generation_prompt=True, tokenize=False)
    assert shown == expected


def test_trl_completions_get_mcprl_episode_reward(polygon: tuple[Any, list[dict[str, Any]]]) -> None:
    from bench.trl_baseline import episode_reward, pool_tools
    from configs.schema import EnvConfig

    pool, rows = polygon
    row = rows[0]
    env_config = {"env": EnvConfig()}
    step = row["reward_spec"]["ground_truth"]["tool_sequence"][0]
    name = f"{step['server']}.{step['tool']}"
    (tool,) = [t for t in pool_tools(pool, {"polygon"}, EnvConfig()) if t.__name__ == name]
    result = tool(**step["params"])
    assert result.startswith(f"{name} returned:")
    value = row["reward_spec"]["ground_truth"]["final_answer"]["value"]
    # As TRL's loop leaves it: a parsed call, the tool's message, then the answer turn.
    expert = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": step["params"]}}],
        },
        {"role": "tool", "name": name, "content": result},
        {"role": "assistant", "content": f"<answer>{value}</answer>"},
    ]
    silent = [{"role": "assistant", "content": "I do not know."}]
    good, bad = episode_reward(row, expert, pool, env_config), episode_reward(row, silent, pool, env_config)
    assert good > 1.0 > bad, (good, bad)
