"""envs/prompting.py, the one prompt renderer: where the tools go for a template that renders `tools`
(a Qwen-style ChatML one, a Llama-3-style one) and for one that does not (SmolLM2's), what
MCPToolEnv.init returns in each mode, the call syntax each template teaches, and the system tool
block's two formats (compact signatures, JSON lines) for the built-in servers' real tools."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from actors.models import load_tokenizer
from configs.schema import Config, ToolsConfig
from envs.mcp_tool_env import MCPToolEnv, run_sync
from envs.parsing import ToolIndex, format_tool_call, parse_turn
from envs.prompting import (
    TOOL_CALL_FORMAT,
    answer_instruction,
    call_syntax,
    compact_tool_line,
    encode,
    first_sentence,
    prompt_messages,
    render,
    render_prompt,
    template_tool_call,
    template_uses_tools,
    tool_block,
    tool_prompt_for,
)
from envs.tool_client import set_tool_client
from tasks.inventory import inventory_from_listing, inventory_tools_for_prompt, load_tool_listing
from tests.envs.tools_template import LLAMA3_STYLE, TOOLS_CHATML, with_template

LISTING = {
    "polygon": [
        {
            "name": "previous_close",
            "description": "Previous day's bar of a ticker.",
            "inputSchema": {
                "type": "object",
                "properties": {"ticker": {"type": "string", "pattern": "^[A-Z.]{1,10}$"}},
                "required": ["ticker"],
            },
        }
    ],
    "slack": [{"name": "post_message", "description": "Post.", "inputSchema": {"type": "object", "properties": {}}}],
}
ROW = {
    "prompt": [{"role": "system", "content": "You are a trader."}, {"role": "user", "content": "NVDA's close?"}],
    "reward_spec": {
        "ground_truth": {
            "task_id": "t-1",
            "complexity": "simple",
            "tool_sequence": [{"step": 1, "server": "polygon", "tool": "previous_close", "params": {"ticker": "NVDA"}}],
            "success": {"must_call_tool": "polygon.previous_close"},
            "max_turns": 4,
            "limits": {"max_servers": 1, "max_tools": 1},
        }
    },
}
TOOLS = [
    {
        "name": "polygon.previous_close",
        "description": "Previous day's bar of a ticker.",
        "parameters": LISTING["polygon"][0]["inputSchema"],
    }
]


class ListingOnly:
    """A tool client that only lists (init needs nothing more)."""

    async def list_tools(self) -> dict[str, list[dict[str, Any]]]:
        return LISTING

    async def call_tool(self, server: str, tool: str, arguments: dict[str, Any] | None = None) -> Any:
        raise AssertionError("init must not call tools")


@pytest.fixture(scope="module")
def smol() -> Any:
    return load_tokenizer(Config().model)


@pytest.fixture(scope="module")
def chatml(smol) -> Any:
    return with_template(smol, TOOLS_CHATML)


@pytest.fixture
def client():
    set_tool_client(ListingOnly())
    yield
    set_tool_client(None)


@pytest.fixture(scope="module")
def builtin_listing() -> dict[str, list[dict[str, Any]]]:
    """The real tool listing of every built-in server (offline backends), as the pool lists it."""
    return asyncio.run(load_tool_listing(ToolsConfig()))


def init(tool_prompt: str, final_answer: str = "tag", **env: Any) -> tuple[list[dict], dict]:
    env = MCPToolEnv({"env": {"tool_prompt": tool_prompt, "final_answer": final_answer, **env}}, extras=ROW)
    return run_sync(env.ainit(None))


def test_which_templates_render_tools(smol, chatml):
    assert not template_uses_tools(smol) and tool_prompt_for(smol) == "system"
    assert template_uses_tools(chatml) and tool_prompt_for(chatml) == "template"
    assert tool_prompt_for(with_template(smol, LLAMA3_STYLE)) == "template"


def test_env_init_system_mode_puts_the_block_in_the_system_message(client):
    messages, info = init("system")
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("You are a trader.\n\n")
    assert TOOL_CALL_FORMAT in messages[0]["content"]
    assert messages[0]["content"].endswith("\npolygon.previous_close(ticker: string) — Previous day's bar of a ticker.")
    assert "slack" not in messages[0]["content"]  # only the servers of the task's tool_sequence
    assert info["tools"] == ["polygon.previous_close"] and info["tool_definitions"] == []
    assert messages == prompt_messages(ROW["prompt"], TOOLS, "system")
    # env.tool_format json: the JSON lines instead, the rest of the conversation alike.
    as_json, _ = init("system", tool_format="json")
    assert as_json == prompt_messages(ROW["prompt"], TOOLS, "system", tool_format="json") != messages
    assert '\nTools:\n{"name": "polygon.previous_close", "description": "Previous day\'s bar' in as_json[0]["content"]
    assert as_json[1:] == messages[1:]


def test_env_init_template_mode_leaves_the_tools_to_the_template(client):
    messages, info = init("template", final_answer="no_call")
    # The row's messages, the system one told only how to answer; the tools come back for tools=.
    assert messages == [
        {"role": "system", "content": f"You are a trader.\n\n{answer_instruction('no_call')}"},
        ROW["prompt"][1],
    ]
    assert "without a tool call" in messages[0]["content"] and TOOL_CALL_FORMAT not in messages[0]["content"]
    assert info["tools"] == ["polygon.previous_close"] and info["tool_definitions"] == TOOLS


def test_render_prompt_is_what_an_episode_renders(smol, chatml, client):
    for tok in (smol, chatml):
        mode = tool_prompt_for(tok)
        messages, info = init(mode)
        assert render_prompt(tok, ROW["prompt"], TOOLS) == render(tok, messages, info["tool_definitions"])
    text = render_prompt(chatml, ROW["prompt"], TOOLS)
    # Qwen-style: the template's own tool section, with the schema compacted as our block compacts it.
    assert text.startswith("<|im_start|>system\nYou are a trader.\n\nWhen you have what you need")
    assert '<tools>\n{"type": "function", "function": {"name": "polygon.previous_close"' in text
    assert '"pattern"' not in text and TOOL_CALL_FORMAT not in text
    assert text.endswith("<|im_start|>user\nNVDA's close?<|im_end|>\n<|im_start|>assistant\n")
    # Without tools nothing is added, in either mode.
    assert render_prompt(chatml, ROW["prompt"], []) == render(chatml, ROW["prompt"])


def test_each_template_teaches_its_own_call_syntax(smol, chatml):
    args = {"ticker": "NVDA", "limit": 2}
    qwen = template_tool_call(chatml, "polygon.previous_close", args)
    call = '{"name": "polygon.previous_close", "arguments": {"ticker": "NVDA", "limit": 2}}'
    assert qwen == f"<tool_call>\n{call}\n</tool_call>"
    llama = template_tool_call(with_template(smol, LLAMA3_STYLE), "polygon.previous_close", args)
    assert llama == '{"name": "polygon.previous_close", "parameters": {"ticker": "NVDA", "limit": 2}}'
    # SmolLM2's template ignores tool_calls: our Hermes form, the one its tool block teaches.
    assert template_tool_call(smol, "polygon.previous_close", args) == format_tool_call("polygon.previous_close", args)
    assert call_syntax(smol) is format_tool_call
    assert call_syntax(chatml)("polygon.previous_close", args) == qwen
    index = ToolIndex({"polygon": {"previous_close": {"properties": {"ticker": {}, "limit": {}}}}})
    for text in (qwen, llama):
        parsed = parse_turn(text, index)
        assert [(c.name, c.arguments) for c in parsed.calls] == [("polygon.previous_close", args)]
        assert not parsed.errors


# --------------------------------------------------------------------------- the system tool block's formats


def test_compact_block_lists_every_tool_and_parameter_of_the_builtin_servers(builtin_listing, smol):
    tools = inventory_tools_for_prompt(builtin_listing)
    assert {t["name"].split(".")[0] for t in tools} == {"polygon", "fmp", "tavily", "slack", "python"}
    block = tool_block(tools)
    assert TOOL_CALL_FORMAT in block and "<answer>...</answer>" in block
    lines = block.split("\nTools (? = optional):\n")[1].split("\n")
    assert len(lines) == len(tools)
    for tool, line in zip(tools, lines, strict=True):
        signature, _, description = line.partition(") — ")
        assert signature.startswith(f"{tool['name']}(")
        assert description == first_sentence(tool["description"]) and "\n" not in description
        schema = tool["parameters"]
        required = set(schema.get("required") or [])
        for name in schema.get("properties") or {}:  # required plain, optional marked, schema order
            assert (f"{name}: " if name in required else f"{name}?: ") in signature
        assert "pattern" not in line and "maxLength" not in line  # constraints stay server-side
    by_name = dict(zip([t["name"] for t in tools], lines, strict=True))
    assert by_name["fmp.income_statement"].startswith(
        'fmp.income_statement(symbol: string, period?: "annual"|"quarter" = "annual", limit?: integer = 5) — '
    )
    assert by_name["tavily.extract"].startswith("tavily.extract(urls: string[]) — ")
    assert by_name["slack.list_channels"].startswith("slack.list_channels() — ")
    # Much shorter than the JSON lines: under half the tokens, for every server alone too.
    for server in builtin_listing:
        some = inventory_tools_for_prompt(builtin_listing, [server])
        compact, as_json = (len(encode(smol, tool_block(some, tool_format=f))) for f in ("compact", "json"))
        assert compact < 0.6 * as_json, (server, compact, as_json)
    assert len(encode(smol, block)) < 0.5 * len(encode(smol, tool_block(tools, tool_format="json")))


def test_json_block_is_unchanged():
    """tool_format json is the block as it was before compact became the default, word for word."""
    assert tool_block(TOOLS, tool_format="json") == (
        "You can call the tools below. To call one, reply with exactly one tool call in this format:\n"
        '<tool_call>{"name": "server.tool", "arguments": {...}}</tool_call>\n'
        "You will get its result in the next message. When you have what you need, give the final answer "
        "inside <answer>...</answer>.\nTools:\n"
        '{"name": "polygon.previous_close", "description": "Previous day\'s bar of a ticker.", "parameters": '
        '{"type": "object", "properties": {"ticker": {"type": "string"}}, "required": ["ticker"]}}'
    )
    assert tool_block(TOOLS, "no_call", "json").split("\n")[2].endswith("as plain text, without a tool call.")
    with pytest.raises(ValueError, match="tool_format"):
        tool_block(TOOLS, tool_format="yaml")  # type: ignore[arg-type]


def test_compact_signatures_of_other_schema_shapes():
    """What external servers' schemas may hold: unions, nullable, arrays, nested objects, $refs, long defaults."""
    schema = {
        "type": "object",
        "$defs": {"Range": {"type": "object", "properties": {"lo": {"type": "number"}}, "required": ["lo"]}},
        "properties": {
            "ids": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            "when": {"type": "string", "format": "date-time"},
            "range": {"$ref": "#/$defs/Range"},
            "mode": {"const": "fast"},
            "opts": {"type": "object", "properties": {"deep": {"type": "boolean", "default": False}}},
            "blob": {"type": "object"},
            "tags": {"type": ["string", "null"], "default": "a very long default value indeed"},
            "anything": {},
        },
        "required": ["ids", "range"],
    }
    tool = {"name": "ext.tool", "description": "Do it, e.g. now. Then more.\nAnd more.", "parameters": schema}
    assert compact_tool_line(tool) == (
        "ext.tool(ids: (integer|string)[], note?: string|null = null, when?: string<date-time>, "
        'range: {lo: number}, mode?: "fast", opts?: {deep?: boolean = false}, blob?: object, '
        "tags?: string|null, anything?: any) — Do it, e.g. now."
    )
    assert compact_tool_line({"name": "a.b", "parameters": {}}) == "a.b()"  # no description, no parameters
    assert first_sentence("Line one\n  wraps here. Two.") == "Line one wraps here."
    assert first_sentence("Runs Python 3.11 code") == "Runs Python 3.11 code"


def test_a_call_written_as_the_compact_block_teaches_parses(builtin_listing, smol):
    """The call format the block shows, filled in for a tool from its signature, parses to that call,
    also after a round trip through SmolLM2's tokenizer."""
    tools = inventory_tools_for_prompt(builtin_listing, ["fmp"])
    block = tool_block(tools)
    assert TOOL_CALL_FORMAT in block and 'period?: "annual"|"quarter"' in block
    text = TOOL_CALL_FORMAT.replace("server.tool", "fmp.income_statement").replace(
        "{...}", json.dumps({"symbol": "AAPL", "period": "quarter"})
    )
    assert text == format_tool_call("fmp.income_statement", {"symbol": "AAPL", "period": "quarter"})
    back = smol.decode(encode(smol, text))
    parsed = parse_turn(back, ToolIndex(inventory_from_listing(builtin_listing)))
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("fmp.income_statement", {"symbol": "AAPL", "period": "quarter"})
    ]
    assert not parsed.errors


def test_both_formats_render_stably_for_an_episode(smol, builtin_listing):
    """One episode's renderings extend each other (the observation deltas are token-exact) in either format."""
    tools = inventory_tools_for_prompt(builtin_listing, ["polygon"])
    for tool_format in ("compact", "json"):
        first = prompt_messages(ROW["prompt"], tools, "system", tool_format=tool_format)
        assert first == prompt_messages(ROW["prompt"], tools, "system", tool_format=tool_format)  # deterministic
        turn = [*first, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "y"}]
        short, long = render(smol, first), render(smol, turn)
        assert long.startswith(short.removesuffix("<|im_start|>assistant\n"))
        assert render_prompt(smol, ROW["prompt"], tools, tool_format=tool_format) == short
