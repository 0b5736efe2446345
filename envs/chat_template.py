"""The chat template an exported model ships with: its own, taught to present `tools=` the way training did.

A model whose template renders `tools` (Qwen, Llama 3.x, Hermes) keeps it unchanged. One whose template
ignores them (SmolLM2's) was trained with our tool block in the system message (envs/prompting.py:
`tool_block`, in the run's `env.tool_format`) and with calls written as `<tool_call>{...}</tool_call>`.
An OpenAI-compatible server (vLLM) knows nothing of that: it hands the template `tools=` and messages
with `tool_calls` and role `tool`. So the exported template starts with a Jinja preamble that
- appends the tool block, rendered from `tools` exactly as `tool_block` renders it, to the system message
  (or adds a system message holding only the block), as `prompt_messages` does;
- writes an assistant message's `tool_calls` as `format_tool_call` text after its content;
- gives tool results the role the env used for observations (`env.observation_role`);
then rebinds `messages` and runs the original template unchanged. A test renders our pool's tools
through it and compares with `envs.prompting.render_prompt`, character for character.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from envs.prompting import ANSWER_FORMATS, COMPACT_INSTRUCTION, MAX_DEFAULT_CHARS, TOOL_INSTRUCTION, tool_prompt_for

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from configs.schema import EnvConfig

# Jinja twins of envs.prompting's compact_tool_line (_params/_type/_resolve/first_sentence) and of
# compact_schema + json.dumps. `tojson` is transformers' (json.dumps, ensure_ascii=False), as in Python.
_MACROS = r"""
{%- macro mcprl_type(s, root, depth, kind=none) -%}
{%- if s is not mapping -%}any
{%- elif 'enum' in s -%}{%- for v in s['enum'] -%}{{ '|' if not loop.first }}{{ v | tojson }}{%- endfor -%}
{%- elif 'const' in s -%}{{ s['const'] | tojson }}
{%- elif '$ref' in s and s['$ref'] is string -%}
{%- set ref = s['$ref'] -%}
{%- set ns = namespace(node=root, ok=ref.startswith('#/')) -%}
{%- if ns.ok -%}{%- for key in ref[2:].split('/') -%}
{%- if ns.ok and ns.node is mapping and key in ns.node -%}{%- set ns.node = ns.node[key] -%}
{%- else -%}{%- set ns.ok = false -%}{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- if not (ns.ok and ns.node is mapping) or depth >= 2 -%}{{ ref.split('/')[-1] or 'object' }}
{%- else -%}{{ mcprl_type(ns.node, root, depth + 1) }}{%- endif -%}
{%- elif 'anyOf' in s and s['anyOf'] is sequence and s['anyOf'] is not string and s['anyOf'] is not mapping -%}
{{- mcprl_union(s['anyOf'], root, depth) -}}
{%- elif 'oneOf' in s and s['oneOf'] is sequence and s['oneOf'] is not string and s['oneOf'] is not mapping -%}
{{- mcprl_union(s['oneOf'], root, depth) -}}
{%- elif 'allOf' in s and s['allOf'] is sequence and s['allOf'] is not string and s['allOf'] is not mapping and s['allOf'] | length == 1 -%}
{{- mcprl_type(s['allOf'][0], root, depth) -}}
{%- else -%}
{%- set k = kind if kind is not none else (s['type'] if 'type' in s else none) -%}
{%- if k is sequence and k is not string and k is not mapping -%}
{%- set parts = namespace(text='') -%}
{%- for one in k -%}{%- set parts.text = parts.text + ('|' if not loop.first else '') + mcprl_type(s, root, depth, one) -%}{%- endfor -%}
{{- parts.text or 'any' -}}
{%- elif k == 'array' or (k is none and 'items' in s) -%}
{%- set item = mcprl_type(s['items'], root, depth) if 'items' in s else 'any' -%}
{{- '(' + item + ')[]' if '|' in item else item + '[]' -}}
{%- elif k == 'object' or (k is none and 'properties' in s) -%}
{%- if 'properties' in s and s['properties'] and depth < 2 -%}{{ '{' + mcprl_params(s, root, depth + 1) + '}' }}{%- else -%}object{%- endif -%}
{%- elif k is not string -%}any
{%- elif 'format' in s and s['format'] is string -%}{{ k + '<' + s['format'] + '>' }}
{%- else -%}{{ k }}{%- endif -%}
{%- endif -%}
{%- endmacro -%}
{%- macro mcprl_union(options, root, depth) -%}
{%- set seen = namespace(items=[]) -%}
{%- for o in options -%}{%- set t = mcprl_type(o, root, depth) -%}
{%- if t not in seen.items -%}{%- set seen.items = seen.items + [t] -%}{%- endif -%}{%- endfor -%}
{{- seen.items | join('|') or 'any' -}}
{%- endmacro -%}
{%- macro mcprl_params(schema, root, depth) -%}
{%- set required = (schema['required'] if 'required' in schema else none) or [] -%}
{%- for name, prop in ((schema['properties'] if 'properties' in schema else none) or {}).items() -%}
{%- set p = prop if prop is mapping else {} -%}
{{- ', ' if not loop.first -}}{{ name }}{{ '' if name in required else '?' }}: {{ mcprl_type(p, root, depth) }}
{%- if 'default' in p and (p['default'] | tojson) | length <= MAX_DEFAULT -%}{{ ' = ' + (p['default'] | tojson) }}{%- endif -%}
{%- endfor -%}
{%- endmacro -%}
{%- macro mcprl_sentence(text) -%}
{%- set ns = namespace(out=[], done=false) -%}
{%- set words = (text or '') | string -%}
{%- set words = words.split() -%}
{%- for w in words -%}{%- if not ns.done -%}
{%- set ns.out = ns.out + [w] -%}
{%- if not loop.last and w[-1:] in '.!?' and w[-4:] not in ['e.g.', 'i.e.'] and w[-4:] != 'etc.' and w[-3:] != 'vs.' -%}
{%- set ns.done = true -%}{%- endif -%}
{%- endif -%}{%- endfor -%}
{{- ns.out | join(' ') -}}
{%- endmacro -%}
{%- macro mcprl_compact_json(v) -%}
{%- if v is mapping -%}{{ '{' }}{%- set ns = namespace(first=true) -%}
{%- for key, value in v.items() -%}{%- if key not in OMITTED -%}
{{- '' if ns.first else ', ' }}{{ key | tojson(ensure_ascii=true) }}: {{ mcprl_compact_json(value) }}{%- set ns.first = false -%}
{%- endif -%}{%- endfor -%}{{ '}' }}
{%- elif v is sequence and v is not string -%}[{%- for x in v -%}{{ ', ' if not loop.first }}{{ mcprl_compact_json(x) }}{%- endfor -%}]
{%- else -%}{{ v | tojson(ensure_ascii=true) }}{%- endif -%}
{%- endmacro -%}
"""

# The JSON form must keep keywords inside `properties` (parameter names), as compact_schema does: a
# parameter literally named like an omitted keyword is rare enough that the test's equality check guards it.


def _jinja_str(text: str) -> str:
    """A Python string as a Jinja string literal."""
    import json

    return json.dumps(text)


def served_chat_template(tokenizer: PreTrainedTokenizerBase, env: EnvConfig) -> str:
    """The chat template to ship with an exported model (see the module doc). Unchanged when the model's
    own template renders `tools`; otherwise ours in front of it, in `env`'s tool_format, final_answer and
    observation_role."""
    from envs.prompting import PROMPT_OMITTED_KEYWORDS

    original = tokenizer.chat_template
    if not isinstance(original, str) or not original:
        raise ValueError("the model's tokenizer has no chat template (a single string) to export")
    if tool_prompt_for(tokenizer) == "template":
        return original
    answer = ANSWER_FORMATS[env.final_answer]
    if env.tool_format == "compact":
        head = COMPACT_INSTRUCTION.replace("{answer_format}", answer)
        line = "{{ f['name'] }}({{ mcprl_params(params, params, 0) }})" + (
            "{%- set d = mcprl_sentence(f['description']) -%}{%- if d %} — {{ d }}{%- endif -%}"
        )
    else:
        head = TOOL_INSTRUCTION.replace("{answer_format}", answer)
        line = (
            "{{ '{\"name\": ' + (f['name'] | tojson(ensure_ascii=true)) + ', \"description\": ' + ((f['description'] or '') | tojson(ensure_ascii=true))"
            " + ', \"parameters\": ' + mcprl_compact_json(params) + '}' }}"
        )
    preamble = (
        f"{{%- set MAX_DEFAULT = {MAX_DEFAULT_CHARS} -%}}"
        f"{{%- set OMITTED = {_jinja_str_list(sorted(PROMPT_OMITTED_KEYWORDS))} -%}}" + _MACROS
    )
    body = (
        "{%- set mcprl = namespace(messages=[], block='') -%}"
        "{%- if tools -%}{%- set lines = namespace(text=" + _jinja_str(head) + ") -%}"
        "{%- for t in tools -%}{%- set f = t['function'] if t['function'] is defined else t -%}"
        "{%- set params = f['parameters'] or {'type': 'object', 'properties': {}} -%}"
        "{%- set one -%}" + line + "{%- endset -%}"
        "{%- set lines.text = lines.text + '\\n' + one -%}{%- endfor -%}"
        "{%- set mcprl.block = lines.text -%}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set mcprl.messages = [{'role': 'system', 'content': (messages[0]['content'] or '') + '\\n\\n' + mcprl.block}] -%}"
        "{%- set rest = messages[1:] -%}"
        "{%- else -%}{%- set mcprl.messages = [{'role': 'system', 'content': mcprl.block}] -%}"
        "{%- set rest = messages -%}{%- endif -%}"
        "{%- else -%}{%- set rest = messages -%}{%- endif -%}"
        "{%- for m in rest -%}"
        "{%- if m['role'] == 'assistant' and m['tool_calls'] -%}"
        "{%- set calls = namespace(text=m['content'] or '') -%}"
        "{%- for c in m['tool_calls'] -%}{%- set fn = c['function'] if c['function'] is defined else c -%}"
        "{%- set args = fn['arguments'] if fn['arguments'] is mapping else {} -%}"
        "{%- set calls.text = calls.text + ('\\n' if calls.text else '') + '<tool_call>' + "
        "({'name': fn['name'], 'arguments': args} | tojson) + '</tool_call>' -%}{%- endfor -%}"
        "{%- set mcprl.messages = mcprl.messages + [{'role': 'assistant', 'content': calls.text}] -%}"
        "{%- elif m['role'] == 'tool' -%}"
        "{%- set mcprl.messages = mcprl.messages + [{'role': " + _jinja_str(env.observation_role) + ", "
        "'content': m['content'] or ''}] -%}"
        "{%- else -%}{%- set mcprl.messages = mcprl.messages + [{'role': m['role'], 'content': m['content'] or ''}] -%}"
        "{%- endif -%}{%- endfor -%}"
        "{%- set messages = mcprl.messages -%}"
    )
    return preamble + body + original


def _jinja_str_list(items: list[str]) -> str:
    return "[" + ", ".join(_jinja_str(i) for i in items) + "]"
