"""envs/prompting.py, the one prompt renderer: where the tools go for a template that renders `tools`
(a Qwen-style ChatML one, a Llama-3-style one) and for one that does not (SmolLM2's), what
MCPToolEnv.init returns in each mode, and the call syntax each template teaches."""

from __future__ import annotations

from typing import Any

import pytest

from actors.models import load_tokenizer
from configs.schema import Config
from envs.mcp_tool_env import MCPToolEnv, run_sync
from envs.parsing import ToolIndex, format_tool_call, parse_turn
from envs.prompting import (
    TOOL_CALL_FORMAT,
    answer_instruction,
    call_syntax,
    prompt_messages,
    render,
    render_prompt,
    template_tool_call,
    template_uses_tools,
    tool_prompt_for,
)
from envs.tool_client import set_tool_client
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


def init(tool_prompt: str, final_answer: str = "tag") -> tuple[list[dict], dict]:
    env = MCPToolEnv({"env": {"tool_prompt": tool_prompt, "final_answer": final_answer}}, extras=ROW)
    return run_sync(env.ainit(None))


def test_which_templates_render_tools(smol, chatml):
    assert not template_uses_tools(smol) and tool_prompt_for(smol) == "system"
    assert template_uses_tools(chatml) and tool_prompt_for(chatml) == "template"
    assert tool_prompt_for(with_template(smol, LLAMA3_STYLE)) == "template"


def test_env_init_system_mode_puts_the_block_in_the_system_message(client):
    messages, info = init("system")
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("You are a trader.\n\n")
    assert TOOL_CALL_FORMAT in messages[0]["content"] and '"polygon.previous_close"' in messages[0]["content"]
    assert "slack" not in messages[0]["content"]  # only the servers of the task's tool_sequence
    assert info["tools"] == ["polygon.previous_close"] and info["tool_definitions"] == []
    assert messages == prompt_messages(ROW["prompt"], TOOLS, "system")


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
