"""The exported chat template (envs/chat_template.py) shows `tools=` and OpenAI-style tool calls to the
model exactly as training did: compared with envs/prompting.py's rendering, character for character."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.models import load_tokenizer
from configs.schema import Config
from envs.chat_template import served_chat_template
from envs.parsing import format_tool_call
from envs.prompting import _as_function, render, render_prompt
from serve_apps.tool_pool import LocalToolPool
from tasks.inventory import inventory_tools_for_prompt

# Schema shapes our servers do not use yet, each a branch of compact_tool_line's _type.
ODD_TOOL = {
    "name": "odd.shapes",
    "description": "Odd shapes, e.g. refs and unions. Second sentence is dropped.",
    "parameters": {
        "type": "object",
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
        "properties": {
            "where": {"$ref": "#/$defs/Point"},
            "missing": {"$ref": "#/$defs/Nope"},
            "either": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "string"}]},
            "one": {"oneOf": [{"type": "integer"}, {"const": "auto"}]},
            "wrapped": {"allOf": [{"type": "boolean"}]},
            "kinds": {"type": ["string", "integer"]},
            "tags": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
            "plain_list": {"items": {"type": "string"}},
            "when": {"type": "string", "format": "date", "pattern": "^x$", "title": "When"},
            "deep": {
                "type": "object",
                "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}},
            },
            "blob": {"type": "object"},
            "title": {"type": "string", "default": "a default that is far too long to show"},
            "unicode": {"type": "string", "default": "é", "description": "Café …"},
            "free": {},
        },
        "required": ["where", "title"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(Config().model)  # SmolLM2's tokenizer: its own template ignores tools


@pytest.fixture(scope="module")
def tools() -> list[dict]:
    """Every offline server's real tool list (as an episode shows it), plus ODD_TOOL."""

    async def listing() -> dict:
        pool = await LocalToolPool.create(Config().tools)
        try:
            return await pool.list_tools()
        finally:
            await pool.close()

    return [*inventory_tools_for_prompt(asyncio.run(listing())), ODD_TOOL]


@pytest.mark.parametrize("tool_format", ["compact", "json"])
@pytest.mark.parametrize("final_answer", ["tag", "no_call"])
def test_tools_render_as_training_showed_them(
    tokenizer: Any, tools: list[dict], tool_format: str, final_answer: str
) -> None:
    cfg = Config()
    env = cfg.env.model_copy(update={"tool_format": tool_format, "final_answer": final_answer})
    template = served_chat_template(tokenizer, env)
    functions = [_as_function(t) for t in tools]
    for messages in (
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
    ):
        trained = render_prompt(tokenizer, messages, tools, final_answer, tool_format)
        served = tokenizer.apply_chat_template(
            messages, tools=functions, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        assert served == trained
    assert "odd.shapes" in served and "python.run_python" in served


def test_tool_calls_and_results_render_as_training_wrote_them(tokenizer: Any, tools: list[dict]) -> None:
    cfg = Config()
    template = served_chat_template(tokenizer, cfg.env)
    args = {"ticker": "AAPL"}
    openai_style = [
        {"role": "user", "content": "Close of AAPL?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "polygon.previous_close", "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "polygon.previous_close returned:\n{...}"},
    ]
    served = tokenizer.apply_chat_template(
        openai_style,
        tools=[_as_function(t) for t in tools],
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    # What an episode renders: the tool block in the system message, the call as text, the result in the
    # env's observation role (tool).
    from envs.prompting import prompt_messages

    episode = [
        *prompt_messages(openai_style[:1], tools),
        {"role": "assistant", "content": format_tool_call("polygon.previous_close", args)},
        {"role": cfg.env.observation_role, "content": openai_style[2]["content"]},
    ]
    assert served == render(tokenizer, episode)


def test_a_template_that_renders_tools_is_kept() -> None:
    tokenizer = load_tokenizer(Config().model)
    tokenizer.chat_template = "{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert served_chat_template(tokenizer, Config().env) == tokenizer.chat_template
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        served_chat_template(tokenizer, Config().env)
