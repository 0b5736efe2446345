"""The prompt a model sees: the conversation in its chat template, with the tool definitions where the
model expects them. The one renderer of the env's first messages, the runners' prompt and observation
ids, the expert play and the token count of the gate and preflight.

Where the tools go (`EnvConfig.tool_prompt`, chosen per tokenizer by `tool_prompt_for`):

- "template": a chat template that renders its `tools` argument (Qwen2.5/Qwen3, Llama 3.x, Hermes,
  ...) gets them through it, in the usual function-schema form, and the model calls tools in the
  template's own syntax (`template_tool_call`). Whether a template renders `tools` is found by
  rendering a probe conversation with and without a probe tool and comparing (cached per template).
  The system message then says only how to give the final answer (`answer_instruction`).
- "system": a template that ignores `tools` (SmolLM2's) gets a tool block appended to the system
  message, or a system message holding only that block when the conversation has none: a short
  instruction, one JSON line per tool (name, description, parameters) and the call format
  `<tool_call>{"name": "server.tool", "arguments": {...}}</tool_call>`. This is also what a trainer
  that applies the chat template itself without `tools=` needs (SkyRL's generator).

Every rendering of one episode passes the same `tools=` (`render`), so a longer conversation renders
as an extension of a shorter one and the observation deltas stay token-exact.
The prompt ends with the generation prompt (the assistant turn's header): the model writes next.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from envs.parsing import CallFormat, ToolIndex, format_tool_call, parse_turn
from tasks.inventory import ToolListing, inventory_tools_for_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tasks.schema import TaskRow

ToolPrompt = Literal["system", "template"]

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
        without = render(tokenizer, _PROBE_MESSAGES)
        with_tool = render(tokenizer, _PROBE_MESSAGES, [_PROBE_TOOL])
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


def tool_prompt_for(tokenizer: PreTrainedTokenizerBase) -> ToolPrompt:
    """Where this tokenizer's prompts carry the tools: its chat template if it renders `tools`, else our block."""
    return "template" if template_uses_tools(tokenizer) else "system"


def answer_instruction(final_answer: str = "tag") -> str:
    """How to end an episode, for prompts whose tools (and call syntax) the chat template presents."""
    return f"When you have what you need, give the final answer {ANSWER_FORMATS[final_answer]}."


def prompt_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    tool_prompt: ToolPrompt = "system",
    final_answer: str = "tag",
) -> list[dict[str, Any]]:
    """Copies of an episode's first messages with what the system message must add.

    "system": the tool block; "template": only the final-answer instruction (the template renders
    the tools, given to `render` as `tools=`). No tools: the messages unchanged.
    """
    out = [dict(m) for m in messages]
    if not tools:
        return out
    text = tool_block(list(tools), final_answer) if tool_prompt == "system" else answer_instruction(final_answer)
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The chat template's text of `messages`; `tools` (definitions, see `render_prompt`) go to its `tools=`.

    Pass the same `tools` for every rendering of one conversation (prefix stability).
    """
    functions = [_as_function(t) for t in tools] if tools else None
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages], tools=functions, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Ids of rendered text: the template already wrote its special tokens (adding them again would
    count a BOS twice)."""
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    final_answer: str = "tag",
) -> str:
    """A task's first prompt as the model sees it, ending with the generation prompt: what an episode
    renders (`MCPToolEnv.init` with `tool_prompt_for(tokenizer)`, then `render`).

    `tools`: definitions {name ("server.tool"), description, parameters (JSON Schema)}, e.g. from
    `tasks.inventory.inventory_tools_for_prompt`; empty = no tools shown.
    """
    mode = tool_prompt_for(tokenizer) if tools else "system"
    shown = prompt_messages(messages, tools, mode, final_answer)
    return render(tokenizer, shown, tools if mode == "template" else None)


def count_prompt_tokens(
    tokenizer: PreTrainedTokenizerBase, row: TaskRow, tools_by_server: ToolListing, final_answer: str = "tag"
) -> int:
    """Tokens of a task's first prompt, with the tools of the servers its tool_sequence uses.

    Those servers' tools (all of them, not only the expected ones) are what an episode of the task is
    shown; a task whose servers are missing from `tools_by_server` is counted without them.
    """
    servers = {step.server for step in row.reward_spec.ground_truth.tool_sequence}
    tools = inventory_tools_for_prompt(tools_by_server, servers)
    return len(encode(tokenizer, render_prompt(tokenizer, [m.model_dump() for m in row.prompt], tools, final_answer)))


def call_syntax(tokenizer: PreTrainedTokenizerBase) -> CallFormat:
    """How a call is written in this tokenizer's prompts: the template's own syntax when it shows the
    tools (`template_tool_call`), else ours (`envs.parsing.format_tool_call`, what the tool block teaches)."""
    if tool_prompt_for(tokenizer) == "template":
        return partial(template_tool_call, tokenizer)
    return format_tool_call


_MARK = "\x00MCPRL-CALL-CONTENT\x00"


def template_tool_call(tokenizer: PreTrainedTokenizerBase, name: str, arguments: dict[str, Any]) -> str:
    """A call written in the syntax the chat template teaches (Qwen/Hermes `<tool_call>\\n{...}\\n</tool_call>`,
    Llama 3.x `{"name": ..., "parameters": {...}}`, ...), as the model would generate it.

    Found by rendering an assistant message with `tool_calls` and cutting away what the template
    puts around any assistant content. Falls back to our Hermes form (`format_tool_call`) when the
    template does not render `tool_calls` or what it renders does not parse back to this call.
    """
    user = {"role": "user", "content": "x"}
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    try:
        around = render(tokenizer, [user, {"role": "assistant", "content": _MARK}], add_generation_prompt=False)
        rendered = render(
            tokenizer, [user, {"role": "assistant", "content": "", "tool_calls": [call]}], add_generation_prompt=False
        )
    except Exception:  # a template that rejects the message shape
        return format_tool_call(name, arguments)
    head, _, tail = around.partition(_MARK)
    # Some templates write nothing (not even a newline) for empty content: cut at the common prefix.
    same = next((i for i, (a, b) in enumerate(zip(rendered, head, strict=False)) if a != b), len(head))
    text = rendered[same:]
    if tail and text.endswith(tail):
        text = text[: len(text) - len(tail)]
    text = text.strip()
    server, _, tool = name.partition(".")
    parsed = parse_turn(text, ToolIndex({server: {tool: {}}}))
    ok = [(c.name, c.arguments) for c in parsed.calls] == [(name, arguments)] and not parsed.errors
    return text if ok else format_tool_call(name, arguments)


def _as_function(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The OpenAI function form chat templates expect, with the schema compacted as in `tool_block`."""
    function = {k: tool[k] for k in ("name", "description") if k in tool}
    function["parameters"] = compact_schema(tool.get("parameters") or {"type": "object", "properties": {}})
    return {"type": "function", "function": function}
