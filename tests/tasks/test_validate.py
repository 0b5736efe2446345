"""The gate (tasks/validate.py), with the pieces it uses: the inventory, similarity and prompt rendering."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from actors.models import load_tokenizer
from configs.schema import ModelConfig, ToolsConfig
from envs.prompting import TOOL_CALL_FORMAT, count_prompt_tokens, render_prompt, template_uses_tools
from tasks import validate as v
from tasks.inventory import (
    inventory_from_listing,
    inventory_tools_for_prompt,
    live_writing_tools,
    load_inventory,
    load_tool_listing,
    tool_writes,
)
from tasks.io import read_rows
from tasks.schema import TaskRow
from tasks.similarity import near_duplicates, shingles, similarity, words

FIXTURE = Path(__file__).parent / "fixtures" / "gate_rows.jsonl"
GT = "reward_spec.ground_truth"
SEQ = f"{GT}.tool_sequence"

# Row number -> (path, words of the message) for every error in the fixture; rows 1, 22, 23 are good.
EXPECTED_ERRORS = {
    2: [("prompt[0].role", "not one of")],  # bad role
    3: [("prompt[1].role", "'assistant' is not one of"), ("prompt[0].role", "must be 'system'")],  # assistant turn
    4: [(f"{GT}.limits", "missing")],
    5: [(f"{GT}.max_turns", "expected integer, got string")],
    6: [(f"{SEQ}[0].server", "unknown server 'bloomberg'")],
    7: [(f"{SEQ}[0].tool", "polygon has no tool 'stock_price'")],
    8: [(f"{SEQ}[1].params.limit", "less than the minimum of 1")],
    9: [(f"{SEQ}[0].params.ticker", "missing")],
    10: [(f"{GT}.task_id", "duplicate task_id 'gate-good-1' (first in row 1)")],
    11: [(f"{SEQ}", "steps must be 1, 2, ... in order")],
    12: [(f"{GT}.success.must_call_tool", "first step's server.tool")],
    13: [(f"{SEQ}", "has 2 items; at most 1")],  # simple task, 2 calls
    14: [("answer", "unknown field")],
    15: [(f"{GT}.limits.max_servers", "more servers")],
    16: [(f"{GT}.complexity", "'extreme' is not one of")],
    17: [(f"{SEQ}[1].params.text", "expected string, got integer")],
    18: [(f"{GT}.final_answer.tolerance", "less than the minimum of 0")],
    19: [("env_class", "must be 'MCPToolEnv'")],
    20: [(f"{GT}.max_turns", "smaller than the number of tool calls")],
    21: [("prompt[0].role", "must be 'system'"), ("prompt[1].role", "must be 'user'")],  # user, then system
}
GOOD_ROWS = (1, 22, 23)


@pytest.fixture(scope="module")
def listing() -> dict[str, list[dict[str, Any]]]:
    return asyncio.run(load_tool_listing(ToolsConfig()))


@pytest.fixture(scope="module")
def inventory(listing: dict[str, list[dict[str, Any]]]) -> v.Inventory:
    return inventory_from_listing(listing)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(ModelConfig(name="tiny-random"))


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return read_rows(FIXTURE)


def good_row() -> dict[str, Any]:
    return read_rows(FIXTURE)[0]


def clean(message: str) -> str:
    return message.replace('"', "'")


# --------------------------------------------------------------------------- inventory


async def test_inventory_lists_servers_tools_and_schemas() -> None:
    inventory = await load_inventory(ToolsConfig())
    assert set(inventory) == {"polygon", "fmp", "tavily", "slack", "python"}
    assert inventory["polygon"]["previous_close"]["required"] == ["ticker"]
    assert "key_ratios" in inventory["fmp"] and "post_message" in inventory["slack"]


def test_inventory_strips_external_prefixes() -> None:
    listing = {
        "notes": [{"name": "notes.add", "description": "Add a note.", "inputSchema": {"type": "object"}}],
        "polygon": [{"name": "previous_close", "inputSchema": {"type": "object"}}],
    }
    obj = {"type": "object"}
    assert inventory_from_listing(listing) == {"notes": {"add": obj}, "polygon": {"previous_close": obj}}
    tools = inventory_tools_for_prompt(listing, servers=["notes"])
    assert tools == [{"name": "notes.add", "description": "Add a note.", "parameters": {"type": "object"}}]


# --------------------------------------------------------------------------- the fixture


def test_fixture_errors_have_row_numbers_and_paths(rows: list[dict[str, Any]], inventory: v.Inventory) -> None:
    report = v.validate_rows(rows, inventory)
    found = {(e.row, e.path): e for e in report.errors}
    for row, expected in EXPECTED_ERRORS.items():
        for path, words_ in expected:
            assert (row, path) in found, f"row {row}: no error at {path}; got {report.issues_for(row)}"
            assert words_ in clean(found[row, path].message), found[row, path]
            assert found[row, path].task_id == v.task_id_of(rows[row - 1])
    unexpected = {key for key in found if key not in {(r, p) for r, exp in EXPECTED_ERRORS.items() for p, _ in exp}}
    assert not unexpected, unexpected
    assert report.error_rows == sorted(EXPECTED_ERRORS)
    assert not report.ok
    assert report.duplicate_task_ids == {"gate-good-1": [1, 10]}


def test_fixture_near_duplicate_is_a_warning(rows: list[dict[str, Any]], inventory: v.Inventory) -> None:
    report = v.validate_rows(rows, inventory)
    assert [(w.row, w.path, w.kind) for w in report.warnings] == [(22, "prompt", v.NEAR_DUPLICATE)]
    assert "near-duplicate of row 1" in report.warnings[0].message
    assert report.near_duplicates == [(1, 22, 1.0)]
    strict = v.validate_rows(rows, inventory, strict=True)
    assert 22 in strict.error_rows and not strict.warnings


def test_good_rows_pass(rows: list[dict[str, Any]], inventory: v.Inventory) -> None:
    good = [rows[i - 1] for i in GOOD_ROWS]
    report = v.validate_rows(good, inventory, near_duplicate_threshold=1.0)
    assert report.errors == []
    assert report.ok
    assert v.validate_rows(good[::2], inventory).warnings == []  # rows 1 and 23 are not alike
    for i, row in enumerate(good):
        assert v.check_row(row, i, inventory) == []


def test_check_row_numbers_from_the_index(inventory: v.Inventory) -> None:
    row = good_row()
    row["reward_spec"]["ground_truth"]["tool_sequence"][0]["params"]["ticker"] = "no ticker!"
    (issue,) = v.check_row(row, 41, inventory)
    assert (issue.row, issue.task_id, issue.path, issue.kind) == (
        42,
        "gate-good-1",
        f"{SEQ}[0].params.ticker",
        v.PARAMS,
    )
    assert str(issue).startswith(f"row 42 (gate-good-1): {SEQ}[0].params.ticker: ")


def test_every_unknown_field_and_missing_field_is_named(inventory: v.Inventory) -> None:
    row = good_row()
    row["extra"] = row["more"] = 1
    del row["data_source"], row["reward_spec"]["ground_truth"]["success"]
    paths = {i.path for i in v.check_row(row, 0, inventory)}
    assert paths == {"extra", "more", "data_source", f"{GT}.success"}


# --------------------------------------------------------------------------- bad data never raises


GARBAGE: list[Any] = [
    None,
    [],
    "row",
    7,
    {},
    {"prompt": "x", "reward_spec": []},
    {"reward_spec": {"ground_truth": {"tool_sequence": "x", "task_id": 5}}},
    {"reward_spec": {"ground_truth": {"tool_sequence": [None, 1, {"server": 1, "tool": []}, {"server": "polygon"}]}}},
    {
        "reward_spec": {
            "ground_truth": {"tool_sequence": [{"server": "polygon", "tool": "previous_close", "params": []}]}
        }
    },
    {"prompt": [{"role": "user", "content": 5}], "reward_spec": {"ground_truth": {"task_id": ["x"]}}},
    {"prompt": [None], "extra_info": {"deep": [[[[]]]]}},
]


def test_garbage_is_reported_not_raised(inventory: v.Inventory) -> None:
    report = v.validate_rows([*GARBAGE, good_row()], inventory, count_tokens=lambda t: 1, max_tokens=0)
    assert report.error_rows == list(range(1, len(GARBAGE) + 1))
    assert report.errors[0].path == "" and "expected a JSON object, got null" in report.errors[0].message
    assert report.stats.valid_rows == 1
    assert [w.kind for w in report.warnings] == [v.TOO_LONG]


def test_a_broken_tool_schema_is_reported(rows: list[dict[str, Any]]) -> None:
    inventory = {"polygon": {"previous_close": {"type": "no-such-type"}}, "slack": {"post_message": {}}}
    issues = v.check_row(rows[0], 0, inventory)
    assert [(i.path, i.kind) for i in issues] == [(f"{SEQ}[0].params", v.PARAMS)]


# --------------------------------------------------------------------------- tokens and strict


def test_token_limits_warn_or_fail_with_strict(rows: list[dict[str, Any]], inventory: v.Inventory) -> None:
    good = [rows[0], rows[22]]
    lengths = {"gate-good-1": 120, "gate-good-2": 80}

    def count(task: TaskRow) -> int:
        return lengths[task.task_id]

    report = v.validate_rows(good, inventory, count_tokens=count, max_tokens=100)
    assert report.ok and report.token_counts == {1: 120, 2: 80}
    assert [(w.row, w.kind) for w in report.warnings] == [(1, v.TOO_LONG)]
    assert "120 tokens" in report.warnings[0].message and "limit is 100" in report.warnings[0].message
    assert (report.stats.prompt_tokens_mean, report.stats.prompt_tokens_max) == (100, 120)

    strict = v.validate_rows(good, inventory, count_tokens=count, max_tokens=100, strict=True)
    assert not strict.ok and [(e.row, e.kind) for e in strict.errors] == [(1, v.TOO_LONG)]
    assert v.validate_rows(good, inventory, count_tokens=count, max_tokens=200, strict=True).ok


def test_a_failing_token_counter_is_an_error(rows: list[dict[str, Any]], inventory: v.Inventory) -> None:
    def count(task: TaskRow) -> int:
        raise RuntimeError("tokenizer exploded")

    report = v.validate_rows([rows[0]], inventory, count_tokens=count)
    assert [(e.row, e.kind) for e in report.errors] == [(1, v.TOKENS)]
    assert "tokenizer exploded" in report.errors[0].message


def test_real_token_counts(rows: list[dict[str, Any]], inventory: v.Inventory, listing: Any, tokenizer: Any) -> None:
    task = TaskRow.model_validate(rows[0])
    n = count_prompt_tokens(tokenizer, task, listing)
    bare = len(tokenizer(task.user_message, add_special_tokens=False)["input_ids"])
    assert n > bare + 100  # the tool definitions count
    report = v.validate_rows(rows, inventory, count_tokens=lambda t: count_prompt_tokens(tokenizer, t, listing))
    assert report.token_counts[1] == n
    assert set(report.token_counts) == {i + 1 for i, r in enumerate(rows) if v.inspect_row(r, i, inventory)[1]}


# --------------------------------------------------------------------------- stats


def test_stats(rows: list[dict[str, Any]], inventory: v.Inventory) -> None:
    good = [rows[0], rows[22]]
    s = v.validate_rows(good, inventory).stats
    assert (s.rows, s.valid_rows) == (2, 2)
    assert s.by_complexity == {"medium": 1, "simple": 1}
    assert s.by_method == {"rule": 2}
    chars = [sum(len(m["content"]) for m in r["prompt"]) for r in good]
    assert (s.prompt_chars_mean, s.prompt_chars_max) == (sum(chars) / 2, max(chars))
    assert s.tool_calls == {"fmp.key_ratios": 1, "polygon.previous_close": 1, "slack.post_message": 1}
    assert "tavily.search" in s.unused_tools and "polygon.previous_close" not in s.unused_tools
    assert len(s.unused_tools) == sum(map(len, inventory.values())) - 3
    assert (s.max_turns_mean, s.max_turns_max, s.tool_calls_mean) == (3.5, 4, 1.5)
    assert s.prompt_tokens_mean is None


def test_stats_of_nothing(inventory: v.Inventory) -> None:
    report = v.validate_rows([], inventory)
    assert report.ok and report.stats.valid_rows == 0
    assert len(report.stats.unused_tools) == sum(map(len, inventory.values()))


# --------------------------------------------------------------------------- near-duplicates


def test_near_duplicate_rows_differing_in_a_number(inventory: v.Inventory) -> None:
    a, b = good_row(), good_row()
    b["reward_spec"]["ground_truth"]["task_id"] = "other"
    a["prompt"][-1]["content"] = "What did NVDA close at on 2026-11-19? Post it to #markets."
    b["prompt"][-1]["content"] = "what did nvda close at on 2026-11-18?  post it to #markets"
    report = v.validate_rows([a, b], inventory)
    assert report.ok and report.near_duplicates == [(1, 2, 1.0)]
    b["prompt"][-1]["content"] = "What did AAPL close at on 2026-11-19? Post it to #markets."
    assert v.validate_rows([a, b], inventory).warnings == []


def test_normalisation() -> None:
    assert words("NVDA closed at $186.52 on 2026-11-19!") == ["nvda", "closed", "at", "0", "0", "on", "0", "0", "0"]
    assert shingles("Hello") == {"hello"} and shingles("?!") == {""}
    assert similarity("Post it to #markets", "post IT to   markets.") == 1.0
    assert similarity("a b c", "d e f") == 0.0


def test_similarity_scale_matches_the_docs() -> None:
    sentence = [f"w{c}" for c in "abcdefghijklmnopqrst"]  # twenty words
    changed = [*sentence[:10], "other", *sentence[11:]]
    assert 0.75 < similarity(" ".join(sentence), " ".join(changed)) < 0.85
    assert 0.3 <= similarity("one two three four five", "one two tree four five") < 0.35


def brute_force(texts: list[str], threshold: float) -> list[tuple[int, int, float]]:
    return [
        (i, j, s)
        for i, j in itertools.combinations(range(len(texts)), 2)
        if (s := similarity(texts[i], texts[j])) >= threshold - 1e-9
    ]


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.7, 0.8, 0.9, 1.0])
def test_near_duplicates_finds_exactly_what_brute_force_finds(threshold: float) -> None:
    rng = random.Random(threshold)
    vocab = ["buy", "sell", "nvda", "aapl", "close", "price", "post", "to", "slack", "the", "of", "42"]
    base = [[rng.choice(vocab) for _ in range(rng.randint(1, 12))] for _ in range(40)]
    texts = []
    for ws in base:  # originals and mutated copies, so there are pairs at every level of similarity
        texts.append(" ".join(ws))
        for _ in range(3):
            copy_ = list(ws)
            for _ in range(rng.randint(0, 3)):
                copy_[rng.randrange(len(copy_))] = rng.choice(vocab)
            texts.append(" ".join(copy_))
    texts += ["", "?", "Buy NVDA"]
    assert near_duplicates(texts, threshold) == brute_force(texts, threshold)


def test_near_duplicates_rejects_a_bad_threshold() -> None:
    with pytest.raises(ValueError, match="threshold"):
        near_duplicates(["a"], 0)


# --------------------------------------------------------------------------- prompt rendering


def test_smollm2_template_gets_a_system_tool_block(tokenizer: Any, listing: Any) -> None:
    assert not template_uses_tools(tokenizer)  # SmolLM2's template ignores `tools`
    tools = inventory_tools_for_prompt(listing, ["polygon"])
    system = {"role": "system", "content": "You are a financial assistant."}
    user = {"role": "user", "content": "NVDA's last close?"}

    text = render_prompt(tokenizer, [system, user], tools, tool_format="json")  # the JSON lines
    head, _, tail = text.partition("<|im_start|>user\n")
    assert head.startswith("<|im_start|>system\nYou are a financial assistant.\n\n")
    assert TOOL_CALL_FORMAT in head
    lines = [json.loads(line.removesuffix("<|im_end|>")) for line in head.splitlines() if line.startswith('{"name"')]
    assert [t["name"] for t in lines] == [
        "polygon.previous_close",
        "polygon.daily_aggregates",
        "polygon.ticker_details",
    ]
    assert lines[0]["parameters"]["required"] == ["ticker"] and lines[0]["description"]
    assert '"pattern"' not in head and '"maxLength"' not in head  # validation-only keywords stay server-side
    assert tail == "NVDA's last close?<|im_end|>\n<|im_start|>assistant\n"

    without_system = render_prompt(tokenizer, [user], tools, tool_format="json")  # a system message of the tools
    assert without_system.startswith("<|im_start|>system\nYou can call the tools below.")
    compact = render_prompt(tokenizer, [user], tools)  # the default: one signature line per tool
    assert compact.startswith(f"<|im_start|>system\nTo call a tool, reply with only:\n{TOOL_CALL_FORMAT}\n")
    assert "\npolygon.previous_close(ticker: string) — " in compact and len(compact) < 0.6 * len(without_system)
    assert "SmolLM" not in without_system  # not the template's default system prompt
    assert render_prompt(tokenizer, [user], []) == tokenizer.apply_chat_template(
        [user], tokenize=False, add_generation_prompt=True
    )
    assert [system, user] == [{"role": "system", "content": "You are a financial assistant."}, user]  # not mutated


def test_templates_that_render_tools_get_them_natively(tokenizer: Any, listing: Any) -> None:
    native = copy.copy(tokenizer)
    native.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}[{{ t.function.name }}]{% endfor %}\n{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert template_uses_tools(native)
    tools = inventory_tools_for_prompt(listing, ["slack"])
    text = render_prompt(native, [{"role": "user", "content": "hi"}], tools)
    # The template shows the tools; the system message says only how to answer.
    assert text == (
        "TOOLS:[slack.list_channels][slack.read_history][slack.post_message]"
        "<system>When you have what you need, give the final answer inside <answer>...</answer>.\n"
        "<user>hi\n<assistant>"
    )


def test_token_count_uses_the_task_servers_tools(tokenizer: Any, listing: Any) -> None:
    task = TaskRow.model_validate(good_row())  # polygon and slack
    full = count_prompt_tokens(tokenizer, task, listing)
    only_task = {k: listing[k] for k in ("polygon", "slack")}
    assert count_prompt_tokens(tokenizer, task, only_task) == full
    assert count_prompt_tokens(tokenizer, task, {"polygon": listing["polygon"]}) < full


def test_compact_schema_drops_validation_keywords_but_keeps_parameter_names() -> None:
    from envs.prompting import compact_schema

    schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "pattern": {"type": "string", "pattern": "^a+$", "maxLength": 3, "description": "a param"},
            "items": {"type": "array", "items": {"type": "string", "minLength": 1}},
        },
        "required": ["pattern"],
    }
    assert compact_schema(schema) == {
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "description": "a param"},
            "items": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["pattern"],
    }


# --------------------------------------------------------------------------- must_call_tool: a server


def test_a_server_only_must_call_tool_passes_the_gate(inventory: v.Inventory) -> None:
    row = good_row()
    row["reward_spec"]["ground_truth"]["success"]["must_call_tool"] = "polygon"
    report = v.validate_rows([row], inventory)
    assert report.ok and report.errors == [] and report.stats.valid_rows == 1
    row["reward_spec"]["ground_truth"]["success"]["must_call_tool"] = "slack"  # not the first step's server
    (issue,) = v.validate_rows([row], inventory).errors
    assert (issue.row, issue.path, issue.kind) == (1, f"{GT}.success.must_call_tool", v.RULE)
    assert "first step's server.tool 'polygon.previous_close' or its server 'polygon'; got 'slack'" in issue.message


# --------------------------------------------------------------------------- live services


@pytest.fixture(scope="module")
def live_slack_listing() -> dict[str, list[dict[str, Any]]]:
    """The listing with Slack on its live backend: listing calls no API, so no token or network is needed."""
    off = {"enabled": False}
    cfg = ToolsConfig.model_validate(
        {"servers": {"slack": {"backend": "live"}, "polygon": {"backend": "live"}, "fmp": off, "tavily": off}}
    )
    return asyncio.run(load_tool_listing(cfg))


def test_live_writing_tools_come_from_annotations_and_backends(
    listing: dict[str, list[dict[str, Any]]], live_slack_listing: dict[str, list[dict[str, Any]]]
) -> None:
    live = ToolsConfig.model_validate({"servers": {"slack": {"backend": "live"}, "polygon": {"backend": "live"}}})
    assert live_writing_tools(live_slack_listing, live) == {"slack.post_message"}  # polygon only reads
    assert live_writing_tools(listing, ToolsConfig()) == set()  # offline backends
    # A tool without annotations may write (MCP's default); external servers have no backend setting.
    assert tool_writes({"name": "add"}) and not tool_writes({"name": "get", "annotations": {"readOnlyHint": True}})
    external = {"notes": [{"name": "notes.add", "inputSchema": {"type": "object"}}]}
    assert live_writing_tools(external, live) == set()


def test_a_plan_that_writes_to_a_live_service_is_a_warning(
    rows: list[dict[str, Any]], inventory: v.Inventory, live_slack_listing: dict[str, list[dict[str, Any]]]
) -> None:
    live = ToolsConfig.model_validate({"servers": {"slack": {"backend": "live"}}})
    writes = live_writing_tools(live_slack_listing, live)
    good = [rows[0], rows[22]]  # row 1 posts to Slack, row 2 (fmp) only reads
    report = v.validate_rows(good, inventory, live_writes=writes)
    assert report.ok
    assert [(w.row, w.task_id, w.path, w.kind) for w in report.warnings] == [
        (1, "gate-good-1", f"{SEQ}[1]", v.LIVE_WRITE)
    ]
    assert "slack.post_message writes to the live slack service" in report.warnings[0].message
    assert str(report.warnings[0]).startswith(f"row 1 (gate-good-1): {SEQ}[1]: slack.post_message")
    strict = v.validate_rows(good, inventory, live_writes=writes, strict=True)
    assert [(e.row, e.kind) for e in strict.errors] == [(1, v.LIVE_WRITE)]
    assert v.validate_rows(good, inventory).warnings == []  # offline: nothing to warn about


def test_training_data_with_live_writes_loads_with_a_warning(
    rows: list[dict[str, Any]],
    inventory: v.Inventory,
    live_slack_listing: dict[str, list[dict[str, Any]]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tasks.dataset import load_tasks
    from tasks.io import write_rows

    path = tmp_path / "train.jsonl"
    write_rows([rows[0], rows[22]], path)
    live = ToolsConfig.model_validate({"servers": {"slack": {"backend": "live"}}})
    with caplog.at_level("WARNING", logger="tasks.dataset"):
        loaded = load_tasks(path, inventory, "data.train", live_writing_tools(live_slack_listing, live))
    assert len(loaded) == 2  # a warning, not a refusal: preflight shows it and the run may go on
    assert "data.train: row 1 (gate-good-1)" in caplog.text and "slack.post_message writes to the live" in caplog.text
