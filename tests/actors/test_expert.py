"""Expert trajectories (actors/expert.py) against the real MCPToolEnv and the in-process offline tool pool:
token-exact with the runner's layout, parsed back by a fresh env to the task's calls and answer, and
rows with broken ground truth skipped and counted."""

from __future__ import annotations

import copy
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from actors.episode_runner import ChatTemplate
from actors.expert import check_rows, expert_trajectories
from actors.models import load_tokenizer
from actors.trajectory import Trajectory
from configs.loader import load_config
from configs.schema import Config
from envs.mcp_tool_env import MCPToolEnv, run_sync
from envs.parsing import expert_turns
from envs.prompting import template_tool_call
from envs.tool_client import set_tool_client
from serve_apps.tool_pool import LocalToolPool
from tasks.inventory import inventory_tools_for_prompt
from tasks.io import read_rows
from tests.actors.test_runner import check_token_exact
from tests.envs.tools_template import TOOLS_CHATML, with_template

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tasks") / "rule.jsonl"
    cmd = [sys.executable, "-m", "jobs.generate_tasks", "--method", "rule", "--n", "8", "--seed", "0"]
    subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    return read_rows(out)


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


@pytest.mark.parametrize("budget", [32768, 1200, 1000])
def test_runner_play_matches_the_legacy_play(rows, tokenizer, client, budget):
    """Temporary: the EpisodeRunner + ExpertEngine play gives the old step-for-step play's samples."""
    from actors.expert import _legacy_expert_trajectories
    from jobs.sft import to_sample

    cfg = config(max_total_tokens=budget)
    bad = [broken(rows[1], "bad-args", params={"no_such_argument": 1}), broken(rows[0], "bad-tool", tool="x")]
    tasks = [*rows, *bad]
    old_stats: dict[str, Any] = {}
    old = run_sync(_legacy_expert_trajectories(cfg, tasks, tokenizer, stats=old_stats))
    new, new_stats = play(cfg, tasks, tokenizer)
    # The python tool reports its own run time: those digits differ between any two plays.
    timing = re.compile(r'"(duration_s|cpu_time_s)":[0-9.e-]+')
    assert len(new) == len(old)
    exact = 0
    for n, o in zip(new, old, strict=True):
        assert n.prompt_ids == o.prompt_ids and n.generated_segments() == o.generated_segments()
        if to_sample(n) == to_sample(o):
            exact += 1
            continue
        same = [timing.sub("", tokenizer.decode(t.response_ids, skip_special_tokens=False)) for t in (n, o)]
        assert same[0] == same[1]
    assert exact >= len(new) // 2
    assert [(t.task_id, t.group_id, t.finish_reason, t.turns) for t in new] == [
        (t.task_id, t.group_id, t.finish_reason, t.turns) for t in old
    ]
    assert [timing.sub("", str(t.messages)) for t in new] == [timing.sub("", str(t.messages)) for t in old]
    assert [t.turn_rewards for t in new] == [t.turn_rewards for t in old]
    counts = ("rows", "played", "skipped", "truncated", "generated_tokens")
    assert {k: new_stats[k] for k in counts} == {k: old_stats[k] for k in counts}
    assert set(new_stats["skipped_tasks"]) == set(old_stats["skipped_tasks"])
    print(budget, exact, new_stats["truncated"], new_stats["skipped_tasks"], old_stats["skipped_tasks"])
