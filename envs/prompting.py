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
  instruction with the call format `<tool_call>{"name": "server.tool", "arguments": {...}}</tool_call>`
  and how to give the final answer, then one line per tool. This is also what a trainer that applies
  the chat template itself without `tools=` needs (SkyRL's generator). How a tool's line reads is
  `EnvConfig.tool_format`:
  - "compact" (default): a signature and the description's first sentence,
    `fmp.income_statement(symbol: string, period?: "annual"|"quarter" = "annual", limit?: integer = 5) — ...`:
    `?` marks an optional parameter, enums are `"a"|"b"`, short defaults follow `=`; parameter
    descriptions and value constraints are left out (`compact_tool_line`).
  - "json": one JSON object per tool (name, description, parameters as `compact_schema` leaves them),
    over twice the tokens.
  Either way the server validates every call against the full schema and names what is wrong, so the
  shorter prompt loses no correctness, only hints.

Every rendering of one episode passes the same `tools=` (`render`), so a longer conversation renders
as an extension of a shorter one and the observation deltas stay token-exact.
The prompt ends with the generation prompt (the assistant turn's header): the model writes next.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from envs.parsing import CallFormat, ToolIndex, format_tool_call, parse_turn
from tasks.inventory import ToolListing, inventory_tools_for_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tasks.schema import TaskRow

ToolPrompt = Literal["system", "template"]
ToolFormat = Literal["compact", "json"]

TOOL_CALL_FORMAT = '<tool_call>{"name": "server.tool", "arguments": {...}}</tool_call>'
# The "json" block's instruction (tool_format json), kept word for word.
TOOL_INSTRUCTION = (
    "You can call the tools below. To call one, reply with exactly one tool call in this format:\n"
    f"{TOOL_CALL_FORMAT}\n"
    "You will get its result in the next message. When you have what you need, give the final answer "
    "{answer_format}.\nTools:"
)
# The "compact" block's: the same three facts (call format, result, final answer) in fewer words.
COMPACT_INSTRUCTION = (
    f"To call a tool, reply with only:\n{TOOL_CALL_FORMAT}\n"
    "Its result comes next. Give the final answer {answer_format}.\nTools (? = optional):"
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


def tool_block(tools: list[dict[str, Any]], final_answer: str = "tag", tool_format: ToolFormat = "compact") -> str:
    """The system-prompt text that presents the tools to a template that cannot: the instruction, then
    one line per tool, in `tool_format` (see the module docstring)."""
    answer = ANSWER_FORMATS[final_answer]
    if tool_format == "compact":
        lines = [compact_tool_line(t) for t in tools]
        return "\n".join([COMPACT_INSTRUCTION.replace("{answer_format}", answer), *lines])
    if tool_format != "json":
        raise ValueError(f"tool_format must be 'compact' or 'json', not {tool_format!r}")
    lines = [
        json.dumps(
            {"name": t["name"], "description": t.get("description", ""), "parameters": compact_schema(t["parameters"])}
        )
        for t in tools
    ]
    return "\n".join([TOOL_INSTRUCTION.replace("{answer_format}", answer), *lines])


MAX_DEFAULT_CHARS = 20  # a default longer than this (as JSON) is left out of a compact signature
_MAX_DEPTH = 2  # nested objects deeper than this are shown as `object`
# The end of a sentence: . ! or ? then whitespace, not after a common abbreviation ("e.g. AAPL").
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)(?<!\bvs)[.!?](?=\s)")


def first_sentence(text: str) -> str:
    """The first sentence of a description, on one line (its line breaks made spaces)."""
    text = " ".join(text.split())
    end = _SENTENCE_END.search(text)
    return text[: end.end()] if end else text


def compact_tool_line(tool: Mapping[str, Any]) -> str:
    """One tool as `server.tool(req: type, opt?: type = default) — First sentence of its description.`"""
    schema = tool.get("parameters") or {}
    line = f"{tool['name']}({_params(schema, schema, 0)})"
    description = first_sentence(str(tool.get("description") or ""))
    return f"{line} — {description}" if description else line


def _params(schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> str:
    """`name: type` for each property of an object schema, in schema order; optional ones `name?`."""
    required = set(schema.get("required") or [])
    parts = []
    for name, prop in (schema.get("properties") or {}).items():
        prop = prop if isinstance(prop, Mapping) else {}
        part = f"{name}{'' if name in required else '?'}: {_type(prop, root, depth)}"
        if "default" in prop:
            default = json.dumps(prop["default"], ensure_ascii=False)
            if len(default) <= MAX_DEFAULT_CHARS:
                part += f" = {default}"
        parts.append(part)
    return ", ".join(parts)


def _type(schema: Any, root: Mapping[str, Any], depth: int) -> str:
    """A schema's type, short: `string`, `integer[]`, `"a"|"b"`, `string|null`, `{a: string, b?: integer}`."""
    if not isinstance(schema, Mapping):
        return "any"
    if "enum" in schema:
        return "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    if isinstance(schema.get("$ref"), str):
        ref = schema["$ref"]
        target = _resolve(root, ref)
        if target is None or depth >= _MAX_DEPTH:
            return ref.rsplit("/", 1)[-1] or "object"
        return _type(target, root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return "|".join(dict.fromkeys(_type(s, root, depth) for s in schema[key])) or "any"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
        return _type(schema["allOf"][0], root, depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        return "|".join(_type({**schema, "type": k}, root, depth) for k in kind) or "any"
    if kind == "array" or (kind is None and "items" in schema):
        item = _type(schema.get("items"), root, depth) if "items" in schema else "any"
        return f"({item})[]" if "|" in item else f"{item}[]"
    if kind == "object" or (kind is None and "properties" in schema):
        if schema.get("properties") and depth < _MAX_DEPTH:
            return f"{{{_params(schema, root, depth + 1)}}}"
        return "object"
    if not isinstance(kind, str):
        return "any"
    return f"{kind}<{schema['format']}>" if isinstance(schema.get("format"), str) else kind


def _resolve(root: Mapping[str, Any], ref: str) -> Any:
    """The schema a local `$ref` ("#/$defs/Name") points to, or None."""
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for key in ref[2:].split("/"):
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node if isinstance(node, Mapping) else None


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
    tool_format: ToolFormat = "compact",
) -> list[dict[str, Any]]:
    """Copies of an episode's first messages with what the system message must add.

    "system": the tool block (in `tool_format`); "template": only the final-answer instruction (the
    template renders the tools, given to `render` as `tools=`). No tools: the messages unchanged.
    """
    out = [dict(m) for m in messages]
    if not tools:
        return out
    if tool_prompt == "system":
        text = tool_block(list(tools), final_answer, tool_format)
    else:
        text = answer_instruction(final_answer)
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
    tool_format: ToolFormat = "compact",
) -> str:
    """A task's first prompt as the model sees it, ending with the generation prompt: what an episode
    renders (`MCPToolEnv.init` with `tool_prompt_for(tokenizer)`, then `render`).

    `tools`: definitions {name ("server.tool"), description, parameters (JSON Schema)}, e.g. from
    `tasks.inventory.inventory_tools_for_prompt`; empty = no tools shown. `final_answer`, `tool_format`:
    the env's (`EnvConfig`).
    """
    mode = tool_prompt_for(tokenizer) if tools else "system"
    shown = prompt_messages(messages, tools, mode, final_answer, tool_format)
    return render(tokenizer, shown, tools if mode == "template" else None)


def count_prompt_tokens(
    tokenizer: PreTrainedTokenizerBase,
    row: TaskRow,
    tools_by_server: ToolListing,
    final_answer: str = "tag",
    tool_format: ToolFormat = "compact",
) -> int:
    """Tokens of a task's first prompt, with the tools of the servers its tool_sequence uses.

    Those servers' tools (all of them, not only the expected ones) are what an episode of the task is
    shown; a task whose servers are missing from `tools_by_server` is counted without them.
    """
    servers = {step.server for step in row.reward_spec.ground_truth.tool_sequence}
    tools = inventory_tools_for_prompt(tools_by_server, servers)
    messages = [m.model_dump() for m in row.prompt]
    return len(encode(tokenizer, render_prompt(tokenizer, messages, tools, final_answer, tool_format)))


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
