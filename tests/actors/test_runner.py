"""EpisodeRunner against the real MCPToolEnv and in-process tool pool: well-formed, token-exact
trajectories, both modes, failover when an engine dies, the token budget, the Serve pool, and the
real HF engine on tiny-random.

Engines here are either the real HFEngine or `ScriptedEngine`, the expert engine
(actors/expert.py) answering each task with its expert tool calls (the canned token ids of the
calls, as the tiny-random tokenizer encodes them), with faults to inject: calls end on the
`</tool_call>` stop string (no EOS, so the runner must close the turn), the final answer ends with EOS.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from actors.engine_api import EngineError, Generation
from actors.episode_runner import EpisodeRunner
from actors.expert import ExpertEngine
from actors.models import load_tokenizer
from actors.trajectory import Trajectory
from configs.loader import load_config
from configs.schema import Config, SamplingConfig
from envs.mcp_tool_env import run_sync
from envs.parsing import CallFormat, format_tool_call
from envs.parsing import expert_turns as expert_actions
from envs.prompting import TOOL_CALL_FORMAT, answer_instruction, call_syntax, count_prompt_tokens, render
from envs.tool_client import set_tool_client
from serve_apps.tool_pool import LocalToolPool
from tasks.inventory import inventory_tools_for_prompt
from tests.envs.tools_template import TOOLS_CHATML, with_template

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
MARK = "\x01MCPRL-TEST-{}\x01"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def rows(rule_tasks) -> list[dict]:
    return rule_tasks("--n", "8", "--seed", "0")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(Config().model)


@pytest.fixture(scope="module")
def pool():
    pool = run_sync(LocalToolPool.create(load_config().tools))
    yield pool
    run_sync(pool.close())


@pytest.fixture
def client(pool):
    set_tool_client(pool)
    yield pool
    set_tool_client(None)


def config(**rollout: Any) -> Config:
    """Defaults, with room for whole scripted episodes (tool results run to thousands of tokens)."""
    rollout = {"max_total_tokens": 32768, **rollout}
    cfg = Config()
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=rollout)})


# --------------------------------------------------------------------------- the scripted engine


class EngineDiedError(RuntimeError):
    pass


class ScriptedEngine(ExpertEngine):
    """The expert engine as a sampling engine returns turns (calls end on the `</tool_call>` stop string,
    the answer on EOS; logprobs -0.5, version 3), with faults to inject: `die_after` calls, later
    ones (and those still in flight) raise as a dead actor would. `turn_log`: the turn index of each
    request, by arrival; `returned`: what it returned, keyed by the prompt ids.
    """

    def __init__(
        self,
        tokenizer: Any,
        rows: list[dict],
        *,
        delay_s: float = 0.0,
        die_after: int | None = None,
        turn_log: list[int] | None = None,
        call_format: CallFormat = format_tool_call,
    ) -> None:
        super().__init__(
            tokenizer, rows, closes_turns=False, call_format=call_format, delay_s=delay_s, logprob=-0.5, version=3
        )
        self.die_after = die_after
        self.turn_log = turn_log if turn_log is not None else []
        self.returned: dict[tuple[int, ...], list[list[int]]] = {}

    def dead(self) -> bool:
        return self.die_after is not None and self.calls > self.die_after

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Generation:
        if self.die_after is not None and self.calls >= self.die_after:
            self.calls += 1
            raise EngineDiedError("the engine actor died")
        self.turn_log.append(self.locate(prompt_token_ids)[1])
        gen = await super().generate(prompt_token_ids, sampling)
        if self.dead():
            raise EngineDiedError("the engine actor died while generating")
        self.returned.setdefault(tuple(prompt_token_ids), []).append(list(gen.token_ids))
        return gen


class Recording:
    """Wraps any engine and keeps what it returned, keyed by the prompt ids."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.returned: dict[tuple[int, ...], list[list[int]]] = {}

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Generation:
        gen = await self.engine.generate(prompt_token_ids, sampling)
        self.returned.setdefault(tuple(prompt_token_ids), []).append(list(gen.token_ids))
        return gen

    def version(self) -> int:
        return self.engine.version()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


# --------------------------------------------------------------------------- token exactness


def check_token_exact(
    traj: Trajectory, tokenizer: Any, returned: dict[tuple[int, ...], list[list[int]]], tools: list[dict] | None = None
) -> None:
    """prompt+response == the chat template's tokens of traj.messages (rendered with the episode's
    `tools=` when the template shows them), with each assistant content replaced by the engine's own
    ids; and those ids are exactly what the engine returned."""
    eos = tokenizer.eos_token
    msgs, k = [], 0
    for m in traj.messages:
        if m["role"] == "assistant":
            msgs.append({"role": "assistant", "content": MARK.format(k)})
            k += 1
        else:
            msgs.append(m)
    ends_on_assistant = traj.messages[-1]["role"] == "assistant"
    text = render(tokenizer, msgs, tools, add_generation_prompt=not ends_on_assistant)
    if ends_on_assistant:  # the trajectory stops right after the end-of-turn token
        assert text.endswith(eos + "\n")
        text = text[:-1]
    pieces = []
    for i in range(k):
        head, text = text.split(MARK.format(i))
        pieces.append(head)
    pieces.append(text)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731

    assert traj.prompt_ids == encode(pieces[0])
    segments = traj.generated_segments()
    assert len(segments) == k
    expected: list[int] = []
    mask: list[int] = []
    for i, seg in enumerate(segments):
        assert seg in returned[tuple(traj.prompt_ids + expected)], "generated ids must be the engine's, unchanged"
        after = pieces[i + 1]
        if seg and seg[-1] == tokenizer.eos_token_id:  # EOS generated: the template's is the model's own
            assert after.startswith(eos) and not traj.appended_eot[i]
            after = after[len(eos) :]
        else:
            assert traj.appended_eot[i]
        tail = encode(after)
        expected += seg + tail
        mask += [1] * len(seg) + [0] * len(tail)
    assert traj.response_ids == expected
    assert traj.loss_mask == mask


def merged(engines: list[Any]) -> dict[tuple[int, ...], list[list[int]]]:
    out: dict[tuple[int, ...], list[list[int]]] = {}
    for e in engines:
        for prompt, gens in e.returned.items():
            out.setdefault(prompt, []).extend(gens)
    return out


def run(runner: EpisodeRunner, rows: list[dict], group_size: int) -> list[Trajectory]:
    return run_sync(runner.run(rows, group_size))


# --------------------------------------------------------------------------- tests


def test_scripted_episodes_are_well_formed_and_token_exact(rows, tokenizer, client):
    engines = [ScriptedEngine(tokenizer, rows, delay_s=0.001), ScriptedEngine(tokenizer, rows, delay_s=0.002)]
    runner = EpisodeRunner(config(), engines, tokenizer, progress=False)
    trajs = run(runner, rows, group_size=2)

    assert len(trajs) == 2 * len(rows)
    assert [(t.group_id, t.sample_index) for t in trajs] == [(g, s) for g in range(len(rows)) for s in range(2)]
    returned = merged(engines)
    for t, row in zip(trajs, [r for r in rows for _ in range(2)], strict=True):
        t.check(max_total_tokens=runner.cfg.rollout.max_total_tokens)
        assert t.task_id == row["reward_spec"]["ground_truth"]["task_id"]
        assert t.finish_reason == "done" and not t.infra_fault and t.restarts == 0
        assert t.turns == len(expert_actions(row))
        assert t.versions == [3] * t.turns
        assert t.appended_eot == [True] * (t.turns - 1) + [False]  # stop string for calls, EOS for the answer
        assert t.tool_stats["tool_ok"] == t.tool_stats["tool_calls"] == t.turns - 1
        assert t.reward > 0
        assert [lp for lp, m in zip(t.rollout_logprobs, t.loss_mask, strict=True) if m] == [-0.5] * t.num_generated
        check_token_exact(t, tokenizer, returned)
        # The scripted ids are the tokenizer's own: then the whole sequence is the template's tokens.
        whole = tokenizer.apply_chat_template(t.messages, tokenize=False)[:-1]  # up to the final <|im_end|>
        assert t.prompt_ids + t.response_ids == tokenizer.encode(whole, add_special_tokens=False)
    # Least-loaded routing spreads the episodes over both engines.
    assert {t.engine for t in trajs} == {0, 1}
    s = runner.stats()
    assert s["done"] == s["episodes"] == len(trajs) and s["running"] == 0 and s["failed"] == 0
    assert s["generated_tokens"] == sum(t.num_generated for t in trajs) and s["tokens_per_s"] > 0


@pytest.mark.parametrize("template", ["smollm2", "tools_chatml"])
def test_the_prompt_shows_tools_as_the_template_wants(template, rows, tokenizer, client):
    """SmolLM2's template ignores tools: our block in the system message, our call syntax. A tools-aware
    (Qwen-style) template: its own tools section and call syntax, tool results as its <tool_response>
    turns, still token-exact; and preflight counts exactly the runner's prompt."""
    from jobs.preflight import Preflight, check_template
    from tasks.schema import TaskRow

    tok = tokenizer if template == "smollm2" else with_template(tokenizer, TOOLS_CHATML)
    engine = ScriptedEngine(tok, rows, call_format=call_syntax(tok))
    runner = EpisodeRunner(config(), [engine], tok, progress=False)
    trajs = run(runner, rows, group_size=1)
    listing = run_sync(client.list_tools())
    shows_tools = template == "tools_chatml"
    assert runner.env_cfg.tool_prompt == ("template" if shows_tools else "system")
    for t, row in zip(trajs, rows, strict=True):
        t.check()
        assert t.finish_reason == "done" and not t.infra_fault
        assert t.tool_stats["tool_ok"] == t.tool_stats["tool_calls"] == t.turns - 1 > 0  # every call parsed and ran
        servers = {s["server"] for s in row["reward_spec"]["ground_truth"]["tool_sequence"]}
        tools = inventory_tools_for_prompt(listing, servers)
        check_token_exact(t, tok, engine.returned, tools if shows_tools else None)
        prompt = tok.decode(t.prompt_ids)
        response = tok.decode(t.response_ids)
        system = t.messages[0]["content"]
        first_call = tok.decode(t.generated_segments()[0])
        if shows_tools:
            assert "# Tools" in prompt and f'"name": "{tools[0]["name"]}"' in prompt
            assert TOOL_CALL_FORMAT not in system and system.endswith(answer_instruction())
            assert first_call.startswith('<tool_call>\n{"name": ')  # the template's syntax
            assert "<|im_start|>user\n<tool_response>\n" in response
        else:
            assert "# Tools" not in prompt and TOOL_CALL_FORMAT in system
            assert first_call.startswith('<tool_call>{"name": ')
            assert "<|im_start|>tool\n" in response
        assert count_prompt_tokens(tok, TaskRow.model_validate(row), listing) == len(t.prompt_ids)

    pf = Preflight(listing=listing, train_rows=rows, tokenizer=tok)
    check_template(config(), pf)
    [check] = pf.checks
    assert check.ok and check.detail.startswith(f"prompt of {len(trajs[0].prompt_ids)} tokens"), check


def test_lockstep_and_async_give_the_same_episodes(rows, tokenizer, client):
    results, shared = {}, {}
    for mode in ("async", "lockstep"):
        # Delays differ per engine, so async requests interleave turns; lockstep must not.
        log = shared[mode] = []
        engines = [
            ScriptedEngine(tokenizer, rows, delay_s=0.0, turn_log=log),
            ScriptedEngine(tokenizer, rows, delay_s=0.005, turn_log=log),
        ]
        runner = EpisodeRunner(config(mode=mode), engines, tokenizer, progress=False)
        results[mode] = (run(runner, rows, group_size=2), engines)
    a, b = results["async"][0], results["lockstep"][0]
    assert len(a) == len(b) == 2 * len(rows)
    for ta, tb in zip(a, b, strict=True):
        tb.check()
        # Same generations; observations may differ (the python tool's output is not fully repeatable).
        assert (ta.task_id, ta.prompt_ids, ta.finish_reason) == (tb.task_id, tb.prompt_ids, tb.finish_reason)
        assert ta.generated_segments() == tb.generated_segments()
    # Lockstep: every request of turn k arrives before any of turn k+1; async interleaves them.
    assert shared["lockstep"] == sorted(shared["lockstep"])
    assert shared["async"] != sorted(shared["async"])


def test_lockstep_waves_respect_the_cap(rows, tokenizer, client):
    engine = ScriptedEngine(tokenizer, rows)
    runner = EpisodeRunner(config(mode="lockstep"), [engine], tokenizer, max_concurrent_episodes=4, progress=False)
    trajs = run(runner, rows, group_size=1)
    assert len(trajs) == len(rows) and all(t.finish_reason == "done" for t in trajs)
    assert runner.stats()["done"] == len(rows)


def test_dead_engine_episodes_restart_on_the_other_exactly_once(rows, tokenizer, client):
    dying = ScriptedEngine(tokenizer, rows, delay_s=0.002, die_after=5)
    healthy = ScriptedEngine(tokenizer, rows, delay_s=0.002)
    runner = EpisodeRunner(config(max_episode_restarts=2), [dying, healthy], tokenizer, progress=False)
    trajs = run(runner, rows, group_size=2)

    assert [(t.group_id, t.sample_index) for t in trajs] == [(g, s) for g in range(len(rows)) for s in range(2)]
    assert all(t.finish_reason == "done" and not t.infra_fault for t in trajs)
    assert all(t.engine == 1 for t in trajs)  # the dead engine's episodes came back from the other
    restarted = sum(t.restarts for t in trajs)
    assert restarted >= 1
    s = runner.stats()
    assert s["restarts"] == restarted and s["dead_engines"] == [0] and s["failed"] == 0
    returned = merged([dying, healthy])
    for t in trajs:
        t.check()
        check_token_exact(t, tokenizer, returned)


def test_restarts_exhausted_comes_back_as_engine_failed(rows, tokenizer, client):
    engines = [ScriptedEngine(tokenizer, rows, die_after=1), ScriptedEngine(tokenizer, rows, die_after=1)]
    runner = EpisodeRunner(config(max_episode_restarts=1), engines, tokenizer, progress=False)
    trajs = run(runner, rows[:3], group_size=2)
    assert len(trajs) == 6
    failed = [t for t in trajs if t.finish_reason == "engine_failed"]
    assert failed and all(t.infra_fault for t in failed)
    for t in trajs:
        t.check()
        assert t.restarts <= 1
    assert runner.stats()["dead_engines"] == [0, 1] and runner.stats()["failed"] == len(failed)


def test_request_error_ends_only_that_episode(rows, tokenizer, client):
    class Refusing(ScriptedEngine):
        async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Generation:
            if len(prompt_token_ids) > 0 and self.calls == 0:
                self.calls += 1
                raise EngineError("prompt too long")
            return await super().generate(prompt_token_ids, sampling)

    runner = EpisodeRunner(config(), [Refusing(tokenizer, rows)], tokenizer, progress=False)
    trajs = run(runner, rows[:2], group_size=1)
    assert sorted(t.finish_reason for t in trajs) == ["done", "engine_failed"]
    assert runner.stats()["dead_engines"] == [] and runner.stats()["restarts"] == 0


def test_token_budget_stops_episodes(rows, tokenizer, client):
    probe = ScriptedEngine(tokenizer, rows)
    first = run(EpisodeRunner(config(), [probe], tokenizer, progress=False), rows, group_size=1)
    longest_prompt = max(len(t.prompt_ids) for t in first)
    budget = longest_prompt + 60  # room for about one call, not for its observation too
    engine = ScriptedEngine(tokenizer, rows)
    runner = EpisodeRunner(config(max_total_tokens=budget), [engine], tokenizer, progress=False)
    trajs = run(runner, rows, group_size=1)
    assert trajs[[len(t.prompt_ids) for t in trajs].index(longest_prompt)].finish_reason == "token_budget"
    for t in trajs:
        t.check(max_total_tokens=budget)
        assert t.turns >= 1
        check_token_exact(t, tokenizer, engine.returned)
    # A prompt alone over the budget: no turn at all.
    tiny = EpisodeRunner(config(max_total_tokens=64), [engine], tokenizer, progress=False)
    for t in run(tiny, rows[:1], group_size=1):
        t.check(max_total_tokens=64)
        assert (t.finish_reason, t.turns, t.response_ids) == ("token_budget", 0, [])


def test_serve_tool_pool(ray_cluster, rows, tokenizer):
    from serve_apps.tool_pool import deploy_pool, undeploy_pool
    from tests.conftest import free_port

    cfg = load_config(None, [f"tools.http.port={free_port()}"])
    pool = deploy_pool(cfg.tools)
    set_tool_client(pool)
    try:
        engine = ScriptedEngine(tokenizer, rows)
        runner = EpisodeRunner(config(), [engine], tokenizer, progress=False)
        trajs = run(runner, rows[:4], group_size=2)
        assert len(trajs) == 8
        for t in trajs:
            t.check()
            assert t.finish_reason == "done" and not t.infra_fault
            assert t.tool_stats["tool_ok"] == t.tool_stats["tool_calls"] > 0
            check_token_exact(t, tokenizer, engine.returned)
    finally:
        set_tool_client(None)
        undeploy_pool(pool)


def test_real_hf_engine_tiny_random(rows, tokenizer, client):
    hf = pytest.importorskip("actors.hf_engine")
    short = []
    for row in rows[:3]:
        row = copy.deepcopy(row)
        row["reward_spec"]["ground_truth"]["max_turns"] = 3
        short.append(row)
    cfg = config(sampling=SamplingConfig(max_new_tokens=24, temperature=1.0, seed=None))

    async def play() -> tuple[list[Trajectory], Recording]:
        engine = hf.HFEngine(cfg)
        await engine.start()  # on the loop that runs the episodes: its scheduler lives there
        try:
            rec = Recording(engine)
            runner = EpisodeRunner(cfg, [rec], tokenizer, progress=False)
            return await runner.run(short, group_size=2), rec
        finally:
            await engine.shutdown()

    trajs, rec = run_sync(play())
    assert len(trajs) == 6
    for t in trajs:
        t.check(max_total_tokens=cfg.rollout.max_total_tokens)
        assert t.turns >= 1 and not t.infra_fault
        assert all(lp <= 0 for lp in t.rollout_logprobs)
        check_token_exact(t, tokenizer, rec.returned)
