"""The `rule` generator: deterministic, every complexity, admitted by the gate, true answers, dependent
calls, splits by template and by instance."""

from __future__ import annotations

import json
import random
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
from tasks.similarity import near_duplicates
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
        value = getattr(period, key.get(info["field"], "revenue")) / 1e9
        assert gt(row)["final_answer"]["value"] == pytest.approx(value, abs=0.006)
    for row in by_template(rows, "pe_now"):
        t = row["extra_info"]["ticker"]
        eps = ratios_json(md.statements(t, "annual", 1)[0])["netIncomePerShare"]
        assert gt(row)["final_answer"]["value"] == pytest.approx(md.last_bar(t).c / eps, abs=0.006)
    # The arithmetic of both is the expert's last call, a program the model can learn to write.
    for row in by_template(rows, "fiscal_metric") + by_template(rows, "pe_now"):
        last = gt(row)["tool_sequence"][-1]
        assert (last["server"], last["tool"]) == ("python", "run_python"), row["extra_info"]


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


# --------------------------------------------------------------------------- splits by instance

INSTANCE_SPLITS = {"train": 0.5, "validation": 0.3, "transfer": 0.2}
INSTANCE_OPTS = GenerateOptions(
    n=40,
    seed=1,
    domains=("polygon", "fmp"),  # no python: these tests need no sandbox
    complexities=("simple", "medium"),
    splits=INSTANCE_SPLITS,
    instance_splits=("validation",),
)


@pytest.fixture(scope="module")
async def instance_run(pool: LocalToolPool) -> tuple[list[dict[str, Any]], list[tuple[str, ...]]]:
    """Rows with validation by instance, and every phrasing list the templates offered (to tell which was used)."""
    offered: list[tuple[str, ...]] = []
    say = r.Ctx.say

    def recording(self: r.Ctx, phrasings: Any, **fields: Any) -> str:
        offered.append(tuple(phrasings))
        return say(self, phrasings, **fields)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(r.Ctx, "say", recording)
        rows = await r.generate(CFG, INSTANCE_OPTS, pool)
    return rows, offered


def tickers_of(row: dict[str, Any]) -> set[str]:
    extra = row["extra_info"]
    return {extra["ticker"]} if "ticker" in extra else set(extra.get("tickers", []))


def phrasing_pattern(phrasing: str) -> re.Pattern[str]:
    """A phrasing with its fields as wildcards; the prompt may add a lead-in (and lowercase the first letter)."""
    parts = re.split(r"\{[^}]*\}", phrasing)
    return re.compile(".*?".join(map(re.escape, parts)), re.IGNORECASE)


async def test_instance_split_redraws_train_templates_with_held_out_tickers(
    instance_run: tuple[list[dict[str, Any]], list[tuple[str, ...]]],
) -> None:
    rows, _ = instance_run
    assert Counter(row["extra_info"]["split"] for row in rows) == row_quotas(40, INSTANCE_SPLITS)
    templates: dict[str, set[str]] = {}
    for row in rows:
        split, extra = row["extra_info"]["split"], row["extra_info"]
        templates.setdefault(split, set()).add(extra["template"])
        if split == "validation":
            assert extra["held_out"] is True
            assert tickers_of(row) <= set(r.HELD_OUT_TICKERS), row["extra_info"]
        else:
            assert "held_out" not in extra
            assert tickers_of(row) <= set(r.TRAIN_TICKERS), row["extra_info"]
    assert sum(bool(tickers_of(row)) for row in rows if row["extra_info"]["split"] == "validation") >= 8
    assert len(templates["validation"]) >= 3 and templates["validation"] <= templates["train"]
    assert not templates["transfer"] & templates["train"]  # transfer stays by whole template
    # train and transfer share templates as a plain two-way template split (renormalized) would
    kinds = {t.id: t.complexity for t in r.eligible_templates(INSTANCE_OPTS)}
    where = assign_templates(list(kinds), {"train": 0.5 / 0.7, "transfer": 0.2 / 0.7}, 1, kinds)
    assert templates["train"] <= {t for t, s in where.items() if s == "train"}
    assert templates["transfer"] <= {t for t, s in where.items() if s == "transfer"}


async def test_instance_split_uses_only_the_held_out_phrasing(
    instance_run: tuple[list[dict[str, Any]], list[tuple[str, ...]]],
) -> None:
    rows, offered = instance_run
    last = {p[-1] for p in offered if len(p) > 1}
    others = {q for p in offered for q in p[:-1]}
    for row in rows:
        prompt = row["prompt"][-1]["content"]
        used_last = {p for p in last if phrasing_pattern(p).search(prompt)}
        used_other = {p for p in others if phrasing_pattern(p).search(prompt)}
        if row["extra_info"]["split"] == "validation":
            assert used_last and not used_other, prompt
        else:
            assert used_other and not used_last, prompt


async def test_instance_split_shares_no_task_or_near_duplicate_prompt(
    instance_run: tuple[list[dict[str, Any]], list[tuple[str, ...]]],
) -> None:
    rows, _ = instance_run
    assert len({gt(row)["task_id"] for row in rows}) == len(rows)
    prompts = [row["prompt"][-1]["content"] for row in rows]
    assert not near_duplicates(prompts, CFG.generation.near_duplicate_threshold)


def test_held_out_part_of_the_choices() -> None:
    for i in range(20):
        held = r.Ctx(random.Random(i), None, None, held_out=True)
        a, b = held.ticker_pair()
        assert a != b and {a, b} <= set(r.HELD_OUT_TICKERS)
        assert held.phrasings(("x", "y", "z")) == ("z",)
        trained = r.Ctx(random.Random(i), None, None, held_out=False)
        assert set(trained.ticker_pair()) <= set(r.TRAIN_TICKERS)
        assert trained.phrasings(("x", "y", "z")) == ("x", "y")
        assert trained.phrasings(("only",)) == held.phrasings(("only",)) == ("only",)  # a lone phrasing is shared
    assert len(r.HELD_OUT_TICKERS) == 6 and set(r.HELD_OUT_TICKERS) <= set(r.TICKERS)
    assert r.Ctx(random.Random(0), None, None).tickers() == r.TICKERS  # no instance split: every ticker


async def test_train_alone_beside_an_instance_split(pool: LocalToolPool) -> None:
    opts = GenerateOptions(
        n=8, seed=2, domains=("polygon",), complexities=("simple",),
        splits={"train": 0.5, "validation": 0.5}, instance_splits=("validation",),
    )  # fmt: skip
    got = await r.generate(CFG, opts, pool)
    assert Counter(row["extra_info"]["split"] for row in got) == {"train": 4, "validation": 4}


@pytest.mark.parametrize(
    ("splits", "instance", "message"),
    [
        ({"train": 0.8, "test": 0.2}, ("validation",), r"instance_splits: validation not among the splits"),
        ({}, ("validation",), r"instance_splits: validation not among the splits \(none\)"),
        ({"train": 0.8, "validation": 0.2}, ("train",), "instance_splits: train cannot be an instance split"),
        ({"fit": 0.8, "validation": 0.2}, ("validation",), "instance_splits: needs a split named train"),
    ],
)
async def test_bad_instance_splits(
    pool: LocalToolPool, splits: dict[str, float], instance: tuple[str, ...], message: str
) -> None:
    with pytest.raises(GenerationError, match=message):
        await r.generate(CFG, GenerateOptions(n=4, splits=splits, instance_splits=instance), pool)


def test_instance_splits_come_from_the_config() -> None:
    cfg = CFG.model_copy(deep=True)
    cfg.generation.instance_splits = ["validation"]
    assert GenerateOptions.from_config(cfg).instance_splits == ("validation",)


# --------------------------------------------------------------------------- row counts per split


async def test_split_rows_fill_each_split_to_its_count_with_the_fractions_templates(pool: LocalToolPool) -> None:
    """Rows by count (many training rows beside evaluation sets of a fixed size); templates still by fraction."""
    cfg = CFG.model_copy(deep=True)
    g = cfg.generation
    g.seed, g.domains, g.complexities = 1, ["polygon", "fmp"], ["simple", "medium"]
    g.splits, g.instance_splits = dict(INSTANCE_SPLITS), ["validation"]
    g.split_rows = {"train": 20, "validation": 6, "transfer": 4}
    opts = GenerateOptions.from_config(cfg)
    assert opts.n == 30
    rows = await r.generate(cfg, opts, pool)
    assert Counter(row["extra_info"]["split"] for row in rows) == g.split_rows
    kinds = {t.id: t.complexity for t in r.eligible_templates(opts)}
    where = assign_templates(list(kinds), {"train": 0.5 / 0.7, "transfer": 0.2 / 0.7}, 1, kinds)
    for row in rows:  # the same templates per split as the fractions alone give
        home = "train" if row["extra_info"]["split"] == "validation" else row["extra_info"]["split"]
        assert where[row["extra_info"]["template"]] == home, row["extra_info"]


@pytest.mark.parametrize(
    ("split_rows", "message"),
    [
        ({"train": 20, "validation": 6}, r"split_rows must give a row count for each split and only those"),
        ({"train": 20, "validation": 6, "transfer": 0}, r"split_rows: every split needs at least one row"),
    ],
)
def test_bad_split_rows_name_the_key(split_rows: dict[str, int], message: str) -> None:
    from configs.loader import ConfigError, load_config

    sets = [f"generation.splits={json.dumps(INSTANCE_SPLITS)}", f"generation.split_rows={json.dumps(split_rows)}"]
    with pytest.raises(ConfigError, match=f"generation(.|\n)*{message}"):
        load_config(None, sets)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--n", "12"], {}, "--n 12 and generation.split_rows both say how many rows to make"),
        ([], {"N_SAMPLES": "12"}, "environment N_SAMPLES=12 and generation.split_rows both say"),
        (["--split", "train=0.8,test=0.2"], {}, "--split=train=0.8,test=0.2: Value error, split_rows must give a row"),
        (["--method", "llm"], {}, "generation.split_rows: only the rule method fills splits to a row count"),
    ],
)
def test_split_rows_beside_another_row_count_is_refused(argv: list[str], env: dict[str, str], message: str) -> None:
    from jobs.generate_tasks import build_parser, resolve

    cfg = CFG.model_copy(deep=True)
    cfg.generation.splits, cfg.generation.instance_splits = dict(INSTANCE_SPLITS), ["validation"]
    cfg.generation.split_rows = {"train": 20, "validation": 6, "transfer": 4}
    if "--split" in argv or "--method" in argv:  # instance splits would be refused first
        cfg.generation.instance_splits = []
    method = [] if "--method" in argv else ["--method", "rule"]
    args = build_parser().parse_args([*method, *argv])
    with pytest.raises(GenerationError, match=re.escape(message)):
        resolve(args, cfg, env)
