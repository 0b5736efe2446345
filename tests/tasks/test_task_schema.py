"""tasks/schema.py:TaskRow is the one task contract; tasks/task_row.schema.json is generated from it."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from pydantic import ValidationError

from tasks import schema as model
from tasks.schema import COMPLEXITY_CALLS, SCHEMA_PATH, TaskRow, render_json_schema, task_row_json_schema

SCHEMA = json.loads(SCHEMA_PATH.read_text())
VALIDATOR = Draft202012Validator(SCHEMA)


def good() -> dict[str, Any]:
    return {
        "data_source": "mcprl/test",
        "env_class": "MCPToolEnv",
        "prompt": [
            {"role": "system", "content": "You are a financial assistant."},
            {"role": "user", "content": "What was NVDA's last close? Post it to #markets."},
        ],
        "reward_spec": {
            "method": "rule",
            "ground_truth": {
                "task_id": "t-1",
                "complexity": "medium",
                "max_turns": 4,
                "success": {"must_call_tool": "polygon.previous_close"},
                "tool_sequence": [
                    {"step": 1, "server": "polygon", "tool": "previous_close", "params": {"ticker": "NVDA"}},
                    {
                        "step": 2,
                        "server": "slack",
                        "tool": "post_message",
                        "params": {"channel": "markets", "text": "x"},
                    },
                ],
                "limits": {"max_servers": 2, "max_tools": 2},
                "final_answer": {"value": 186.52, "tolerance": 0.01, "description": "NVDA close"},
            },
        },
        "extra_info": {"method": "rule", "template": "close-and-post"},
    }


def gt(row: dict[str, Any]) -> dict[str, Any]:
    return row["reward_spec"]["ground_truth"]


def calls(n: int, complexity: str) -> Callable[[dict], None]:
    """A task of `complexity` with n calls of one tool, otherwise consistent."""

    def edit(row: dict) -> None:
        g = gt(row)
        g.update(complexity=complexity, max_turns=max(n, 1), limits={"max_servers": 1, "max_tools": 1})
        g["tool_sequence"] = [
            {"step": i, "server": "polygon", "tool": "previous_close", "params": {"ticker": "NVDA"}}
            for i in range(1, n + 1)
        ]

    return edit


def setter(path: str, value: Any) -> Callable[[dict], None]:
    """Set (or, with DELETE, remove) a field given as a dotted path with list indices: a.b.0.c."""

    def edit(row: dict) -> None:
        *parents, last = path.split(".")
        node: Any = row
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        key: Any = int(last) if last.isdigit() else last
        if value is DELETE:
            del node[key]
        else:
            node[key] = value

    return edit


DELETE = object()
GT = "reward_spec.ground_truth"
SEQ = f"{GT}.tool_sequence"

VALID: dict[str, Callable[[dict], None]] = {
    "as is": lambda r: None,
    "user message only": lambda r: r.update(prompt=r["prompt"][1:]),
    "defaults left out": lambda r: [
        r.pop("env_class"),
        r.pop("extra_info"),
        r["reward_spec"].pop("method"),
        gt(r).pop("final_answer"),
        gt(r)["tool_sequence"][1].pop("params"),
    ],
    "final_answer null": setter(f"{GT}.final_answer", None),
    "final_answer text": setter(f"{GT}.final_answer", {"value": "NVIDIA"}),
    "final_answer integer": setter(f"{GT}.final_answer.value", 186),
    "method llm_judge": setter("reward_spec.method", "llm_judge"),
    "simple, 1 call": calls(1, "simple"),
    "medium, 3 calls": calls(3, "medium"),
    "hard, 4 calls": calls(4, "hard"),
    "hard, 12 calls": calls(12, "hard"),
    "max_turns 50": setter(f"{GT}.max_turns", 50),
    "must_call_tool a server": setter(f"{GT}.success.must_call_tool", "polygon"),
    "tolerance an integer": setter(f"{GT}.final_answer.tolerance", 0),
    "free-form params and extra_info": lambda r: [
        gt(r)["tool_sequence"][0].update(params={"a": [1, {"b": None}], "c": 1.5}),
        r.update(extra_info={"nested": {"x": [1, 2]}, "n": None}),
    ],
    "integral float for an integer": setter(f"{GT}.max_turns", 4.0),  # JSON has one number type
}

INVALID: dict[str, Callable[[dict], None]] = {
    "data_source missing": setter("data_source", DELETE),
    "data_source empty": setter("data_source", ""),
    "data_source a number": setter("data_source", 7),
    "env_class other": setter("env_class", "OtherEnv"),
    "unknown top-level field": setter("answer", 1),
    "prompt missing": setter("prompt", DELETE),
    "prompt empty": setter("prompt", []),
    "prompt not a list": setter("prompt", "hello"),
    "prompt of 3 messages": lambda r: r["prompt"].append({"role": "user", "content": "more"}),
    "assistant turn": setter("prompt.1.role", "assistant"),
    "unknown role": setter("prompt.0.role", "tool"),
    "system only": lambda r: r.update(prompt=r["prompt"][:1]),
    "user then system": lambda r: r.update(prompt=r["prompt"][::-1]),
    "two user messages": setter("prompt.0.role", "user"),
    "content empty": setter("prompt.1.content", ""),
    "content a number": setter("prompt.1.content", 5),
    "message with extra key": setter("prompt.1.name", "bob"),
    "reward_spec missing": setter("reward_spec", DELETE),
    "reward_spec extra key": setter("reward_spec.weight", 1),
    "method unknown": setter("reward_spec.method", "judge"),
    "ground_truth missing": setter(f"{GT}", DELETE),
    "task_id missing": setter(f"{GT}.task_id", DELETE),
    "task_id empty": setter(f"{GT}.task_id", ""),
    "task_id a number": setter(f"{GT}.task_id", 3),
    "complexity unknown": setter(f"{GT}.complexity", "extreme"),
    "max_turns 0": setter(f"{GT}.max_turns", 0),
    "max_turns 51": setter(f"{GT}.max_turns", 51),
    "max_turns fractional": setter(f"{GT}.max_turns", 4.5),
    "success missing": setter(f"{GT}.success", DELETE),
    "success extra key": setter(f"{GT}.success.also", "x"),
    "must_call_tool with a space": setter(f"{GT}.success.must_call_tool", "poly gon.previous_close"),
    "must_call_tool ending in a dot": setter(f"{GT}.success.must_call_tool", "polygon."),
    "must_call_tool empty": setter(f"{GT}.success.must_call_tool", ""),
    # Strict types: no coercion from strings or booleans.
    "integer as a string": setter(f"{GT}.max_turns", "4"),
    "integer as a boolean": setter(f"{SEQ}.0.step", True),
    "limit as a boolean": setter(f"{GT}.limits.max_tools", True),
    "number as a string": setter(f"{GT}.final_answer.tolerance", "0.01"),
    "value as a boolean": setter(f"{GT}.final_answer.value", True),
    "content as a list": setter("prompt.1.content", ["hi"]),
    "tool_sequence empty": setter(f"{GT}.tool_sequence", []),
    "tool_sequence not a list": setter(f"{GT}.tool_sequence", {}),
    "step missing": setter(f"{SEQ}.1.step", DELETE),
    "step 0": setter(f"{SEQ}.0.step", 0),
    "server empty": setter(f"{SEQ}.0.server", ""),
    "tool missing": setter(f"{SEQ}.1.tool", DELETE),
    "params a list": setter(f"{SEQ}.0.params", ["NVDA"]),
    "step extra key": setter(f"{SEQ}.0.note", "x"),
    "limits missing": setter(f"{GT}.limits", DELETE),
    "max_servers 0": setter(f"{GT}.limits.max_servers", 0),
    "max_tools missing": setter(f"{GT}.limits.max_tools", DELETE),
    "limits extra key": setter(f"{GT}.limits.max_calls", 3),
    "final_answer a number": setter(f"{GT}.final_answer", 186.52),
    "final_answer value missing": setter(f"{GT}.final_answer.value", DELETE),
    "final_answer value a list": setter(f"{GT}.final_answer.value", [1]),
    "final_answer value null": setter(f"{GT}.final_answer.value", None),
    "tolerance negative": setter(f"{GT}.final_answer.tolerance", -0.1),
    "description a number": setter(f"{GT}.final_answer.description", 1),
    "extra_info a list": setter("extra_info", []),
    "ground_truth extra key": setter(f"{GT}.difficulty", 3),
    # Cross-field rules that the JSON Schema states too:
    "simple with 2 calls": calls(2, "simple"),
    "medium with 1 call": calls(1, "medium"),
    "medium with 4 calls": calls(4, "medium"),
    "hard with 3 calls": calls(3, "hard"),
    "hard with 13 calls": calls(13, "hard"),
}

# TaskRow rules JSON Schema cannot state: the schema accepts these rows, the model (and so the gate) does not.
CODE_ONLY: dict[str, tuple[Callable[[dict], None], str]] = {
    "steps out of order": (setter(f"{SEQ}.0.step", 2), "1, 2, ... in order"),
    "must_call_tool is not the first step": (
        setter(f"{GT}.success.must_call_tool", "slack.post_message"),
        "first step's server.tool 'polygon.previous_close' or its server 'polygon'",
    ),
    "must_call_tool is another server": (setter(f"{GT}.success.must_call_tool", "slack"), "first step's server"),
    "must_call_tool is a bare tool name": (
        setter(f"{GT}.success.must_call_tool", "previous_close"),
        "first step's server",
    ),
    "more servers than max_servers": (setter(f"{GT}.limits.max_servers", 1), "max_servers"),
    "more tools than max_tools": (setter(f"{GT}.limits.max_tools", 1), "max_tools"),
    "max_turns below the calls": (setter(f"{GT}.max_turns", 1), "max_turns"),
}


def made(edit: Callable[[dict], None]) -> dict[str, Any]:
    row = copy.deepcopy(good())
    edit(row)
    return row


def model_accepts(row: dict[str, Any]) -> bool:
    try:
        TaskRow.model_validate(row)
    except ValidationError:
        return False
    return True


def test_schema_is_valid_draft_2020_12() -> None:
    Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize("case", VALID)
def test_valid_rows_pass_both(case: str) -> None:
    row = made(VALID[case])
    assert [e.message for e in VALIDATOR.iter_errors(row)] == []
    assert model_accepts(row)


@pytest.mark.parametrize("case", INVALID)
def test_invalid_rows_fail_both(case: str) -> None:
    row = made(INVALID[case])
    assert not VALIDATOR.is_valid(row), "the JSON Schema accepts it"
    assert not model_accepts(row), "TaskRow accepts it"


@pytest.mark.parametrize("case", CODE_ONLY)
def test_rules_checked_in_code_are_documented(case: str) -> None:
    edit, words = CODE_ONLY[case]
    row = made(edit)
    assert VALIDATOR.is_valid(row)
    with pytest.raises(ValidationError, match=re.escape(words)):
        TaskRow.model_validate(row)
    # The schema's description tells readers that the rule exists and where it is checked.
    assert "checked in code" in SCHEMA["description"]


def test_schema_description_names_every_code_rule() -> None:
    text = SCHEMA["description"]
    for phrase in (
        "1, 2, ... in order",
        "must_call_tool names the first step's server",
        "limits.max_servers",
        "limits.max_tools",
        "max_turns is at least the number of tool calls",
    ):
        assert phrase in text


# --------------------------------------------------------------------------- generated, not written


def test_the_schema_file_is_generated_from_the_model() -> None:
    """The committed file is exactly what TaskRow generates; after changing the model, regenerate it."""
    assert SCHEMA == task_row_json_schema()
    assert SCHEMA_PATH.read_text() == render_json_schema(), "run: python -m tasks.schema --write"


def test_schema_check_command_fails_on_drift(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    model.main(["--check"])
    assert "up to date" in capsys.readouterr().out
    stale = tmp_path / "task_row.schema.json"
    stale.write_text(SCHEMA_PATH.read_text().replace('"minimum": 1', '"minimum": 2', 1))
    monkeypatch.setattr(model, "SCHEMA_PATH", stale)
    with pytest.raises(SystemExit, match=r"out of date.*python -m tasks\.schema --write"):
        model.main(["--check"])
    model.main(["--write"])
    assert stale.read_text() == render_json_schema()
    model.main(["--check"])


def test_a_parsed_row_dumps_to_a_row_both_accept() -> None:
    dumped = TaskRow.model_validate(made(VALID["defaults left out"])).model_dump()
    assert VALIDATOR.is_valid(dumped) and model_accepts(dumped)
    assert dumped["env_class"] == "MCPToolEnv" and dumped["extra_info"] == {}


def test_integral_floats_are_integers() -> None:
    task = TaskRow.model_validate(made(setter(f"{GT}.max_turns", 4.0)))
    assert task.ground_truth.max_turns == 4 and type(task.ground_truth.max_turns) is int


def test_must_call_matches_both_forms() -> None:
    tool_form = TaskRow.model_validate(good()).ground_truth
    server_form = TaskRow.model_validate(made(setter(f"{GT}.success.must_call_tool", "polygon"))).ground_truth
    assert tool_form.must_call_matches("polygon", "previous_close")
    assert not tool_form.must_call_matches("polygon", "ticker_details")
    assert server_form.must_call_matches("polygon", "previous_close")
    assert server_form.must_call_matches("polygon", "ticker_details")
    assert not server_form.must_call_matches("slack", "post_message")
    assert not server_form.must_call_matches("polygonx", "previous_close")


def test_complexity_rules_match_the_model() -> None:
    rules = {}
    for rule in SCHEMA["$defs"]["GroundTruth"]["allOf"]:
        complexity = rule["if"]["properties"]["complexity"]["const"]
        bounds = rule["then"]["properties"]["tool_sequence"]
        rules[complexity] = (bounds["minItems"], bounds["maxItems"])
    assert rules == COMPLEXITY_CALLS


def test_prompt_shape_rule() -> None:
    shapes = {
        ("user",): True,
        ("system", "user"): True,
        ("system",): False,
        ("user", "user"): False,
        ("user", "system"): False,
        ("system", "system"): False,
    }
    for roles, ok in shapes.items():
        row = made(lambda r, roles=roles: r.update(prompt=[{"role": x, "content": "hi"} for x in roles]))
        assert VALIDATOR.is_valid(row) is ok is model_accepts(row), roles
