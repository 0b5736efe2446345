"""The expert (actors/expert.py) against the real MCPToolEnv and the in-process offline tool pool:
`ExpertEngine` answers each turn of its tasks; the expert play (the EpisodeRunner over it) gives
trajectories token-exact with the runner's layout, training only the expert's turns, parsed back by a
fresh env to the task's calls and answer; rows with broken ground truth are skipped and counted."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest

from actors.engine_api import EngineError, TurnDoesNotFit
from actors.expert import ExpertEngine, check_rows, expert_trajectories
from actors.models import load_tokenizer
from actors.template_tokens import ChatTemplate
from actors.trajectory import Trajectory
from configs.loader import load_config
from configs.schema import Config, SamplingConfig
from envs.mcp_tool_env import MCPToolEnv, run_sync
from envs.parsing import expert_turns
from envs.prompting import template_tool_call
from envs.tool_client import set_tool_client
from serve_apps.tool_pool import LocalToolPool
from tasks.inventory import inventory_tools_for_prompt
from tests.actors.test_runner import check_token_exact
from tests.envs.tools_template import TOOLS_CHATML, with_template

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rows(rule_tasks) -> list[dict]:
    return rule_tasks("--n", "8", "--seed", "0")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(Config().model)


@pytest.fixture(scope="module")
def pool():
    tools = load_config().tools
    assert all(getattr(tools.servers, s).backend == "offline" for s in ("polygon", "fmp", "tavily", "slack"))
    pool = run_sync(LocalToolPool.create(tools))
    yield pool
    run_sync(pool.close())


@pytest.fixture
def client(pool):
    set_tool_client(pool)
    yield pool
    set_tool_client(None)


def config(max_total_tokens: int = 32768) -> Config:
    cfg = Config()
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_total_tokens": max_total_tokens})})


def play(cfg: Config, rows: list[dict], tokenizer: Any) -> tuple[list[Trajectory], dict[str, Any]]:
    stats: dict[str, Any] = {}
    trajs = run_sync(expert_trajectories(cfg, rows, tokenizer, stats=stats))
    return trajs, stats


def as_returned(traj: Trajectory) -> dict[tuple[int, ...], list[list[int]]]:
    """Each generated segment keyed by the ids before it, as if an engine had returned it."""
    out: dict[tuple[int, ...], list[list[int]]] = {}
    start = 0
    for seg in traj.generated_segments():
        while traj.loss_mask[start] == 0:
            start += 1
        out.setdefault(tuple(traj.prompt_ids + traj.response_ids[:start]), []).append(seg)
        start += len(seg)
    return out


def broken(row: dict, task_id: str, **step: Any) -> dict:
    row = copy.deepcopy(row)
    gt = row["reward_spec"]["ground_truth"]
    gt["task_id"] = task_id
    gt["tool_sequence"][0].update(step)
    first = gt["tool_sequence"][0]
    gt["success"]["must_call_tool"] = f"{first['server']}.{first['tool']}"
    return row


# --------------------------------------------------------------------------- tests


def test_expert_trajectories_are_token_exact_and_parse_back(rows, tokenizer, client):
    cfg = config()
    trajs, stats = play(cfg, rows, tokenizer)
    tmpl = ChatTemplate(tokenizer)
    assert stats["rows"] == stats["played"] == len(rows) == len(trajs)
    assert stats["skipped"] == 0 and stats["skipped_tasks"] == {} and stats["truncated"] == 0

    for i, (t, row) in enumerate(zip(trajs, rows, strict=True)):
        gt = row["reward_spec"]["ground_truth"]
        turns = expert_turns(row)
        t.check(max_total_tokens=cfg.rollout.max_total_tokens)
        assert (t.task_id, t.group_id, t.sample_index) == (gt["task_id"], i, 0)
        assert t.finish_reason == "done" and not t.infra_fault
        assert t.turns == len(turns) and t.appended_eot == [False] * t.turns
        assert all(lp == 0.0 for lp in t.rollout_logprobs)
        assert t.tool_stats["tool_ok"] == t.tool_stats["tool_calls"] == len(gt["tool_sequence"])

        # Each generated segment is the expert's text followed by the end-of-turn, both trained.
        segments = t.generated_segments()
        assert len(segments) == len(turns)
        for seg, text in zip(segments, turns, strict=True):
            assert seg[-len(tmpl.eot_ids) :] == tmpl.eot_ids
            assert tokenizer.decode(seg, skip_special_tokens=False) == text + tmpl.eot_text
            assert tmpl.ends_turn(seg)

        # The runner's own token-exactness check, and the whole conversation as the template tokenizes it.
        check_token_exact(t, tokenizer, as_returned(t))
        whole = tokenizer.apply_chat_template(t.messages, tokenize=False)[: -len(tmpl.after_eot_text)]
        assert t.prompt_ids + t.response_ids == tokenizer.encode(whole, add_special_tokens=False)

        # What a model trained on these ids would write, fed to a fresh env: the task's calls, then its answer.
        env = MCPToolEnv({"env": cfg.env, "reward": cfg.reward}, extras=row)
        run_sync(env.ainit(None))
        metas = [run_sync(env.astep(tokenizer.decode(seg, skip_special_tokens=True)))["metadata"] for seg in segments]
        calls = [c for m in metas for c in m["calls"]]
        expected = [(f"{s['server']}.{s['tool']}", s["params"]) for s in gt["tool_sequence"]]
        assert [(c["name"], c["arguments"]) for c in calls] == expected
        assert all(c["ok"] for c in calls) and not any(m["parse_errors"] for m in metas)
        assert metas[-1]["answer"] == str(gt["final_answer"]["value"])
        assert metas[-1]["done_reason"] == "answer" and env.get_metrics()["reward/outcome"] > 0


def test_a_tools_aware_template_gets_its_own_call_syntax(rows, tokenizer, client):
    """With a template that shows the tools (Qwen-style ChatML), the expert writes calls as that template
    does, the ids are the template's with `tools=` (observation deltas included), and the env parses them."""
    tok = with_template(tokenizer, TOOLS_CHATML)
    cfg = config()
    trajs, stats = play(cfg, rows, tok)
    assert stats["played"] == len(rows) and stats["skipped"] == 0
    listing = run_sync(client.list_tools())
    tmpl = ChatTemplate(tok)
    for t, row in zip(trajs, rows, strict=True):
        gt = row["reward_spec"]["ground_truth"]
        t.check(max_total_tokens=cfg.rollout.max_total_tokens)
        assert t.finish_reason == "done" and t.tool_stats["tool_ok"] == len(gt["tool_sequence"])
        tools = inventory_tools_for_prompt(listing, {s["server"] for s in gt["tool_sequence"]})
        check_token_exact(t, tok, as_returned(t), tools)
        assert "# Tools" in tok.decode(t.prompt_ids) and "<tool_response>" in tok.decode(t.response_ids)
        texts = [tok.decode(seg, skip_special_tokens=False) for seg in t.generated_segments()]
        calls = [template_tool_call(tok, f"{s['server']}.{s['tool']}", s["params"]) for s in gt["tool_sequence"]]
        assert texts[: len(calls)] == [c + tmpl.eot_text for c in calls]
        assert all(c.startswith('<tool_call>\n{"name": "') for c in calls)  # not our Hermes one-liner
        # A fresh env in the runner's mode reads the calls back.
        env = MCPToolEnv({"env": {"tool_prompt": "template"}}, extras=row)
        run_sync(env.ainit(None))
        said = [tok.decode(seg, skip_special_tokens=True) for seg in t.generated_segments()]
        metas = [run_sync(env.astep(text))["metadata"] for text in said]
        expected = [(f"{s['server']}.{s['tool']}", s["params"]) for s in gt["tool_sequence"]]
        assert [(c["name"], c["arguments"]) for m in metas for c in m["calls"]] == expected


def test_broken_rows_are_skipped_and_counted(rows, tokenizer, client, caplog):
    bad_args = broken(rows[1], "bad-args", params={"no_such_argument": 1})  # the tool refuses the call
    bad_tool = broken(rows[0], "bad-tool", tool="no_such_tool")  # the env cannot resolve the name
    good = rows[:2]
    with caplog.at_level(logging.WARNING, logger="actors.expert"):
        trajs, stats = play(config(), [good[0], bad_args, good[1], bad_tool], tokenizer)

    assert [t.task_id for t in trajs] == [r["reward_spec"]["ground_truth"]["task_id"] for r in good]
    assert [t.group_id for t in trajs] == [0, 2]  # the row index, skipped rows included
    assert stats["rows"] == 4 and stats["played"] == 2 and stats["skipped"] == 2
    assert set(stats["skipped_tasks"]) == {"bad-args", "bad-tool"}
    assert "invalid_arguments" in stats["skipped_tasks"]["bad-args"]
    assert "unknown tool" in stats["skipped_tasks"]["bad-tool"]
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "bad-args" in warned and "bad-tool" in warned


def test_task_without_final_answer_ends_with_its_last_call(rows, tokenizer, client):
    row = copy.deepcopy(rows[0])
    row["reward_spec"]["ground_truth"]["final_answer"] = None
    (t,), stats = play(config(), [row], tokenizer)
    t.check()
    n_calls = len(row["reward_spec"]["ground_truth"]["tool_sequence"])
    assert stats["skipped"] == 0 and t.finish_reason == "done"
    assert t.turns == n_calls and t.env_metadata[-1]["done_reason"] == "sequence_complete"
    assert t.messages[-1]["role"] == "assistant" and "<answer>" not in t.messages[-1]["content"]


def test_token_budget_cuts_where_the_runner_would(rows, tokenizer, client):
    cfg = config(max_total_tokens=1200)
    trajs, stats = play(cfg, rows, tokenizer)
    cut = [t for t in trajs if t.finish_reason == "token_budget"]
    assert cut and stats["truncated"] == len(cut)
    for t in trajs:
        t.check(max_total_tokens=cfg.rollout.max_total_tokens)
        assert t.turns >= 1
    # A row whose prompt alone fills the budget teaches nothing: skipped, not an empty trajectory.
    assert stats["played"] + stats["skipped"] == len(rows)
    assert all("token budget" in why for why in stats["skipped_tasks"].values())


def test_rows_without_tool_sequence_are_bad_input(rows, tokenizer):
    row = copy.deepcopy(rows[0])
    del row["reward_spec"]["ground_truth"]["tool_sequence"]
    task_id = row["reward_spec"]["ground_truth"]["task_id"]
    with pytest.raises(ValueError, match=rf"row 1 \({task_id}\).*tool_sequence"):
        check_rows([rows[1], row])
    with pytest.raises(ValueError, match="tool_sequence"):
        run_sync(expert_trajectories(config(), [row], tokenizer))


def test_samples_train_only_the_expert_turns_and_solve_the_tasks(rows, tokenizer, client):
    tmpl = ChatTemplate(tokenizer)
    trajs, _ = play(config(), rows, tokenizer)
    for t, row in zip(trajs, rows, strict=True):
        assert t.tool_stats["reward/outcome"] > 0 and t.tool_stats["task_complete"] == 1.0
        sample = t.to_sample()
        ids, mask = sample["response_ids"], sample["loss_mask"]
        trained = [i for i, m in zip(ids, mask, strict=True) if m]
        context = [i for i, m in zip(ids, mask, strict=True) if not m]
        # What the loss sees is exactly the expert's turns, each closed; the tool results are context only.
        said = "".join(text + tmpl.eot_text for text in expert_turns(row))
        assert tokenizer.decode(trained, skip_special_tokens=False) == said
        shown = tokenizer.decode(context, skip_special_tokens=False)
        first = next(i for i, m in enumerate(t.messages) if m["role"] == "assistant")
        for m in t.messages[first:]:
            assert (m["content"] in shown) == (m["role"] != "assistant")


def test_the_expert_engine_answers_each_turn_of_its_task(rows, tokenizer, client):
    (t,), _ = play(config(), rows[:1], tokenizer)
    prompts = [list(p) for p in as_returned(t)]  # each turn's prompt, in order
    turns = t.generated_segments()
    wide = SamplingConfig(max_new_tokens=4096)

    engine = ExpertEngine(tokenizer, rows)  # it finds the task among all of them
    gens = [run_sync(engine.generate(p, wide)) for p in prompts]
    assert [g.token_ids for g in gens] == turns
    assert all(g.finish_reason == "stop" and set(g.logprobs) == {0.0} and g.version == 0 for g in gens)
    with pytest.raises(TurnDoesNotFit):
        run_sync(engine.generate(prompts[0], SamplingConfig(max_new_tokens=len(turns[0]) - 1)))
    past = prompts[-1] + turns[-1] + tokenizer.encode(engine.header, add_special_tokens=False)
    with pytest.raises(EngineError, match="no expert turn"):
        run_sync(engine.generate(past, wide))
    with pytest.raises(EngineError, match="no task"):
        run_sync(ExpertEngine(tokenizer, rows[1:]).generate(prompts[0], wide))

    # As a sampling engine with the stop strings: calls end on </tool_call>, the answer on EOS, cut at the limit.
    sampled = ExpertEngine(tokenizer, rows, closes_turns=False, logprob=-0.5, version=3)
    first, last = (run_sync(sampled.generate(p, wide)) for p in (prompts[0], prompts[-1]))
    eot = len(ChatTemplate(tokenizer).eot_ids)
    assert first.token_ids == turns[0][:-eot] and (first.logprobs[0], first.version) == (-0.5, 3)
    assert last.token_ids[:-1] == turns[-1][:-eot] and last.token_ids[-1] == tokenizer.eos_token_id
    cut = run_sync(sampled.generate(prompts[0], SamplingConfig(max_new_tokens=3)))
    assert (cut.token_ids, cut.finish_reason) == (turns[0][:3], "length")


def test_rows_sharing_a_prompt_each_play_their_own_turns(rows, tokenizer, client):
    """The engine knows a task by its prompt: rows with the same prompt play in separate rounds."""
    twin = copy.deepcopy(rows[0])
    gt = twin["reward_spec"]["ground_truth"]
    gt["task_id"] = "twin"
    gt["final_answer"]["value"] = "not the answer"
    same = copy.deepcopy(rows[0])
    same["reward_spec"]["ground_truth"]["task_id"] = "same"
    tasks = [rows[0], twin, rows[1], same]
    trajs, stats = play(config(), tasks, tokenizer)
    assert stats["played"] == 4 and [t.group_id for t in trajs] == [0, 1, 2, 3]
    for t, row in zip(trajs, tasks, strict=True):
        assert t.task_id == row["reward_spec"]["ground_truth"]["task_id"]
        assert t.messages[-1]["content"] == expert_turns(row)[-1] and t.tool_stats["reward/outcome"] > 0
    assert trajs[1].messages[-1]["content"] == "<answer>not the answer</answer>"
    assert trajs[0].generated_segments() == trajs[3].generated_segments()
