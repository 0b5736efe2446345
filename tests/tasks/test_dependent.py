"""The `dependent` converter: conversations (OpenAI chat format) → task rows; bad specs named precisely."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from configs.schema import Config, ToolsConfig
from serve_apps.tool_pool import LocalToolPool
from tasks.admission import admit
from tasks.generators import dependent as d
from tasks.generators.options import GenerateOptions, GenerationError
from tasks.inventory import inventory_from_listing
from tasks.schema import TaskRow

EXAMPLE = Path(__file__).resolve().parents[2] / "tasks" / "examples" / "conversations.jsonl"


def call(cid: str, name: str, args: Any) -> dict[str, Any]:
    arguments = args if isinstance(args, str) else json.dumps(args)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def spec(*calls: dict[str, Any]) -> dict[str, Any]:
    """A good conversation: one user question, one assistant turn per call, each answered."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What did NVDA close at?"}]
    for c in calls:
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [c]},
            {"role": "tool", "tool_call_id": c["id"], "content": "{}"},
        ]
    messages.append({"role": "assistant", "content": "It closed at $186.52."})
    return {"messages": messages}


GOOD = spec(call("c1", "polygon.previous_close", {"ticker": "NVDA"}))


def test_the_example_file_converts() -> None:
    rows = d.convert_specs(d.load_specs(EXAMPLE))
    assert len(rows) == 4
    tasks = [TaskRow.model_validate(row) for row in rows]
    assert [t.reward_spec.ground_truth.complexity for t in tasks] == ["simple", "medium", "hard", "medium"]
    first, second, third, fourth = tasks
    assert first.task_id == "example-nvda-close"
    assert [m.role for m in first.prompt] == ["system", "user"]
    assert first.reward_spec.ground_truth.final_answer is not None
    assert rows[0]["extra_info"]["final_assistant"].startswith("NVDA closed at")
    # server__tool names, JSON arguments parsed, metadata kept
    steps = second.reward_spec.ground_truth.tool_sequence
    assert [(s.server, s.tool) for s in steps] == [("fmp", "income_statement"), ("python", "run_python")]
    assert steps[0].params == {"symbol": "AAPL", "period": "annual", "limit": 2}
    assert rows[1]["extra_info"]["source"] == "example" and rows[1]["extra_info"]["method"] == "dependent"
    assert [m.role for m in second.prompt] == ["user"]
    assert third.reward_spec.ground_truth.success.must_call_tool == "polygon.previous_close"
    assert len(third.reward_spec.ground_truth.tool_sequence) == 4
    # two calls in one assistant turn, content given as text parts
    assert [s.params["symbol"] for s in fourth.reward_spec.ground_truth.tool_sequence] == ["KO", "PFE"]
    assert fourth.user_message.startswith("Which has the higher beta")


async def test_the_example_rows_pass_the_gate() -> None:
    pool = await LocalToolPool.create(ToolsConfig())
    try:
        rows = await d.generate(Config(), GenerateOptions(input_path=EXAMPLE), pool)
        inventory = inventory_from_listing(await pool.list_tools())
        admission = await admit(rows, pool, inventory, 0.9)
    finally:
        await pool.close()
    assert admission.rejected == [] and len(admission.kept) == 4


def test_complexity_and_limits_follow_the_calls() -> None:
    calls = [call(f"c{i}", "polygon.previous_close", {"ticker": t}) for i, t in enumerate(["A", "B", "C", "D", "E"])]
    assert d.convert_spec(spec(*calls[:3]), 0)["reward_spec"]["ground_truth"]["complexity"] == "medium"
    row = d.convert_spec(spec(*calls), 0, max_turns=3, max_tools=2)
    truth = row["reward_spec"]["ground_truth"]
    assert truth["complexity"] == "hard" and truth["max_turns"] == 5  # raised to the number of calls
    assert truth["limits"] == {"max_servers": 1, "max_tools": 2}
    assert d.convert_spec(GOOD, 0)["reward_spec"]["ground_truth"]["task_id"].startswith("dep-")
    bare = d.convert_spec(GOOD["messages"], 0)  # the message list alone is a spec too
    assert bare["reward_spec"]["ground_truth"]["tool_sequence"][0]["params"] == {"ticker": "NVDA"}


def test_later_user_messages_and_unanswered_calls_are_recorded() -> None:
    s = copy.deepcopy(GOOD)
    later = call("c2", "polygon__previous_close", {"ticker": "AAPL"})
    s["messages"] += [
        {"role": "user", "content": "And AAPL?"},
        {"role": "assistant", "content": None, "tool_calls": [later]},
    ]
    row = d.convert_spec(s, 0)
    assert row["extra_info"]["later_user_messages"] == ["And AAPL?"]
    assert row["extra_info"]["unanswered_calls"] == [2]
    assert "final_assistant" not in row["extra_info"]  # the conversation ended on a call


def broken(edit: str) -> Any:
    s = copy.deepcopy(spec(call("c1", "polygon.previous_close", {"ticker": "NVDA"})))
    m = s["messages"]
    if edit == "json":
        m[1]["tool_calls"][0]["function"]["arguments"] = '{"ticker": NVDA}'
    elif edit == "not_object":
        m[1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    elif edit == "name":
        m[1]["tool_calls"][0]["function"]["name"] = "previous_close"
    elif edit == "call_id":
        m[2]["tool_call_id"] = "c9"
    elif edit == "role":
        m[2]["role"] = "function"
    elif edit == "system_late":
        m.insert(1, {"role": "system", "content": "late"})
    elif edit == "no_user":
        del m[0]
    elif edit == "no_calls":
        s["messages"] = [m[0], m[-1]]
    elif edit == "empty_user":
        m[0]["content"] = "  "
    elif edit == "messages":
        return {"messages": "hello"}
    elif edit == "too_many":
        return spec(*(call(f"c{i}", "polygon.previous_close", {"ticker": "NVDA"}) for i in range(13)))
    return s


@pytest.mark.parametrize(
    ("edit", "where", "message"),
    [
        ("json", "spec[1].messages[1].tool_calls[0]", "not valid JSON"),
        ("not_object", "spec[1].messages[1].tool_calls[0]", "must be a JSON object"),
        ("name", "spec[1].messages[1].tool_calls[0]", "'server.tool' or 'server__tool'"),
        ("call_id", "spec[1].messages[2]", "unknown tool_call_id 'c9'"),
        ("role", "spec[1].messages[2]", "unknown role 'function'"),
        ("system_late", "spec[1].messages[1]", "system message must come first"),
        ("no_user", "spec[1].messages[0]", "before the first user message"),
        ("no_calls", "spec[1]", "no tool calls"),
        ("empty_user", "spec[1].messages[0]", "non-empty text"),
        ("messages", "spec[1]", "non-empty `messages` list"),
        ("too_many", "spec[1]", "13 tool calls; a task has at most 12"),
    ],
)
def test_bad_specs_name_the_spec_and_message(edit: str, where: str, message: str) -> None:
    with pytest.raises(GenerationError) as e:
        d.convert_specs([GOOD, broken(edit)], source="convs.jsonl")
    text = str(e.value)
    assert text.startswith("convs.jsonl: 1 bad conversation spec(s)")
    assert f"{where}: " in text and message in text, text


def test_every_bad_spec_is_reported_at_once() -> None:
    with pytest.raises(GenerationError) as e:
        d.convert_specs([broken("json"), GOOD, broken("call_id")])
    assert "2 bad conversation spec(s)" in str(e.value)
    assert "spec[0].messages[1]" in str(e.value) and "spec[2].messages[2]" in str(e.value)


def test_input_files(tmp_path: Path) -> None:
    (tmp_path / "list.json").write_text(json.dumps([GOOD, GOOD["messages"]]))
    assert len(d.load_specs(tmp_path / "list.json")) == 2
    (tmp_path / "one.json").write_text(json.dumps(GOOD))
    assert len(d.load_specs(tmp_path / "one.json")) == 1
    (tmp_path / "bad.jsonl").write_text(json.dumps(GOOD) + "\n\n{oops\n")
    with pytest.raises(GenerationError, match=r"bad.jsonl:3: not valid JSON"):
        d.load_specs(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(GenerationError, match="holds no conversations"):
        d.load_specs(tmp_path / "empty.jsonl")
    with pytest.raises(GenerationError, match=r"must be \.jsonl or \.json"):
        d.load_specs(tmp_path / "x.txt")
    with pytest.raises(GenerationError, match="does not exist"):
        d.load_specs(tmp_path / "missing.jsonl")


async def test_generate_needs_an_input_file() -> None:
    with pytest.raises(GenerationError, match="--in"):
        await d.generate(Config(), GenerateOptions(), None)
