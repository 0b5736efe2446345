"""A model turn as tool calls and/or a final answer.

Formats read (several calls per turn, in the order they appear):

- Hermes: `<tool_call>{"name": "server.tool", "arguments": {...}}</tool_call>`. The last block may
  lack its closing tag (a stop string often eats it). Inside, `tool` may stand for `name`,
  `parameters` for `arguments`, the arguments may be a JSON string, and the OpenAI shape
  `{"function": {"name": ..., "arguments": ...}}` is read too.
- XML-ish: `<tool><server.tool>{...args...}</server.tool></tool>` (empty args = `{}`).
- Plain JSON, only when no tagged call is present: the whole turn (optionally in a ``` fence), or
  JSON objects inside the text, shaped `{"tool": ..., "arguments": {...}}` or `{"name": ...}`; a JSON
  list of such objects is several calls.
- Final answer: `<answer>...</answer>` (closing tag optional). With `final_answer="no_call"`, a turn
  with no call and no failed call attempt is the answer as a whole.

Names: `server.tool`, `server__tool`, or a bare `tool` when exactly one server has it (when an
inventory is given; without one, only `server.tool`/`server__tool` are accepted, unchecked).
Argument aliases (`EnvConfig.argument_aliases`, alias → real name) are applied only when the tool's
schema has the real name, lacks the alias, and the call does not already give the real name.

`parse_turn` never raises and does bounded work: a turn longer than `MAX_TURN_CHARS` is refused
whole (one error), tag scanning is linear (`str.find`, no backtracking regex over the turn), and
at most `MAX_JSON_PROBES` positions are tried as plain JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_TURN_CHARS = 200_000  # ~50k tokens: far beyond any sane turn; longer ones are refused unread
MAX_CALLS_SEEN = 64  # calls past this are not even parsed (counted as dropped)
MAX_JSON_PROBES = 32  # '{' positions tried as plain-JSON calls
SNIPPET_CHARS = 160  # how much of a bad call an error message quotes

ParseErrorKind = Literal["empty", "too_long", "malformed", "unknown_tool", "no_action", "too_many_calls"]


@dataclass
class ToolCall:
    server: str
    tool: str
    arguments: dict[str, Any]
    aliased: dict[str, str] = field(default_factory=dict)  # alias -> real argument name, as applied

    @property
    def name(self) -> str:
        return f"{self.server}.{self.tool}"


@dataclass
class ParseError:
    kind: ParseErrorKind
    message: str  # readable, shown to the model


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None
    errors: list[ParseError] = field(default_factory=list)
    dropped_calls: int = 0  # calls beyond max_calls (refused)


class ToolIndex:
    """The pool's tools as the parser needs them: qualified names, bare names, schema properties.

    Built once per inventory ({server: {tool: inputSchema}}, see tasks.inventory) and reused.
    """

    def __init__(self, inventory: Mapping[str, Mapping[str, Any]]) -> None:
        self.properties: dict[tuple[str, str], frozenset[str]] = {}
        bare: dict[str, list[tuple[str, str]]] = {}
        for server, tools in inventory.items():
            for tool, schema in tools.items():
                props = (schema or {}).get("properties") or {} if isinstance(schema, Mapping) else {}
                self.properties[(server, tool)] = frozenset(props)
                bare.setdefault(tool, []).append((server, tool))
        self.bare = bare
        self.names = sorted(f"{s}.{t}" for s, t in self.properties)

    def resolve(self, name: str) -> tuple[str, str] | str:
        """(server, tool), or a readable reason the name does not resolve."""
        candidates: list[tuple[str, str]] = []
        if "." in name:
            candidates.append(tuple(name.split(".", 1)))  # type: ignore[arg-type]
        if "__" in name:
            candidates.append(tuple(name.split("__", 1)))  # type: ignore[arg-type]
        for c in candidates:
            if c in self.properties:
                return c
        hits = self.bare.get(name, [])
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            options = ", ".join(f"{s}.{t}" for s, t in hits)
            return f"tool name {_quote(name)} is ambiguous; use one of: {options}"
        shown = ", ".join(self.names[:24]) + (", ..." if len(self.names) > 24 else "")
        return f"unknown tool {_quote(name)}; available tools: {shown}"


def parse_turn(
    text: Any,
    index: ToolIndex | None = None,
    *,
    aliases: Mapping[str, str] | None = None,
    final_answer: Literal["tag", "no_call"] = "tag",
    max_calls: int = MAX_CALLS_SEEN,
) -> ParsedTurn:
    """Calls, final answer and errors of one model turn. Never raises."""
    try:
        return _parse(text, index, aliases or {}, final_answer, max_calls)
    except Exception as e:  # a parser bug must cost one penalised turn, not the episode
        return ParsedTurn(errors=[ParseError("malformed", f"could not read the turn ({type(e).__name__})")])


def sanitize(text: str) -> str:
    """`text` without lone surrogates (they cannot be encoded, so tokenizers and JSON choke on them)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


# --------------------------------------------------------------------------- internals

_FENCE = re.compile(r"^```[a-zA-Z]*\s*(.*?)\s*```$", re.DOTALL)
_XML_INNER = re.compile(r"<([^<>\s/]{1,200})>(.*)</\1>", re.DOTALL)


def _parse(
    text: Any, index: ToolIndex | None, aliases: Mapping[str, str], final_answer: str, max_calls: int
) -> ParsedTurn:
    turn = ParsedTurn()
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8", "replace")
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    if len(text) > MAX_TURN_CHARS:
        turn.errors.append(
            ParseError(
                "too_long", f"your reply is {len(text):,} characters, over the {MAX_TURN_CHARS:,} limit; ignored"
            )
        )
        return turn
    text = sanitize(text)
    if not text.strip():
        turn.errors.append(ParseError("empty", "your reply was empty"))
        return turn

    raw: list[tuple[int, Any]] = []  # (position, decoded payload or an error message)
    raw += _tagged(text, "<tool_call>", "</tool_call>", _decode_hermes)
    raw += _tagged(text, "<tool>", "</tool>", _decode_xml)
    raw.sort(key=lambda item: item[0])
    if not raw:
        raw = [(0, payload) for payload in _plain_json(text)]

    answer = _answer(text)
    for _, payload in raw:
        if isinstance(payload, ParseError):
            turn.errors.append(payload)
            continue
        if len(turn.calls) >= max_calls:
            turn.dropped_calls += 1
            continue
        call = _make_call(payload, index, aliases)
        if isinstance(call, ParseError):
            turn.errors.append(call)
        else:
            turn.calls.append(call)
    if turn.dropped_calls:
        turn.errors.append(
            ParseError(
                "too_many_calls", f"{turn.dropped_calls} call(s) past the limit of {max_calls} per turn were refused"
            )
        )

    if answer is not None:
        turn.answer = answer
    elif final_answer == "no_call" and not turn.calls and not turn.errors:
        turn.answer = text.strip()
    if not turn.calls and turn.answer is None and not turn.errors:
        hint = "tool call" + (" and no final answer in <answer>...</answer>" if final_answer == "tag" else "")
        turn.errors.append(ParseError("no_action", f"your reply had no {hint}"))
    return turn


def _tagged(text: str, open_tag: str, close_tag: str, decode: Any) -> list[tuple[int, Any]]:
    """Decoded contents of every open..close block; linear in the text (find, never backtrack)."""
    found = []
    pos = 0
    while len(found) <= MAX_CALLS_SEEN:
        start = text.find(open_tag, pos)
        if start < 0:
            break
        body_start = start + len(open_tag)
        end = text.find(close_tag, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        nested = body.rfind(open_tag)  # <a><a>x</a>: the innermost opening wins
        if nested >= 0:
            body = body[nested + len(open_tag) :]
        found.append((start, decode(body.strip())))
        if end < 0:
            break
        pos = end + len(close_tag)
    return found


def _decode_hermes(body: str) -> Any:
    if not body:
        return ParseError("malformed", "empty <tool_call></tool_call>")
    m = _FENCE.match(body)
    value = _loads(m.group(1) if m else body)
    if isinstance(value, ParseError):
        return value
    if not isinstance(value, dict):
        return ParseError("malformed", f"a tool call must be a JSON object, got: {_snip(body)}")
    return value


def _decode_xml(body: str) -> Any:
    m = _XML_INNER.fullmatch(body)
    if not m:
        return ParseError(
            "malformed", f"expected <tool><server.tool>{{arguments}}</server.tool></tool>, got: {_snip(body)}"
        )
    inner = m.group(2).strip()
    args = {} if not inner else _loads(inner)
    if isinstance(args, ParseError):
        return args
    return {"name": m.group(1), "arguments": args}


def _plain_json(text: str) -> list[Any]:
    """Calls written as bare JSON: the whole turn first, then objects found inside the text."""
    stripped = text.strip()
    m = _FENCE.match(stripped)
    whole = _loads(m.group(1) if m else stripped, quiet=True)
    if isinstance(whole, dict) and _looks_like_call(whole):
        return [whole]
    if isinstance(whole, list) and whole and all(isinstance(v, dict) and _looks_like_call(v) for v in whole):
        return whole
    decoder = json.JSONDecoder()
    found: list[Any] = []
    pos, probes = 0, 0
    while probes < MAX_JSON_PROBES and len(found) <= MAX_CALLS_SEEN:
        start = text.find("{", pos)
        if start < 0:
            break
        probes += 1
        try:
            value, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            pos = start + 1
            continue
        if isinstance(value, dict) and _looks_like_call(value):
            found.append(value)
        pos = end
    return found


def _looks_like_call(obj: dict[str, Any]) -> bool:
    fn = obj.get("function")
    if isinstance(fn, dict):
        return isinstance(fn.get("name"), str)
    return isinstance(obj.get("name"), str) or isinstance(obj.get("tool"), str)


def _answer(text: str) -> str | None:
    start = text.find("<answer>")
    if start < 0:
        return None
    body_start = start + len("<answer>")
    end = text.find("</answer>", body_start)
    return (text[body_start:] if end < 0 else text[body_start:end]).strip()


def _make_call(obj: dict[str, Any], index: ToolIndex | None, aliases: Mapping[str, str]) -> ToolCall | ParseError:
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name", obj.get("tool"))
    if not isinstance(name, str) or not name.strip():
        return ParseError("malformed", f'a tool call needs a "name" (server.tool): {_snip(_dump(obj))}')
    name = name.strip()
    args = obj.get("arguments", obj.get("parameters", obj.get("args", {})))
    if args is None:
        args = {}
    if isinstance(args, str):
        args = {} if not args.strip() else _loads(args)
        if isinstance(args, ParseError):
            return ParseError("malformed", f"arguments of {_quote(name)} are not valid JSON: {args.message}")
    if not isinstance(args, dict):
        return ParseError("malformed", f"arguments of {_quote(name)} must be a JSON object, got {type(args).__name__}")

    if index is None:
        server, sep, tool = name.partition(".")
        if not sep:
            server, sep, tool = name.partition("__")
        if not (sep and server and tool):
            return ParseError("unknown_tool", f"tool name {_quote(name)} must be server.tool")
        return ToolCall(server, tool, args)
    resolved = index.resolve(name)
    if isinstance(resolved, str):
        return ParseError("unknown_tool", resolved)
    server, tool = resolved
    props = index.properties[resolved]
    applied: dict[str, str] = {}
    if aliases and props:
        args = dict(args)
        for alias, real in aliases.items():
            if alias in args and real in props and alias not in props and real not in args:
                args[real] = args.pop(alias)
                applied[alias] = real
    return ToolCall(server, tool, args, applied)


def _loads(s: str, quiet: bool = False) -> Any:
    try:
        return json.loads(s)
    except (ValueError, RecursionError) as e:
        if quiet:
            return None
        reason = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
        return ParseError("malformed", f"invalid JSON ({reason}): {_snip(s)}")


def _dump(obj: Any) -> str:
    try:
        return json.dumps(obj, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return repr(obj)


def _snip(s: str) -> str:
    s = " ".join(s.split()) if len(s) < 4 * SNIPPET_CHARS else " ".join(s[: 4 * SNIPPET_CHARS].split())
    return s if len(s) <= SNIPPET_CHARS else s[:SNIPPET_CHARS] + "..."


def _quote(name: str) -> str:
    return repr(name[:80] + ("..." if len(name) > 80 else ""))


CallFormat = Callable[[str, dict[str, Any]], str]  # (name "server.tool", arguments) -> the call as text


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A call written the way the prompt asks for it (Hermes), which `parse_turn` reads back."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def expert_turns(row: Mapping[str, Any], call_format: CallFormat = format_tool_call) -> list[str]:
    """The turns a perfect agent plays for a task row: each expected call, then the final answer.

    `call_format(name, arguments)` writes a call: ours (Hermes) by default, or the chat template's own
    syntax (`envs.prompting.template_tool_call`) when the template shows the tools.
    """
    gt = row["reward_spec"]["ground_truth"]
    calls = [call_format(f"{s['server']}.{s['tool']}", s["params"]) for s in gt["tool_sequence"]]
    return [*calls, f"<answer>{(gt.get('final_answer') or {}).get('value', '')}</answer>"]
