"""The `rule` generator: deterministic, every complexity, admitted by the gate, true answers, dependent
calls, splits by template."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import AsyncIterator
from datetime import date
from typing import Any

import pytest

from configs.schema import Config
from mcp_servers import market_data as md
from mcp_servers.fmp import ratios_json
from serve_apps.tool_pool import LocalToolPool
from tasks.admission import admit
from tasks.generators import GENERATORS, get_generator
from tasks.generators import rule as r
from tasks.generators.options import GenerateOptions, GenerationError
from tasks.generators.splits import assign_templates, parse_splits, row_quotas
from tasks.inventory import inventory_from_listing
from tasks.schema import COMPLEXITY_CALLS, TaskRow
from tests.tasks.replay import longest_shown

CFG = Config()
N = 42  # 14 per complexity: every template of each complexity comes up (round-robin)


@pytest.fixture(scope="module")
async def pool() -> AsyncIterator[LocalToolPool]:
    pool = await LocalToolPool.create(CFG.tools)
    yield pool
    await pool.close()


@pytest.fixture(scope="module")
async def rows(pool: LocalToolPool) -> list[dict[str, Any]]:
    return await r.generate(CFG, GenerateOptions(n=N, seed=0), pool)


def gt(row: dict[str, Any]) -> dict[str, Any]:
    return row["reward_spec"]["ground_truth"]


def by_template(rows: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    found = [row for row in rows if row["extra_info"]["template"] == template]
    assert found, f"no {template} row"
    return found


def test_the_registry_names_every_method() -> None:
    assert set(GENERATORS) == {"rule", "dependent", "llm", "mcp"}
    assert get_generator("rule") is r.generate


def test_templates_span_every_server_and_complexity() -> None:
    assert len(r.TEMPLATES) >= 10
    assert {s for t in r.TEMPLATES.values() for s in t.servers} == {"polygon", "fmp", "tavily", "slack", "python"}
    assert {t.complexity for t in r.TEMPLATES.values()} == {"simple", "medium", "hard"}
    assert any(len(t.servers) > 1 for t in r.TEMPLATES.values() if t.complexity == "medium")
    for t in r.TEMPLATES.values():
        lo, hi = COMPLEXITY_CALLS[t.complexity]
        assert lo <= len(t.calls) <= hi, t.id


async def test_rows_are_valid_tasks_of_every_complexity(rows: list[dict[str, Any]]) -> None:
    assert len(rows) == N
    assert Counter(gt(row)["complexity"] for row in rows) == {"simple": 14, "medium": 14, "hard": 14}
    assert {row["extra_info"]["template"] for row in rows} == set(r.TEMPLATES)
    assert len({gt(row)["task_id"] for row in rows}) == N
    for row in rows:
        task = TaskRow.model_validate(row)
        assert [m.role for m in task.prompt] == ["system", "user"]
        assert row["extra_info"]["method"] == "rule" and row["data_source"] == "mcprl/rule"
        assert gt(row)["final_answer"] is not None
        steps = gt(row)["tool_sequence"]
        assert [f"{s['server']}.{s['tool']}" for s in steps] == list(r.TEMPLATES[row["extra_info"]["template"]].calls)
    assert len({row["prompt"][1]["content"] for row in rows}) == N


async def test_same_seed_same_rows_different_seed_different_rows(
    pool: LocalToolPool, rows: list[dict[str, Any]]
) -> None:
    # The pool's Slack workspace has had posts since `rows` was made: they must change nothing.
    again = await r.generate(CFG, GenerateOptions(n=N, seed=0), pool)
    assert again == rows
    other = await r.generate(CFG, GenerateOptions(n=N, seed=1), pool)
    assert {gt(row)["task_id"] for row in other} != {gt(row)["task_id"] for row in rows}
    assert [row["prompt"][1]["content"] for row in other] != [row["prompt"][1]["content"] for row in rows]


async def test_every_rule_task_is_admitted(pool: LocalToolPool, rows: list[dict[str, Any]]) -> None:
    inventory = inventory_from_listing(await pool.list_tools())
    admission = await admit(rows, pool, inventory, CFG.generation.near_duplicate_threshold)
    assert admission.rejected == []
    assert len(admission.kept) == N


def test_final_answers_match_the_market_simulation(rows: list[dict[str, Any]]) -> None:
    """Recomputed from market_data directly, not through the tools."""
    for row in by_template(rows, "close_simple"):
        assert gt(row)["final_answer"]["value"] == md.last_bar(row["extra_info"]["ticker"]).c
    for row in by_template(rows, "pe_report"):
        t = row["extra_info"]["ticker"]
        eps = [ratios_json(p)["netIncomePerShare"] for p in md.statements(t, "annual", row["extra_info"]["years"])]
        assert gt(row)["final_answer"]["value"] == pytest.approx(md.last_bar(t).c / (sum(eps) / len(eps)), abs=0.006)
    for row in by_template(rows, "range_return"):
        info = row["extra_info"]
        bars = md.daily_bars(info["ticker"], date.fromisoformat(info["from"]), date.fromisoformat(info["to"]))
        expected = (bars[-1].c / bars[0].c - 1) * 100
        assert gt(row)["final_answer"]["value"] == pytest.approx(expected, abs=0.006)
    for row in by_template(rows, "fiscal_metric"):
        info = row["extra_info"]
        period = next(p for p in md.statements(info["ticker"], "annual", 5) if str(p.fiscal_year) == info["year"])
        key = {"netIncome": "net_income", "operatingIncome": "operating_income", "grossProfit": "gross_profit"}
        value = period.eps if info["field"] == "eps" else getattr(period, key.get(info["field"], "revenue")) / 1e9
        assert gt(row)["final_answer"]["value"] == pytest.approx(value, abs=0.006)


NUMBER = re.compile(r"-?\d+\.\d+|\d{4,}")


async def test_hard_tasks_build_later_calls_from_earlier_results(
    pool: LocalToolPool, rows: list[dict[str, Any]]
) -> None:
    """A later call's params carry values that only earlier results held (not the prompt), and the
    Slack post carries the computed answer."""
    for row in (row for row in rows if gt(row)["complexity"] == "hard"):
        steps = gt(row)["tool_sequence"]
        prompt_numbers = set(NUMBER.findall(row["prompt"][1]["content"]))
        seen: set[str] = set()
        carried = False
        for i, step in enumerate(steps):
            params = json.dumps(step["params"])
            if i and (set(NUMBER.findall(params)) & seen) - prompt_numbers:
                carried = True
            result = await pool.call_tool(step["server"], step["tool"], step["params"])
            assert result.ok, result.error
            seen |= set(NUMBER.findall(result.text))
        assert carried, row["extra_info"]["template"]
        post = steps[-1]
        assert (post["server"], post["tool"]) == ("slack", "post_message")
        assert f"{gt(row)['final_answer']['value']:.2f}" in post["params"]["text"]


async def test_splits_share_no_template(pool: LocalToolPool) -> None:
    splits = {"train": 0.8, "validation": 0.1, "test": 0.1}
    got = await r.generate(CFG, GenerateOptions(n=30, seed=3, splits=splits), pool)
    groups: dict[str, set[str]] = {}
    for row in got:
        groups.setdefault(row["extra_info"]["split"], set()).add(row["extra_info"]["template"])
    assert set(groups) == set(splits)
    assert Counter(row["extra_info"]["split"] for row in got) == {"train": 24, "validation": 3, "test": 3}
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not groups[a] & groups[b], (a, b)


def test_template_assignment_is_deterministic_per_seed() -> None:
    ids = list(r.TEMPLATES)
    kinds = {t.id: t.complexity for t in r.TEMPLATES.values()}
    splits = {"train": 0.8, "validation": 0.1, "test": 0.1}
    first = assign_templates(ids, splits, 0, kinds)
    assert assign_templates(ids, splits, 0, kinds) == first
    assert Counter(first.values()) == {"train": 17, "validation": 2, "test": 2}
    assert len({tuple(sorted(assign_templates(ids, splits, s, kinds).items())) for s in range(6)}) > 1
    # the small splits take templates of different complexities
    evaluation = [kinds[t] for t, s in first.items() if s != "train"]
    assert len(set(evaluation)) >= 2


def test_split_parsing() -> None:
    assert parse_splits("train=0.8, validation=0.1,test=0.1") == {"train": 0.8, "validation": 0.1, "test": 0.1}
    assert row_quotas(10, {"a": 0.5, "b": 0.25, "c": 0.25}) == {"a": 5, "b": 3, "c": 2}
    for bad, message in (
        ("train=0.5,test=0.6", "sum to 1"),
        ("train=0.8", "at least two"),
        ("train", "NAME=FRACTION"),
        ("train=x,test=1", "not a number"),
        ("a/b=0.5,c=0.5", "NAME=FRACTION"),
    ):
        with pytest.raises(GenerationError, match=message):
            parse_splits(bad)


async def test_options_narrow_the_templates(pool: LocalToolPool) -> None:
    opts = GenerateOptions(n=8, seed=0, domains=("polygon", "slack"), complexities=("simple", "medium"))
    got = await r.generate(CFG, opts, pool)
    assert len(got) == 8
    for row in got:
        assert {s["server"] for s in gt(row)["tool_sequence"]} <= {"polygon", "slack"}
        assert gt(row)["complexity"] in ("simple", "medium")
    narrow = r.eligible_templates(GenerateOptions(max_tools=2, max_turns=3))
    assert all(len(t.tools) <= 2 and len(t.calls) <= 3 for t in narrow)
    assert "pe_report" not in {t.id for t in narrow}
    with pytest.raises(GenerationError, match="no rule template fits"):
        await r.generate(CFG, GenerateOptions(domains=("slack",), complexities=("hard",)), pool)
    with pytest.raises(GenerationError, match=r"domains=\['weather'\]"):
        await r.generate(CFG, GenerateOptions(domains=("weather",)), pool)


async def test_every_expert_result_fits_the_envs_cut(pool: LocalToolPool) -> None:
    """A draw with a tool result the env would cut is redrawn: with the demo's 2,000 characters every call of
    every row, replayed, is shown whole, and the fiscal and range templates still come up; with 600 none is
    longer either, and fewer draws of yoy_growth (two income statements, ~1,200 characters) fit."""

    cfg = CFG.model_copy(deep=True)
    cfg.env.max_observation_chars = 2000
    opts = GenerateOptions(n=24, seed=5, domains=("polygon", "fmp", "python"), complexities=("simple", "medium"))
    rows = await r.generate(cfg, opts, pool)
    templates = Counter(row["extra_info"]["template"] for row in rows)
    assert {"fiscal_metric", "fiscal_ratio", "yoy_growth", "range_return"} <= set(templates), templates
    assert await longest_shown(pool, rows) <= 2000
    cfg.env.max_observation_chars = 600
    small = await r.generate(cfg, opts, pool)
    assert await longest_shown(pool, small) <= 600
    assert small and Counter(row["extra_info"]["template"] for row in small)["yoy_growth"] < templates["yoy_growth"]
