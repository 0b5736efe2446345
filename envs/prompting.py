"""The prompt a model sees: the conversation in its chat template, with the tool definitions where the
model expects them.

- A template that renders the `tools` argument (Qwen, Llama 3, ...) gets the tools through it, in
  the usual function-schema form. Whether it does is found by rendering a probe conversation with
  and without a probe tool and comparing (cached per template).
- A template that ignores `tools` (SmolLM2's) gets a tool block appended to the system message, or
  a system message holding only that block when the conversation has none: a short instruction,
  one JSON line per tool (name, description, parameters) and the call format
  `<tool_call>{"name": "server.tool", "arguments": {...}}</tool_call>`.

The prompt ends with the generation prompt (the assistant turn's header): the model writes next.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from tasks.inventory import ToolListing, inventory_tools_for_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tasks.schema import TaskRow

TOOL_CALL_FORMAT = '<tool_call>{"name": "server.tool", "arguments": {...}}</tool_call>'
TOOL_INSTRUCTION = (
    "You can call the tools below. To call one, reply with exactly one tool call in this format:\n"
    f"{TOOL_CALL_FORMAT}\n"
    "You will get its result in the next message. When you have what you need, give the final answer "
    "{answer_format}.\nTools:"
)
# How a final answer is marked, by EnvConfig.final_answer: the prompt must say what the parser expects.
ANSWER_FORMATS = {"tag": "inside <answer>...</answer>", "no_call": "as plain text, without a tool call"}

_PROBE_MESSAGES = [{"role": "user", "content": "probe"}]
_PROBE_TOOL = {"name": "probe_tool_x7q", "description": "probe", "parameters": {"type": "object", "properties": {}}}
_uses_tools: dict[str, bool] = {}  # chat template text -> whether it renders `tools`


def template_uses_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders its `tools` argument."""
    key = str(tokenizer.chat_template)
    if key not in _uses_tools:
        without = _apply(tokenizer, _PROBE_MESSAGES, None)
        with_tool = _apply(tokenizer, _PROBE_MESSAGES, [_as_function(_PROBE_TOOL)])
        _uses_tools[key] = with_tool != without
    return _uses_tools[key]


# Schema keywords that only constrain a value's shape: the server validates every call against the full
# schema and names the field that fails, so the prompt can leave them out. Regex patterns especially
# cost many tokens (about a third of the tool block) and tell a small model little.
PROMPT_OMITTED_KEYWORDS = frozenset({"pattern", "minLength", "maxLength", "additionalProperties", "$schema", "title"})


def compact_schema(schema: Any) -> Any:
    """A JSON Schema without PROMPT_OMITTED_KEYWORDS, at every level (property names are kept)."""
    if isinstance(schema, list):
        return [compact_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in PROMPT_OMITTED_KEYWORDS:
            continue
        if key == "properties" and isinstance(value, dict):  # keys here are parameter names, not keywords
            out[key] = {name: compact_schema(prop) for name, prop in value.items()}
        else:
            out[key] = compact_schema(value)
    return out


def tool_block(tools: list[dict[str, Any]], final_answer: str = "tag") -> str:
    """The system-prompt text that presents the tools to a template that cannot."""
    lines = [
        json.dumps(
            {"name": t["name"], "description": t.get("description", ""), "parameters": compact_schema(t["parameters"])}
        )
        for t in tools
    ]
    return "\n".join([TOOL_INSTRUCTION.replace("{answer_format}", ANSWER_FORMATS[final_answer]), *lines])


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> str:
    """The conversation as prompt text, ending with the generation prompt.

    `tools`: definitions {name ("server.tool"), description, parameters (JSON Schema)}, e.g. from
    `tasks.inventory.inventory_tools_for_prompt`; empty = no tools shown.
    """
    if not tools:
        return _apply(tokenizer, messages, None)
    if template_uses_tools(tokenizer):
        return _apply(tokenizer, messages, [_as_function(t) for t in tools])
    block = tool_block(tools)
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
    else:
        messages.insert(0, {"role": "system", "content": block})
    return _apply(tokenizer, messages, None)


def count_prompt_tokens(tokenizer: PreTrainedTokenizerBase, row: TaskRow, tools_by_server: ToolListing) -> int:
    """Tokens of a task's first prompt, with the tools of the servers its tool_sequence uses.

    Those servers' tools (all of them, not only the expected ones) are what an episode of the task is
    expected to show; a task whose servers are missing from `tools_by_server` is counted without them.
    """
    servers = {step.server for step in row.reward_spec.ground_truth.tool_sequence}
    tools = inventory_tools_for_prompt(tools_by_server, servers)
    text = render_prompt(tokenizer, [m.model_dump() for m in row.prompt], tools)
    # The template already wrote the special tokens as text: adding them again would count a BOS twice.
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _as_function(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def _apply(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
