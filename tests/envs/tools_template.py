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

# transformers renders with trim_blocks (a newline right after a block tag is dropped): every newline
# that follows a tag is written as an expression.
NL = "{{ '\\n' }}"

TOOLS_CHATML = (
    "{% if tools %}"
    "<|im_start|>system" + NL + "{% if messages[0].role == 'system' %}{{ messages[0].content }}" + NL + NL + "{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}" + NL + "{{ tool | tojson }}{% endfor %}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system" + NL + "{{ messages[0].content }}<|im_end|>" + NL + "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}" + NL + "{{ message.content }}<|im_end|>" + NL + ""
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant{% if message.content %}" + NL + "{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    + NL
    + '<tool_call>{{ \'\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{ call.function.arguments | tojson }}}" + NL + "</tool_call>{% endfor %}"
    "<|im_end|>" + NL + ""
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    + NL
    + "<tool_response>" + NL + "{{ message.content }}" + NL + "</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>" + NL + "{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant" + NL + "{% endif %}"
)

LLAMA3_STYLE = (
    "{% if tools %}<|im_start|>system" + NL + "Call a function by replying with JSON "
    '{"name": function name, "parameters": dictionary of argument name and its value}.'
    "{% for tool in tools %}" + NL + "{{ tool | tojson }}{% endfor %}<|im_end|>" + NL + "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}" + NL + "{% if message.tool_calls %}"
    '{{ \'{"name": "\' + message.tool_calls[0].function.name + \'", "parameters": \' }}'
    "{{ message.tool_calls[0].function.arguments | tojson }}}"
    "{% else %}{{ message.content }}{% endif %}"
    "<|im_end|>" + NL + "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant" + NL + "{% endif %}"
)


def with_template(tokenizer: Any, template: str = TOOLS_CHATML) -> Any:
    """A copy of `tokenizer` whose chat template is `template` (the original is left alone)."""
    out = copy.copy(tokenizer)
    out.chat_template = template
    return out
