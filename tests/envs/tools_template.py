"""Chat templates that render `tools`, set on copies of the tiny-random (SmolLM2) tokenizer, since no
tools-aware model can be downloaded in the tests.

- `TOOLS_CHATML`: ChatML written the way Qwen2.5's template is: the tools as JSON lines inside
  `<tools></tools>` in the system turn with the `<tool_call>` instruction, assistant `tool_calls` as
  `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, and consecutive `tool` messages
  wrapped as `<tool_response>` blocks in one user turn.
- `LLAMA3_STYLE`: Llama 3.x's call syntax, `{"name": ..., "parameters": {...}}`, in the same ChatML
  framing (the tokenizer has ChatML's special tokens, not Llama's).
"""

from __future__ import annotations

import copy
from typing import Any


def _jinja(source: str) -> str:
    """A template written one piece a line: lines are joined without their indentation and `⏎` is a
    newline written as an expression (transformers renders with trim_blocks, which drops a newline
    right after a block tag)."""
    return "".join(line.strip() for line in source.splitlines()).replace("⏎", "{{ '\\n' }}")


TOOLS_CHATML = _jinja(
    """
    {% if tools %}
      <|im_start|>system⏎
      {% if messages[0].role == 'system' %}{{ messages[0].content }}⏎⏎{% endif %}
      # Tools⏎⏎You may call one or more functions to assist with the user query.⏎⏎
      You are provided with function signatures within <tools></tools> XML tags:⏎<tools>
      {% for tool in tools %}⏎{{ tool | tojson }}{% endfor %}
      ⏎</tools>⏎⏎For each function call, return a json object with function name and arguments within
      {{ ' ' }}<tool_call></tool_call> XML tags:⏎<tool_call>⏎
      {"name": <function-name>, "arguments": <args-json-object>}⏎</tool_call><|im_end|>⏎
    {% elif messages[0].role == 'system' %}
      <|im_start|>system⏎{{ messages[0].content }}<|im_end|>⏎
    {% endif %}
    {% for message in messages %}
      {% if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        <|im_start|>{{ message.role }}⏎{{ message.content }}<|im_end|>⏎
      {% elif message.role == 'assistant' %}
        <|im_start|>assistant
        {% if message.content %}⏎{{ message.content }}{% endif %}
        {% for call in message.tool_calls or [] %}
          ⏎<tool_call>⏎{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
          ⏎</tool_call>
        {% endfor %}
        <|im_end|>⏎
      {% elif message.role == 'tool' %}
        {% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
        ⏎<tool_response>⏎{{ message.content }}⏎</tool_response>
        {% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>⏎{% endif %}
      {% endif %}
    {% endfor %}
    {% if add_generation_prompt %}<|im_start|>assistant⏎{% endif %}
    """
)

LLAMA3_STYLE = _jinja(
    """
    {% if tools %}
      <|im_start|>system⏎Call a function by replying with JSON
      {{ ' ' }}{"name": function name, "parameters": dictionary of argument name and its value}.
      {% for tool in tools %}⏎{{ tool | tojson }}{% endfor %}<|im_end|>⏎
    {% endif %}
    {% for message in messages %}
      <|im_start|>{{ message.role }}⏎
      {% if message.tool_calls %}
        {% set call = message.tool_calls[0].function %}
        {"name": "{{ call.name }}", "parameters": {{ call.arguments | tojson }}}
      {% else %}{{ message.content }}{% endif %}
      <|im_end|>⏎
    {% endfor %}
    {% if add_generation_prompt %}<|im_start|>assistant⏎{% endif %}
    """
)


def with_template(tokenizer: Any, template: str = TOOLS_CHATML) -> Any:
    """A copy of `tokenizer` whose chat template is `template` (the original is left alone)."""
    out = copy.copy(tokenizer)
    out.chat_template = template
    return out
