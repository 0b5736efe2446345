"""The `dependent` converter: multi-turn conversations (OpenAI chat format) → compact task rows.

A conversation in which an assistant called tools one after another (each call depending on what
the earlier ones returned) becomes one task: its first user message is the prompt, its calls the
expected `tool_sequence`.

Input: a JSONL file (one spec per line) or a JSON file (a list of specs, or one spec). A spec is an
object with `messages` (or just the list of messages):

    {"id": "nvda-pe",                         # optional: the task id (default: a hash of the content)
     "messages": [
       {"role": "system", "content": "..."},  # optional, first
       {"role": "user", "content": "What is NVDA's P/E at the last close?"},
       {"role": "assistant", "content": null, "tool_calls": [
          {"id": "call_1", "type": "function",
           "function": {"name": "polygon.previous_close", "arguments": "{\\"ticker\\": \\"NVDA\\"}"}}]},
       {"role": "tool", "tool_call_id": "call_1", "content": "{\\"results\\": [{\\"c\\": 186.52}]}"},
       ...,
       {"role": "assistant", "content": "NVDA trades at about 48x earnings."}],   # optional final answer
     "final_answer": {"value": 48.1, "tolerance": 0.1, "description": "..."},   # optional, verifiable
     "max_turns": 8,                           # optional (default: --max-turns, raised to the call count)
     "metadata": {...}}                        # optional, copied into extra_info

- A tool name is `server.tool` or `server__tool` (the form function-calling APIs accept).
- `arguments` is a JSON string holding an object (an object itself is accepted too).
- Every `tool` message answers an earlier call by its `tool_call_id`.
- The number of calls sets the complexity: 1 simple, 2-3 medium, 4-12 hard.
- User messages after the first cannot be part of a one-prompt task: they are kept in
  `extra_info.later_user_messages`; the last assistant message without calls in
  `extra_info.final_assistant`.

Errors name the spec and the message, 0-based, as `spec[2].messages[4]: ...`; every error in the
file is reported at once. `tasks/examples/conversations.jsonl` has four specs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from configs.schema import Config
from tasks.generators.options import GenerateOptions, GenerationError
from tasks.schema import COMPLEXITY_CALLS, TaskRow

DATA_SOURCE = "mcprl/dependent"
MAX_ERRORS_SHOWN = 20


class SpecError(Exception):
    """One problem in one spec, located by `where` (e.g. spec[2].messages[4])."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")


def load_specs(path: str | Path) -> list[Any]:
    """The specs of a .jsonl or .json file, in order."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".json"):
        raise GenerationError(f"conversation file {path} must be .jsonl or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GenerationError(f"conversation file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"cannot read conversation file {path}: {e}") from None
    if path.suffix == ".jsonl":
        specs: list[Any] = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                specs.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise GenerationError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise GenerationError(f"{path}: not valid JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
        specs = data if isinstance(data, list) and not _is_message_list(data) else [data]
    if not specs:
        raise GenerationError(f"conversation file {path} holds no conversations")
    return specs


def _is_message_list(data: list[Any]) -> bool:
    return bool(data) and isinstance(data[0], dict) and "role" in data[0]


def split_tool_name(name: Any) -> tuple[str, str] | None:
    """`server.tool` or `server__tool` → (server, tool); None when it is neither."""
    if not isinstance(name, str):
        return None
    for sep in (".", "__"):
        server, found, tool = name.partition(sep)
        if found and server and tool and not server.startswith("_"):
            return server, tool
    return None


def convert_spec(spec: Any, index: int, *, max_turns: int = 8, max_tools: int = 4) -> dict[str, Any]:
    """One spec → one validated TaskRow dict; raises SpecError naming the spec and message."""
    where = f"spec[{index}]"
    messages = spec.get("messages") if isinstance(spec, dict) else spec
    if not isinstance(messages, list) or not messages:
        raise SpecError(where, "expected an object with a non-empty `messages` list (or the list itself)")

    system: str | None = None
    user: str | None = None
    later_users: list[str] = []
    steps: list[dict[str, Any]] = []
    open_calls: dict[str, int] = {}  # call id → step, until its tool message arrives
    final_assistant: str | None = None

    for j, msg in enumerate(messages):
        at = f"{where}.messages[{j}]"
        if not isinstance(msg, dict):
            raise SpecError(at, f"a message must be an object, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if role == "system":
            if j != 0:
                raise SpecError(at, "a system message must come first")
            system = _text(content, at)
        elif role == "user":
            text = _text(content, at)
            if user is None:
                user = text
            else:
                later_users.append(text)
        elif role == "assistant":
            if user is None:
                raise SpecError(at, "an assistant message before the first user message")
            calls = msg.get("tool_calls") or []
            if not isinstance(calls, list):
                raise SpecError(at, "`tool_calls` must be a list")
            for k, call in enumerate(calls):
                step = _step(call, len(steps) + 1, f"{at}.tool_calls[{k}]")
                call_id = call.get("id")
                if isinstance(call_id, str) and call_id:
                    if call_id in open_calls or any(s.get("_id") == call_id for s in steps):
                        raise SpecError(f"{at}.tool_calls[{k}]", f"tool call id {call_id!r} is used twice")
                    open_calls[call_id] = step["step"]
                    step["_id"] = call_id
                steps.append(step)
            final_assistant = None if calls else (content if isinstance(content, str) and content.strip() else None)
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if call_id not in open_calls:
                known = ", ".join(repr(c) for c in open_calls) or "none open"
                raise SpecError(at, f"tool message answers unknown tool_call_id {call_id!r} (open calls: {known})")
            del open_calls[call_id]
            if not isinstance(content, (str, list)):
                raise SpecError(at, "a tool message needs `content` (the tool's result as text)")
        else:
            raise SpecError(at, f"unknown role {role!r}; expected system, user, assistant or tool")

    if user is None:
        raise SpecError(where, "no user message: the first user message becomes the task's prompt")
    if not steps:
        raise SpecError(where, "no tool calls: a task needs at least one assistant tool call")
    hi = COMPLEXITY_CALLS["hard"][1]
    if len(steps) > hi:
        raise SpecError(where, f"{len(steps)} tool calls; a task has at most {hi}")
    for s in steps:
        s.pop("_id", None)

    complexity = next(k for k, (lo, up) in COMPLEXITY_CALLS.items() if lo <= len(steps) <= up)
    servers = {s["server"] for s in steps}
    tools = {(s["server"], s["tool"]) for s in steps}
    extra: dict[str, Any] = {"method": "dependent", "spec_index": index, "n_messages": len(messages)}
    if isinstance(spec, dict):
        metadata = spec.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise SpecError(where, "`metadata` must be an object")
        extra = {**(metadata or {}), **extra}
    if final_assistant:
        extra["final_assistant"] = final_assistant
    if later_users:
        extra["later_user_messages"] = later_users
    if open_calls:
        extra["unanswered_calls"] = sorted(open_calls.values())

    spec_obj = spec if isinstance(spec, dict) else {}
    task_id = spec_obj.get("id")
    if task_id is None:
        digest = hashlib.sha256(json.dumps([user, steps], sort_keys=True).encode()).hexdigest()[:12]
        task_id = f"dep-{digest}"
    turns = spec_obj.get("max_turns", max(max_turns, len(steps)))
    ground_truth: dict[str, Any] = {
        "task_id": str(task_id),
        "complexity": complexity,
        "max_turns": turns,
        "success": {"must_call_tool": f"{steps[0]['server']}.{steps[0]['tool']}"},
        "tool_sequence": steps,
        "limits": {"max_servers": len(servers), "max_tools": max(max_tools, len(tools))},
    }
    if spec_obj.get("final_answer") is not None:
        ground_truth["final_answer"] = spec_obj["final_answer"]
    prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    try:
        row = TaskRow.model_validate(
            {
                "data_source": DATA_SOURCE,
                "prompt": prompt,
                "reward_spec": {"method": "rule", "ground_truth": ground_truth},
                "extra_info": extra,
            }
        )
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise SpecError(where, f"does not make a valid task: {problems}") from None
    return row.model_dump(mode="json")


def _text(content: Any, at: str) -> str:
    """Message text: a string, or OpenAI's list of {type: text, text} parts."""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if not isinstance(content, str) or not content.strip():
        raise SpecError(at, "`content` must be non-empty text")
    return content


def _step(call: Any, number: int, at: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise SpecError(at, "a tool call must be an object {id, type: function, function: {name, arguments}}")
    if call.get("type", "function") != "function":
        raise SpecError(at, f"tool call type {call.get('type')!r} is not supported; expected 'function'")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise SpecError(at, "missing `function` {name, arguments}")
    parts = split_tool_name(fn.get("name"))
    if parts is None:
        raise SpecError(at, f"tool name {fn.get('name')!r} must be 'server.tool' or 'server__tool'")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            problem = f"`function.arguments` is not valid JSON ({e.msg}, column {e.colno}): {args[:80]!r}"
            raise SpecError(at, problem) from None
    if not isinstance(args, dict):
        raise SpecError(at, f"`function.arguments` must be a JSON object, got {type(args).__name__}")
    return {"step": number, "server": parts[0], "tool": parts[1], "params": args}


def convert_specs(specs: list[Any], *, max_turns: int = 8, max_tools: int = 4, source: str = "") -> list[dict]:
    """Every spec → a row; all problems are collected and raised together as one GenerationError."""
    rows, errors = [], []
    for i, spec in enumerate(specs):
        try:
            rows.append(convert_spec(spec, i, max_turns=max_turns, max_tools=max_tools))
        except SpecError as e:
            errors.append(str(e))
    if errors:
        shown = errors[:MAX_ERRORS_SHOWN]
        more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        head = f"{source}: " if source else ""
        raise GenerationError(f"{head}{len(errors)} bad conversation spec(s):\n  " + "\n  ".join(shown) + more)
    return rows


async def generate(cfg: Config, opts: GenerateOptions, pool: Any) -> list[dict[str, Any]]:
    """Convert every spec of `opts.input_path` (the tool pool is not needed: admission checks the calls)."""
    if opts.input_path is None:
        raise GenerationError("method dependent needs an input file: --in conversations.jsonl")
    specs = load_specs(opts.input_path)
    rows = convert_specs(specs, max_turns=opts.max_turns, max_tools=opts.max_tools, source=str(opts.input_path))
    opts.report(len(rows), len(rows))
    return rows
