"""envs/parsing.py: every call format, several calls a turn, names, aliases, and bad input of every kind."""

from __future__ import annotations

import json
import random

import pytest

from envs.parsing import MAX_TURN_CHARS, ToolIndex, parse_turn
from envs.parsing import format_tool_call as hermes

ALIASES = {"symbol": "ticker", "query_text": "query", "channel_name": "channel", "source": "code"}
INVENTORY = {
    "polygon": {
        "previous_close": {"properties": {"ticker": {"type": "string"}}},
        "ticker_details": {"properties": {"ticker": {"type": "string"}}},
    },
    "fmp": {"company_profile": {"properties": {"symbol": {"type": "string"}}}},
    "tavily": {"search": {"properties": {"query": {}, "max_results": {}}}},
    "python": {"run_python": {"properties": {"code": {}, "stdin": {}}}},
    "ext": {"search": {"properties": {"q": {}}}},  # makes the bare name `search` ambiguous
}
INDEX = ToolIndex(INVENTORY)


def parse(text, **kw):
    return parse_turn(text, INDEX, aliases=ALIASES, **kw)


# --------------------------------------------------------------------------- formats


def test_hermes_call():
    t = parse(hermes("polygon.previous_close", {"ticker": "NVDA"}))
    assert [(c.server, c.tool, c.arguments) for c in t.calls] == [("polygon", "previous_close", {"ticker": "NVDA"})]
    assert t.answer is None and t.errors == []


def test_hermes_several_calls_in_order_with_text_around():
    text = (
        "Let me look.\n"
        + hermes("polygon.previous_close", {"ticker": "A"})
        + "\nand\n"
        + hermes("fmp.company_profile", {"symbol": "B"})
        + hermes("python.run_python", {"code": "print(1)"})
    )
    t = parse(text)
    assert [c.name for c in t.calls] == ["polygon.previous_close", "fmp.company_profile", "python.run_python"]
    assert t.errors == []


def test_hermes_variants():
    # "tool" for "name", "parameters" for "arguments", arguments as a JSON string, OpenAI's function shape
    variants = [
        '<tool_call>{"tool": "polygon.previous_close", "parameters": {"ticker": "X"}}</tool_call>',
        '<tool_call>{"name": "polygon.previous_close", "arguments": "{\\"ticker\\": \\"X\\"}"}</tool_call>',
        '<tool_call>{"function": {"name": "polygon.previous_close", "arguments": {"ticker": "X"}}}</tool_call>',
        '<tool_call>\n```json\n{"name": "polygon.previous_close", "arguments": {"ticker": "X"}}\n```\n</tool_call>',
        '<tool_call>{"name": "polygon.previous_close", "arguments": {"ticker": "X"}}',  # stop string ate the tag
    ]
    for v in variants:
        t = parse(v)
        assert [(c.name, c.arguments) for c in t.calls] == [("polygon.previous_close", {"ticker": "X"})], v
        assert t.errors == [], v


def test_calls_in_the_syntax_tools_aware_templates_teach():
    # What the model writes after a chat template rendered the tools (envs/prompting.py "template" mode).
    qwen = '<tool_call>\n{"name": "polygon.previous_close", "arguments": {"ticker": "X"}}\n</tool_call>'
    llama = '{"name": "polygon.previous_close", "parameters": {"ticker": "X"}}'
    for text in (
        qwen,  # Qwen2.5/Qwen3, Hermes
        llama,  # Llama 3.x JSON
        f"<|python_tag|>{llama}",  # Llama 3.1 when decoded with its special tokens
        '{"type": "function", "name": "polygon.previous_close", "parameters": {"ticker": "X"}}',  # Llama 3.2/3.3
    ):
        t = parse(text)
        assert [(c.name, c.arguments) for c in t.calls] == [("polygon.previous_close", {"ticker": "X"})], text
        assert t.errors == [] and t.answer is None, text
    two = qwen + "\n" + qwen.replace("previous_close", "ticker_details")  # Qwen's several calls, one a line
    assert [c.name for c in parse(two).calls] == [
        "polygon.previous_close",
        "polygon.ticker_details",
    ]


def test_missing_arguments_is_empty_object():
    t = parse('<tool_call>{"name": "slack.list_channels"}</tool_call>', final_answer="tag")
    assert t.errors[0].kind == "unknown_tool"  # not in this inventory
    t = parse_turn('<tool_call>{"name": "slack.list_channels"}</tool_call>')  # no inventory: unchecked
    assert t.calls[0].arguments == {} and t.calls[0].name == "slack.list_channels"


def test_plain_json_call():
    for text in (
        '{"tool": "polygon.previous_close", "arguments": {"ticker": "X"}}',
        '{"name": "polygon.previous_close", "arguments": {"ticker": "X"}}',
        '```json\n{"tool": "polygon.previous_close", "arguments": {"ticker": "X"}}\n```',
        'I will call {"tool": "polygon.previous_close", "arguments": {"ticker": "X"}} now.',
    ):
        t = parse(text)
        assert [(c.name, c.arguments) for c in t.calls] == [("polygon.previous_close", {"ticker": "X"})], text
        assert t.errors == []


def test_plain_json_several_calls():
    t = parse(json.dumps([{"tool": "polygon.previous_close", "arguments": {}}, {"tool": "fmp.company_profile"}]))
    assert [c.name for c in t.calls] == ["polygon.previous_close", "fmp.company_profile"]
    text = 'first {"tool": "polygon.previous_close", "arguments": {"ticker": "A"}} then {"tool": "python.run_python"}'
    assert [c.name for c in parse(text).calls] == ["polygon.previous_close", "python.run_python"]


def test_plain_json_that_is_not_a_call_is_no_action():
    t = parse('{"ticker": "NVDA"}')
    assert t.calls == [] and [e.kind for e in t.errors] == ["no_action"]


def test_xml_call():
    t = parse('<tool><polygon.previous_close>{"ticker": "X"}</polygon.previous_close></tool>')
    assert [(c.name, c.arguments) for c in t.calls] == [("polygon.previous_close", {"ticker": "X"})]
    t = parse("<tool><polygon.previous_close></polygon.previous_close></tool>")
    assert t.calls[0].arguments == {}


def test_mixed_formats_keep_their_order():
    text = '<tool><fmp.company_profile>{"symbol": "A"}</fmp.company_profile></tool>' + hermes(
        "polygon.previous_close", {}
    )
    assert [c.name for c in parse(text).calls] == ["fmp.company_profile", "polygon.previous_close"]


def test_answer_tag():
    t = parse("I found it. <answer> 186.52 USD </answer>")
    assert t.answer == "186.52 USD" and t.calls == [] and t.errors == []
    assert parse("<answer>42").answer == "42"  # closing tag eaten by a stop string


def test_answer_with_call():
    t = parse(hermes("polygon.previous_close", {"ticker": "A"}) + "<answer>1</answer>")
    assert len(t.calls) == 1 and t.answer == "1"


def test_no_call_mode():
    t = parse("The close was 186.52.", final_answer="no_call")
    assert t.answer == "The close was 186.52." and t.errors == []
    t = parse(hermes("polygon.previous_close", {}), final_answer="no_call")
    assert t.answer is None and len(t.calls) == 1
    t = parse("<tool_call>{bad json</tool_call>", final_answer="no_call")
    assert t.answer is None and t.errors[0].kind == "malformed"  # a failed call attempt is not an answer


def test_tag_mode_plain_text_is_no_action():
    t = parse("The close was 186.52.")
    assert t.answer is None and [e.kind for e in t.errors] == ["no_action"]
    assert "<answer>" in t.errors[0].message


# --------------------------------------------------------------------------- names and aliases


def test_names():
    assert parse(hermes("polygon__previous_close", {})).calls[0].name == "polygon.previous_close"
    assert parse(hermes("previous_close", {})).calls[0].name == "polygon.previous_close"  # unambiguous bare
    t = parse(hermes("search", {}))
    assert t.calls == [] and t.errors[0].kind == "unknown_tool"
    assert "ambiguous" in t.errors[0].message and "tavily.search" in t.errors[0].message
    t = parse(hermes("polygon.nope", {}))
    assert t.errors[0].kind == "unknown_tool"
    assert "polygon.nope" in t.errors[0].message and "polygon.previous_close" in t.errors[0].message


def test_aliases_apply_only_where_the_schema_wants_them():
    t = parse(hermes("polygon.previous_close", {"symbol": "X"}))
    assert t.calls[0].arguments == {"ticker": "X"} and t.calls[0].aliased == {"symbol": "ticker"}
    # fmp's tool has `symbol` itself: no renaming (ticker -> symbol is not implied either)
    t = parse(hermes("fmp.company_profile", {"symbol": "X"}))
    assert t.calls[0].arguments == {"symbol": "X"} and t.calls[0].aliased == {}
    t = parse(hermes("fmp.company_profile", {"ticker": "X"}))
    assert t.calls[0].arguments == {"ticker": "X"}
    # the real name already given: the alias is left for the tool to reject
    t = parse(hermes("polygon.previous_close", {"symbol": "X", "ticker": "Y"}))
    assert t.calls[0].arguments == {"symbol": "X", "ticker": "Y"}
    t = parse(hermes("python.run_python", {"source": "print(1)"}))
    assert t.calls[0].arguments == {"code": "print(1)"}


def test_max_calls_drops_the_rest():
    text = "".join(hermes("polygon.previous_close", {"ticker": str(i)}) for i in range(6))
    t = parse(text, max_calls=4)
    assert len(t.calls) == 4 and t.dropped_calls == 2
    assert [e.kind for e in t.errors] == ["too_many_calls"] and "4" in t.errors[0].message


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("", "empty"),
        ("   \n\t ", "empty"),
        ("<tool_call>{not json}</tool_call>", "malformed"),
        ("<tool_call></tool_call>", "malformed"),
        ("<tool_call>[1, 2]</tool_call>", "malformed"),
        ('<tool_call>{"arguments": {}}</tool_call>', "malformed"),
        ('<tool_call>{"name": "polygon.previous_close", "arguments": [1]}</tool_call>', "malformed"),
        ('<tool_call>{"name": "polygon.previous_close", "arguments": "{oops"}</tool_call>', "malformed"),
        ('<tool_call>{"name": 5}</tool_call>', "malformed"),
        ("<tool>not xml</tool>", "malformed"),
        ("<tool><a.b>{bad}</a.b></tool>", "malformed"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "malformed"),
        ("just words", "no_action"),
    ],
)
def test_bad_input_gives_a_readable_error(text, kind):
    t = parse(text)
    assert t.calls == []
    assert t.errors and t.errors[0].kind == kind
    assert all(isinstance(e.message, str) and 10 < len(e.message) < 1000 for e in t.errors)


def test_nested_tags():
    inner = '{"name": "polygon.previous_close", "arguments": {"ticker": "X"}}'
    t = parse(f"<tool_call><tool_call>{inner}</tool_call></tool_call>")
    assert [c.name for c in t.calls] == ["polygon.previous_close"]
    t = parse(f"<answer><answer>{inner}</answer></answer>")
    assert t.answer is not None


def test_megabytes_are_refused_unread():
    text = "x" * (5 * 1024 * 1024) + hermes("polygon.previous_close", {"ticker": "X"})
    t = parse(text)
    assert t.calls == [] and [e.kind for e in t.errors] == ["too_long"]
    assert f"{MAX_TURN_CHARS:,}" in t.errors[0].message


def test_many_open_tags_just_under_the_limit():
    n = (MAX_TURN_CHARS - 10) // len("<tool_call>")
    t = parse("<tool_call>" * n)  # linear scan: one unterminated block whose body holds only open tags
    assert t.calls == [] and t.errors


def test_lone_surrogates_and_odd_types():
    t = parse('\ud800 <tool_call>{"name": "polygon.previous_close", "arguments": {"ticker": "\\udfff"}}</tool_call>')
    assert len(t.calls) == 1  # the JSON escape decodes to a lone surrogate; the env cleans it before the call
    t = parse("\udc00\ud800 <answer>\ud83d</answer>")
    assert t.answer is not None and t.answer.encode("utf-8")  # sanitized: encodable
    for odd in (None, 5, b"\xff\xfe<answer>1</answer>", ["a"], {"tool": "x"}):
        parse_turn(odd, INDEX)  # must not raise


def test_fuzz_never_raises():
    rng = random.Random(1234)
    pieces = [
        "<tool_call>",
        "</tool_call>",
        "<tool>",
        "</tool>",
        "<answer>",
        "</answer>",
        "{",
        "}",
        "[",
        "]",
        '"name"',
        '"tool"',
        ":",
        ",",
        '"polygon.previous_close"',
        '"arguments"',
        "\\",
        '"',
        "\ud800",
        "\x00",
        "é",
        "<",
        ">",
        "polygon__previous_close",
        "null",
        "1e999",
    ]
    for _ in range(3000):
        n = rng.randint(0, 30)
        text = "".join(rng.choice(pieces) if rng.random() < 0.7 else chr(rng.randint(0, 0x10FFFF)) for _ in range(n))
        for mode in ("tag", "no_call"):
            t = parse(text, final_answer=mode, max_calls=rng.randint(1, 5))
            assert t.calls or t.answer is not None or t.errors, text
            for e in t.errors:
                e.message.encode("utf-8")
