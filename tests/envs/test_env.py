"""MCPToolEnv made through skyrl_gym.make from rule-generated rows and driven like SkyRL's generator:
init, then step until done, against the in-process tool pool."""

from __future__ import annotations

import asyncio
import copy
import importlib
from pathlib import Path

import pytest
import skyrl_gym
from omegaconf import OmegaConf
from skyrl_gym.metrics import aggregate_for_environment

import envs
from configs.loader import load_config
from configs.schema import Config, EnvConfig
from envs import mcp_tool_env
from envs.mcp_tool_env import MCPToolEnv, run_sync
from envs.parsing import expert_turns as expert_actions
from envs.parsing import format_tool_call as hermes
from envs.tool_client import set_tool_client
from serve_apps.tool_pool import LocalToolPool

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rows(rule_tasks) -> list[dict]:
    return rule_tasks("--n", "20", "--seed", "0")


@pytest.fixture(scope="module")
def pool():
    pool = run_sync(LocalToolPool.create(load_config().tools))
    yield pool
    run_sync(pool.close())


@pytest.fixture(autouse=True)
def client(pool):
    set_tool_client(pool)
    yield pool
    set_tool_client(None)


def make(row: dict, env: dict | None = None, reward: dict | None = None) -> MCPToolEnv:
    envs.register_env()  # once per process; later calls do nothing
    return skyrl_gym.make("MCPToolEnv", env_config={"env": env or {}, "reward": reward or {}}, extras=row)


def simple_row(rows: list[dict], server: str = "polygon") -> dict:
    return next(
        r
        for r in rows
        if r["reward_spec"]["ground_truth"]["complexity"] == "simple"
        and r["reward_spec"]["ground_truth"]["tool_sequence"][0]["server"] == server
    )


def play(env: MCPToolEnv, row: dict, actions: list[str]) -> list[dict]:
    """SkyRL's generator loop: init, then step until done (actions run out = a test bug)."""
    env.init(row["prompt"])
    outs = []
    for action in actions:
        out = env.step(action)
        outs.append(out)
        if out["done"]:
            break
    return outs


async def aplay(env: MCPToolEnv, row: dict, actions: list[str]) -> list[dict]:
    await env.ainit(row["prompt"])
    outs = []
    for action in actions:
        outs.append(await env.astep(action))
        if outs[-1]["done"]:
            break
    return outs


# --------------------------------------------------------------------------- registration, init


def test_registration_is_idempotent():
    importlib.reload(envs)  # importing registers nothing
    envs.register_env()
    envs.register_env()  # a second call must not raise
    assert "MCPToolEnv" in skyrl_gym.registry


def test_init_renders_the_tasks_tools_in_the_system_prompt(rows):
    row = simple_row(rows)
    before = copy.deepcopy(row["prompt"])
    env = make(row)
    conversation, meta = env.init(row["prompt"])
    assert row["prompt"] == before  # the row is not mutated
    assert meta["task_id"] == row["reward_spec"]["ground_truth"]["task_id"]
    assert meta["tools"] == ["polygon.previous_close", "polygon.daily_aggregates", "polygon.ticker_details"]
    system = conversation[0]
    assert system["role"] == "system" and system["content"].startswith(before[0]["content"])
    assert "\npolygon.previous_close(ticker: string) — " in system["content"]  # env.tool_format compact
    assert '<tool_call>{"name": "server.tool", "arguments": {...}}</tool_call>' in system["content"]
    assert "<answer>...</answer>" in system["content"]
    assert conversation[1:] == before[1:]


def test_init_without_a_system_message(rows):
    row = copy.deepcopy(simple_row(rows))
    row["prompt"] = row["prompt"][1:]
    conversation, _ = make(row).init(row["prompt"])
    assert [m["role"] for m in conversation] == ["system", "user"]


# --------------------------------------------------------------------------- whole episodes


def test_expert_plays_every_row_sync(rows):
    for row in rows:
        gt = row["reward_spec"]["ground_truth"]
        env = make(row)
        outs = play(env, row, expert_actions(row))
        n = len(gt["tool_sequence"])
        assert len(outs) == n + 1 and outs[-1]["done"] and outs[-1]["metadata"]["done_reason"] == "answer"
        assert not any(o["done"] for o in outs[:-1])
        for out in outs[:-1]:
            [obs] = out["observations"]
            assert obs["role"] == "tool" and "returned:" in obs["content"], obs
            assert out["metadata"]["calls"][0]["ok"] is True
        assert outs[0]["reward"] == pytest.approx(1.0)  # allowed + first + expected + params + ok
        assert all(o["reward"] >= 0.5 for o in outs[1:-1])
        assert outs[-1]["reward"] == pytest.approx(1.0)  # the outcome
        m = env.get_metrics()
        assert m["turns"] == n + 1 and m["tool_calls"] == n and m["tool_success_rate"] == 1.0
        assert m["task_complete"] == 1.0 and m["parse_failures"] == 0 and m["reward/outcome"] == 1.0
        assert m["reward_total"] == pytest.approx(sum(o["reward"] for o in outs))


def test_astep_matches_step(rows):
    for row in rows[:6]:
        sync = [(o["reward"], o["done"]) for o in play(make(row), row, expert_actions(row))]
        asyn = [(o["reward"], o["done"]) for o in run_sync(aplay(make(row), row, expert_actions(row)))]
        assert sync == asyn


def test_step_inside_a_running_loop(rows):
    row = simple_row(rows)

    async def inside() -> dict:
        env = make(row)
        env.init(row["prompt"])  # sync calls from async code: run on a helper thread's loop
        return env.step(expert_actions(row)[0])

    out = asyncio.run(inside())
    assert out["reward"] == pytest.approx(1.0)


# --------------------------------------------------------------------------- observations


def test_observation_role_and_truncation(rows):
    row = simple_row(rows)
    env = make(row, env={"observation_role": "user", "max_observation_chars": 100})
    env.init(row["prompt"])
    [obs] = env.step(expert_actions(row)[0])["observations"]
    assert obs["role"] == "user"
    body, note = obs["content"].rsplit("\n", 1)
    assert len(body) == 100 and note.startswith("[output cut: 100 of ")


def test_aliases_reach_the_tool(rows):
    row = simple_row(rows)
    env = make(row)
    env.init(row["prompt"])
    ticker = row["reward_spec"]["ground_truth"]["tool_sequence"][0]["params"]["ticker"]
    out = env.step(hermes("polygon.previous_close", {"symbol": ticker}))
    assert out["metadata"]["calls"][0]["ok"] and out["metadata"]["calls"][0]["aliased"] == {"symbol": "ticker"}


# --------------------------------------------------------------------------- done conditions


def test_done_at_max_turns_and_after(rows):
    row = simple_row(rows)
    env = make(row)
    outs = play(env, row, ["hmm"] * 20)
    assert len(outs) == row["reward_spec"]["ground_truth"]["max_turns"]
    assert outs[-1]["done"] and outs[-1]["metadata"]["done_reason"] == "max_turns"
    late = env.step("<answer>1</answer>")
    assert late["done"] and late["reward"] == 0.0 and late["observations"] == []


def test_done_when_the_sequence_is_complete_and_nothing_is_left_to_answer(rows):
    row = copy.deepcopy(next(r for r in rows if r["reward_spec"]["ground_truth"]["complexity"] == "medium"))
    calls = expert_actions(row)[:-1]
    row["reward_spec"]["ground_truth"]["final_answer"] = None
    outs = play(make(row), row, calls)
    assert outs[-1]["done"] and outs[-1]["metadata"]["done_reason"] == "sequence_complete"
    assert not outs[0]["done"]


def test_no_call_mode_plain_text_is_the_answer(rows):
    row = simple_row(rows)
    value = row["reward_spec"]["ground_truth"]["final_answer"]["value"]
    outs = play(make(row, env={"final_answer": "no_call"}), row, [expert_actions(row)[0], f"It is {value}."])
    assert outs[-1]["done"] and outs[-1]["reward"] == pytest.approx(1.0)


# --------------------------------------------------------------------------- bad output


BAD_OUTPUTS = {
    "malformed json": '<tool_call>{"name": "polygon.previous_close", "arguments": {ticker: NVDA}</tool_call>',
    "unknown tool": hermes("polygon.stock_price", {"ticker": "NVDA"}),
    "wrong arguments": hermes("polygon.previous_close", {"tickr": "NVDA"}),
    "empty": "",
    "megabytes": "<tool_call>" + "x" * 5_000_000,
    "lone surrogates": "\ud800\udfff<tool_call>{\ud83d}</tool_call>",
    "surrogate argument": hermes("polygon.previous_close", {"ticker": "\ud800"}),
    "too many calls": hermes("polygon.previous_close", {"ticker": "NVDA"}) * 6,
    "no action": "I think the answer is probably large.",
}


@pytest.mark.parametrize("name", sorted(BAD_OUTPUTS))
def test_bad_output_is_a_penalised_step_with_a_readable_observation(rows, name):
    row = simple_row(rows)
    env = make(row)
    env.init(row["prompt"])
    out = env.step(BAD_OUTPUTS[name])
    assert not out["done"]
    components = out["metadata"]["reward_components"]
    assert min(components.values()) < 0, components  # a penalty is there
    if name != "too many calls":  # four good calls plus a refused fifth still net positive
        assert out["reward"] < 0
    assert out["observations"]
    for obs in out["observations"]:
        assert obs["role"] == "tool" and 10 < len(obs["content"]) <= 4200
        obs["content"].encode("utf-8")  # no lone surrogates reach the tokenizer
    assert not out["metadata"]["infra_fault"]


class RaisingClient:
    def __init__(self, listing):
        self.listing = listing

    async def list_tools(self):
        return self.listing

    async def call_tool(self, server, tool, arguments=None, *, episode_id=None):
        raise ConnectionError("pool is gone")

    async def end_episode(self, episode_id):
        raise ConnectionError("pool is gone")  # close() must not raise for it


class TimeoutClient(RaisingClient):
    async def call_tool(self, server, tool, arguments=None, *, episode_id=None):
        from serve_apps.tool_host import ToolCallResult

        return ToolCallResult(server, tool, False, "Error (timeout): slow", None, "timeout", "timed out after 10 s")


def test_a_client_that_raises_is_an_infra_fault_not_a_penalty(rows, pool):
    row = simple_row(rows)
    set_tool_client(RaisingClient(run_sync(pool.list_tools())))
    env = make(row)
    env.init(row["prompt"])
    out = env.step(expert_actions(row)[0])
    assert out["reward"] == 0.0 and out["metadata"]["infra_fault"] and not out["done"]
    assert out["metadata"]["calls"][0]["infra_fault"] and "pool is gone" in out["observations"][0]["content"]
    assert env.get_metrics()["infra_faults"] == 1


def test_timeout_is_penalised(rows, pool):
    row = simple_row(rows)
    set_tool_client(TimeoutClient(run_sync(pool.list_tools())))
    env = make(row)
    env.init(row["prompt"])
    out = env.step(expert_actions(row)[0])
    assert out["reward"] == pytest.approx(-0.2) and "timeout" in out["observations"][0]["content"]
    assert env.get_metrics()["timeout_rate"] == 1.0


# --------------------------------------------------------------------------- metrics, configs, backends


def test_metrics_and_aggregate(rows):
    row = simple_row(rows)
    good = make(row)
    play(good, row, expert_actions(row))
    bad = make(row)
    play(bad, row, ['<tool_call>{"name": "x"', hermes("polygon.previous_close", {}), "<answer>0</answer>"])
    metrics = [good.get_metrics(), bad.get_metrics()]
    assert metrics[1]["parse_failures"] == 1 and metrics[1]["tool_calls"] == 1 and metrics[1]["tool_ok"] == 0
    agg = MCPToolEnv.aggregate_metrics(metrics)
    assert agg["episodes"] == 2 and agg["turns"] == 2.5 and agg["tool_success_rate"] == 0.5
    assert agg["task_complete"] == 0.5 and agg["reward/outcome"] == 0.5
    assert aggregate_for_environment("MCPToolEnv", metrics) == agg
    assert MCPToolEnv.aggregate_metrics([]) == {}


def test_config_forms(rows):
    row = simple_row(rows)
    want = EnvConfig(observation_role="user")
    for cfg in (
        {"env": {"observation_role": "user"}},
        {"env": want},
        OmegaConf.create({"env": {"observation_role": "user"}, "reward": {"backend": "heuristic"}}),
        Config(env=want),
    ):
        assert MCPToolEnv(cfg, row).env_cfg == want
    assert MCPToolEnv(None, row).env_cfg == EnvConfig()
    with pytest.raises(ValueError):
        MCPToolEnv({"env": {"observation_rol": "user"}}, row)  # typos fail at construction


def test_a_tool_source_without_endpoints_fails_at_construction(rows):
    with pytest.raises(ValueError, match="source http needs `endpoints`"):
        make(rows[0], env={"tools": {"source": "http"}})


def test_group_judge_records_and_returns_zero(rows):
    row = simple_row(rows)
    env = make(row, reward={"backend": "group_judge"})
    outs = play(env, row, expert_actions(row))
    assert all(o["reward"] == 0.0 and o["metadata"]["group_judge_pending"] for o in outs)
    assert outs[0]["metadata"]["heuristic_reward"] == pytest.approx(1.0)
    assert [m["role"] for m in env.conversation][-3:] == ["assistant", "tool", "assistant"]


def test_hybrid_calls_the_judge_from_astep(rows):
    seen = []

    class FakeJudge:  # handed over as the runners hand over the Serve judge: the env must use it
        async def score(self, conversation, latest_action, ground_truth, rubric):
            seen.append((conversation[-1]["content"], latest_action, ground_truth["task_id"]))
            return {"total_reward": 0.5, "components": {}, "task_complete": False, "infra_fault": False}

    row = simple_row(rows)
    env = skyrl_gym.make(
        "MCPToolEnv",
        env_config={"reward": {"backend": "hybrid", "hybrid_judge_weight": 0.25}},
        extras=row,
        judge=FakeJudge(),
    )
    env.init(row["prompt"])
    out = env.step(expert_actions(row)[0])
    assert out["reward"] == pytest.approx(0.75 * 1.0 + 0.25 * 0.5)
    assert seen[0][0] == seen[0][1] == expert_actions(row)[0]  # the judged action is the history's last turn


def test_tool_listings_are_cached_per_client_and_bounded():
    """`tools_of` lists a client once while it is among the newest MAX_LISTINGS; older ones are dropped."""

    class Counting:
        def __init__(self) -> None:
            self.listed = 0

        async def list_tools(self) -> dict:
            self.listed += 1
            return {"polygon": []}

    clients = [Counting() for _ in range(mcp_tool_env.MAX_LISTINGS + 4)]
    for c in clients:
        run_sync(mcp_tool_env.tools_of(c))
    run_sync(mcp_tool_env.tools_of(clients[-1]))
    assert clients[-1].listed == 1  # cached
    assert len(mcp_tool_env._listings) <= mcp_tool_env.MAX_LISTINGS
    run_sync(mcp_tool_env.tools_of(clients[0]))
    assert clients[0].listed == 2  # dropped as the oldest, so listed again
