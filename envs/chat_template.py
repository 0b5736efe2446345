"""The chat template an exported model ships with: its own, taught to present `tools=` the way training did.

A model whose template renders `tools` (Qwen, Llama 3.x, Hermes) keeps it unchanged. One whose template
ignores them (SmolLM2's) was trained with our tool block in the system message (envs/prompting.py:
`tool_block`, in the run's `env.tool_format`) and with calls written as `<tool_call>{...}</tool_call>`.
An OpenAI-compatible server (vLLM) knows nothing of that: it hands the template `tools=` and messages
with `tool_calls` and role `tool`. So the exported template starts with a Jinja preamble that
- appends the tool block, rendered from `tools` exactly as `tool_block` renders it, to the system message,
  as `prompt_messages` does; a request with `tools=` and no system message gets the system message the
  training tasks opened with (`training_system_prompt`; training never showed the model a conversation
  without it), or, when the export could not read them, a system message holding only the block;
- writes an assistant message's `tool_calls` as `format_tool_call` text after its content;
- gives tool results the role the env used for observations (`env.observation_role`);
then rebinds `messages` and runs the original template unchanged. A test renders our pool's tools
through it and compares with `envs.prompting.render_prompt`, character for character.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envs.prompting import (
    ANSWER_FORMATS,
    COMPACT_INSTRUCTION,
    MAX_DEFAULT_CHARS,
    PROMPT_OMITTED_KEYWORDS,
    TOOL_INSTRUCTION,
    tool_prompt_for,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from configs.schema import EnvConfig

# Our part of the template: the tool block's macros (twins of envs/prompting.py's) and the message rewrite.
TEMPLATE_FILE = Path(__file__).with_name("tool_block.jinja")


def training_system_prompt(rows: Iterable[Mapping[str, Any]]) -> str | None:
    """The system message most task rows open their prompt with (None: no row has one)."""
    counts = Counter(
        str(first.get("content") or "")
        for row in rows
        if isinstance(row.get("prompt"), list) and row["prompt"]
        for first in row["prompt"][:1]
        if isinstance(first, Mapping) and first.get("role") == "system"
    )
    return counts.most_common(1)[0][0] if counts else None


def served_chat_template(tokenizer: PreTrainedTokenizerBase, env: EnvConfig, system: str | None = None) -> str:
    """The chat template to ship with an exported model (see the module doc). Unchanged when the model's
    own template renders `tools`; otherwise ours in front of it, in `env`'s tool_format, final_answer and
    observation_role. `system`: the system message of a request with tools and none of its own (None: the
    tool block alone)."""
    original = tokenizer.chat_template
    if not isinstance(original, str) or not original:
        raise ValueError("the model's tokenizer has no chat template (a single string) to export")
    if tool_prompt_for(tokenizer) == "template":
        return original
    instruction = COMPACT_INSTRUCTION if env.tool_format == "compact" else TOOL_INSTRUCTION
    head = instruction.replace("{answer_format}", ANSWER_FORMATS[env.final_answer])
    settings = {  # JSON strings, numbers and lists of strings are Jinja literals too
        "MCPRL_HEAD": json.dumps(head),
        "MCPRL_FORMAT": json.dumps(env.tool_format),
        "MCPRL_OBSERVATION_ROLE": json.dumps(env.observation_role),
        "MCPRL_SYSTEM": json.dumps(system or ""),
        "MAX_DEFAULT": str(MAX_DEFAULT_CHARS),
        "OMITTED": json.dumps(sorted(PROMPT_OMITTED_KEYWORDS)),
    }
    preamble = "".join(f"{{%- set {name} = {value} -%}}" for name, value in settings.items())
    return preamble + TEMPLATE_FILE.read_text() + original
