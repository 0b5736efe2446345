"""The gate: is a set of task rows a usable dataset? A library; `jobs/validate_tasks.py` is its CLI.

A row is checked in three layers, each issue naming the row (1-based), the task_id when there is
one, the field path (`reward_spec.ground_truth.tool_sequence[2].params.ticker`) and what is wrong:

1. the JSON Schema generated from `TaskRow` (`tasks.schema.task_row_json_schema`, the same as
   `tasks/task_row.schema.json`): fields, JSON types, enums, bounds. It comes first because its
   errors carry exact paths and say per keyword what is wrong ("expected integer, got string");
2. `TaskRow` itself (strict, like the schema), which adds the cross-field rules JSON Schema cannot
   state (steps in order, must_call_tool = first step, limits, turns); only for rows that pass 1.
   A row that passes is a `TaskRow` from here on;
3. the inventory, for TaskRows: every step names a server and tool of the pool, and its params
   validate against that tool's input schema.

Over all rows: duplicate task_ids (errors), near-duplicate user prompts (warnings; see
`tasks/similarity.py`), steps that write to a live service (warnings: a live backend cannot give
each episode its own state), prompt token lengths when a counter is given (over the limit: a
warning), and stats. With `strict`, every warning is an error. Nothing here raises for bad data.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator, ValidationError, validators
from jsonschema.exceptions import best_match
from pydantic import ValidationError as PydanticValidationError

from tasks.inventory import Inventory
from tasks.schema import SCHEMA_PATH, TaskRow, task_row_json_schema
from tasks.similarity import near_duplicates

__all__ = ["SCHEMA_PATH"]  # re-exported: where the generated schema file lives
GT = "reward_spec.ground_truth"

# Issue kinds: what admission counts rejections by.
SCHEMA = "schema"  # the JSON Schema
RULE = "rule"  # a cross-field rule of TaskRow
UNKNOWN_SERVER = "unknown_server"
UNKNOWN_TOOL = "unknown_tool"
PARAMS = "params"  # a step's params against its tool's input schema
DUPLICATE_ID = "duplicate_task_id"
NEAR_DUPLICATE = "near_duplicate"
TOO_LONG = "too_long"
TOKENS = "tokens"  # the token counter failed on a row
LIVE_WRITE = "live_write"  # a step writes to a service on a live backend

# TaskRow's cross-field messages, pointed at the field they are about (otherwise: the model's path).
_RULE_FIELDS = (
    ("tool_sequence steps", "tool_sequence"),
    ("success.must_call_tool", "success.must_call_tool"),
    ("tool_sequence uses more servers", "limits.max_servers"),
    ("tool_sequence uses more distinct tools", "limits.max_tools"),
    ("max_turns is smaller", "max_turns"),
)


@dataclass(frozen=True)
class RowIssue:
    row: int  # 1-based position in the file
    task_id: str | None
    path: str  # "" = the row itself
    message: str
    kind: str = SCHEMA

    def __str__(self) -> str:
        who = f"row {self.row}" + (f" ({self.task_id})" if self.task_id else "")
        return f"{who}: {self.path or '(row)'}: {self.message}"


@dataclass
class Stats:
    """Over the rows that pass the schema and TaskRow's rules (`valid_rows` of `rows`)."""

    rows: int = 0
    valid_rows: int = 0
    by_complexity: dict[str, int] = field(default_factory=dict)
    by_method: dict[str, int] = field(default_factory=dict)  # reward_spec.method
    prompt_chars_mean: float = 0.0  # all prompt messages' content
    prompt_chars_max: int = 0
    prompt_tokens_mean: float | None = None  # when tokens were counted
    prompt_tokens_max: int | None = None
    tool_calls: dict[str, int] = field(default_factory=dict)  # "server.tool" -> calls in tool_sequences
    unused_tools: list[str] = field(default_factory=list)  # inventory tools no task calls
    max_turns_mean: float = 0.0
    max_turns_max: int = 0
    tool_calls_mean: float = 0.0  # per task


@dataclass
class ValidationReport:
    rows: int
    errors: list[RowIssue] = field(default_factory=list)
    warnings: list[RowIssue] = field(default_factory=list)
    duplicate_task_ids: dict[str, list[int]] = field(default_factory=dict)  # task_id -> rows holding it
    near_duplicates: list[tuple[int, int, float]] = field(default_factory=list)  # (row, later row, similarity)
    token_counts: dict[int, int] = field(default_factory=dict)  # row -> prompt tokens
    stats: Stats = field(default_factory=Stats)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def error_rows(self) -> list[int]:
        return sorted({e.row for e in self.errors})

    def issues_for(self, row: int) -> list[RowIssue]:
        return [i for i in self.errors + self.warnings if i.row == row]


# --------------------------------------------------------------------------- one row


@functools.cache
def row_schema() -> dict[str, Any]:
    """The task row's JSON Schema, generated from TaskRow (tasks/task_row.schema.json holds the same)."""
    return task_row_json_schema()


@functools.cache
def _row_validator() -> Draft202012Validator:
    return Draft202012Validator(row_schema())


def check_row(row: Any, index: int, inventory: Inventory) -> list[RowIssue]:
    """Every problem of one row: schema, TaskRow's rules, inventory and params. `index`: 0-based position."""
    return inspect_row(row, index, inventory)[0]


def inspect_row(row: Any, index: int, inventory: Inventory) -> tuple[list[RowIssue], TaskRow | None]:
    """The row's issues, and the row as a TaskRow when it passes the schema and TaskRow's rules."""
    number, task_id = index + 1, task_id_of(row)
    if not isinstance(row, dict):
        return [RowIssue(number, None, "", f"expected a JSON object, got {_json_type(row)}")], None
    # One issue per field: a bad role fails both the role's enum and the prompt's shape; the field's own
    # keyword says it better than a cross-field rule (if/then/else, allOf), so those come last.
    errors = sorted(_row_validator().iter_errors(row), key=_from_cross_field_rule)
    described = [pair for error in errors for pair in _describe(error)]
    first: dict[str, str] = {}
    for path, message in described:
        first.setdefault(path, message)
    issues = [RowIssue(number, task_id, path, message) for path, message in first.items()]
    if issues:  # TaskRow's own errors would repeat the schema's
        return _unique(issues), None
    try:
        task = TaskRow.model_validate(row)
    except PydanticValidationError as e:
        return _unique([RowIssue(number, task_id, *_rule_issue(err), RULE) for err in e.errors()]), None
    return _unique(_inventory_issues(task, number, inventory)), task


def _from_cross_field_rule(error: ValidationError) -> bool:
    return any(part in ("then", "else", "allOf") for part in error.schema_path)


def task_id_of(row: Any) -> str | None:
    """The row's task_id when it has a string one."""
    try:
        task_id = row["reward_spec"]["ground_truth"]["task_id"]
    except (TypeError, KeyError, IndexError):
        return None
    return task_id if isinstance(task_id, str) and task_id else None


def _inventory_issues(task: TaskRow, number: int, inventory: Inventory) -> list[RowIssue]:
    issues = []
    task_id = task.task_id
    for i, step in enumerate(task.ground_truth.tool_sequence):
        at = f"{GT}.tool_sequence[{i}]"
        server, tool, params = step.server, step.tool, step.params
        if server not in inventory:
            known = ", ".join(sorted(inventory)) or "none"
            message = f"unknown server {server!r} (the pool has: {known})"
            issues.append(RowIssue(number, task_id, f"{at}.server", message, UNKNOWN_SERVER))
            continue
        tools = inventory[server]
        if tool not in tools:
            known = ", ".join(sorted(tools)) or "none"
            message = f"{server} has no tool {tool!r} (its tools: {known})"
            issues.append(RowIssue(number, task_id, f"{at}.tool", message, UNKNOWN_TOOL))
            continue
        try:
            errors = list(_params_validator(json.dumps(tools[tool], sort_keys=True)).iter_errors(params))
        except Exception as e:  # a broken input schema is the server's fault: reported, not raised
            message = f"cannot check against {server}.{tool}'s input schema: {e}"
            issues.append(RowIssue(number, task_id, f"{at}.params", message, PARAMS))
            continue
        for error in errors:
            for path, message in _describe(error, prefix=f"{at}.params"):
                issues.append(RowIssue(number, task_id, path, message, PARAMS))
    return issues


@functools.lru_cache(maxsize=1024)
def _params_validator(schema_json: str) -> Any:
    schema = json.loads(schema_json)
    return validators.validator_for(schema, default=Draft202012Validator)(schema)


def _unique(issues: list[RowIssue]) -> list[RowIssue]:
    return list(dict.fromkeys(issues))


# --------------------------------------------------------------------------- messages


def format_path(parts: Iterable[Any], prefix: str = "") -> str:
    """("a", "b", 2, "c") -> "a.b[2].c"."""
    out = prefix
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _describe(error: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    """(path, message) pairs for one jsonschema error, worded for people; most give one pair."""
    if error.validator in ("anyOf", "oneOf") and error.context:
        error = best_match([error])  # the branch that came closest says more than "not valid under any"
    path = format_path(error.absolute_path, prefix)
    instance, value, kind = error.instance, error.validator_value, error.validator
    if kind == "required":
        match = re.match(r"^'(.+)' is a required property$", error.message)
        return [(_join(path, match.group(1)) if match else path, "missing (required)")]
    if kind == "additionalProperties" and isinstance(instance, dict):
        allowed = list(error.schema.get("properties", {}))
        extra = [k for k in instance if k not in allowed]
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return [(_join(path, k), f"unknown field{hint}") for k in extra] or [(path, error.message)]
    if kind == "type":
        types = value if isinstance(value, list) else [value]
        return [(path, f"expected {' or '.join(types)}, got {_json_type(instance)} {_short(instance)}")]
    if kind == "enum":
        return [(path, f"{_short(instance)} is not one of {', '.join(map(repr, value))}")]
    if kind == "const":
        hint = " (a prompt is [user] or [system, user])" if "prefixItems" in error.schema_path else ""
        return [(path, f"must be {value!r}, got {_short(instance)}{hint}")]
    if kind == "minLength" and value == 1:
        return [(path, "must not be empty")]
    if kind in ("minItems", "maxItems") and isinstance(instance, list):
        bound = "at least" if kind == "minItems" else "at most"
        rule = _rule_description(error)
        return [(path, f"has {len(instance)} items; {bound} {value}" + (f" ({rule})" if rule else ""))]
    if kind == "pattern":
        return [(path, f"{_short(instance)} does not match {value}")]
    return [(path, _clip(error.message))]


def _rule_description(error: ValidationError) -> str:
    """The description of the allOf rule (in the row schema) that an error comes from, if any."""
    node: Any = row_schema()
    found = ""
    try:
        for part in error.schema_path:
            while isinstance(node, dict) and part not in node and "$ref" in node:  # the path runs through refs
                node = _resolve(node["$ref"])
            node = node[part]
            if isinstance(node, dict) and "if" in node and "description" in node:
                found = node["description"].rstrip(".")
    except (KeyError, IndexError, TypeError):
        return ""
    return found


def _resolve(ref: str) -> Any:
    node: Any = row_schema()
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def _rule_issue(err: Any) -> tuple[str, str]:
    """(path, message) of a TaskRow validation error."""
    message = str(err.get("msg", "")).removeprefix("Value error, ")
    path = format_path(err.get("loc", ()))
    if path == GT:
        for start, sub in _RULE_FIELDS:
            if message.startswith(start):
                return f"{GT}.{sub}", message
    return path, message


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    names = {dict: "object", list: "array", str: "string", type(None): "null", int: "integer", float: "number"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return _clip(text, limit)


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- many rows


def validate_rows(
    rows: list[Any],
    inventory: Inventory,
    count_tokens: Callable[[TaskRow], int] | None = None,
    max_tokens: int | None = None,
    strict: bool = False,
    near_duplicate_threshold: float = 0.9,
    live_writes: Collection[str] = (),
) -> ValidationReport:
    """Check every row and the set as a whole; see the module docstring. Never raises for bad data.

    live_writes: the `server.tool` names that write to a live service (`tasks.inventory.live_writing_tools`);
    a task whose plan calls one gets a warning.
    """
    report = ValidationReport(rows=len(rows))
    parsed: dict[int, TaskRow] = {}  # row number -> TaskRow
    for index, row in enumerate(rows):
        issues, task = inspect_row(row, index, inventory)
        report.errors += issues
        if task is not None:
            parsed[index + 1] = task

    for issue in duplicate_id_issues(rows, report.duplicate_task_ids):
        report.errors.append(issue)

    numbers = list(parsed)
    for a, b, score in near_duplicates([t.user_message for t in parsed.values()], near_duplicate_threshold):
        row_a, row_b = numbers[a], numbers[b]
        report.near_duplicates.append((row_a, row_b, score))
        message = f"near-duplicate of row {row_a} (similarity {score:.2f})"
        report.warnings.append(RowIssue(row_b, parsed[row_b].task_id, "prompt", message, NEAR_DUPLICATE))

    for number, task in parsed.items():
        report.warnings += live_write_issues(task, number, live_writes)

    if count_tokens is not None:
        for number, task in parsed.items():
            try:
                n = int(count_tokens(task))
            except Exception as e:  # the counter's failure on one row should not hide the others
                report.errors.append(RowIssue(number, task.task_id, "prompt", f"cannot count tokens: {e}", TOKENS))
                continue
            report.token_counts[number] = n
            if max_tokens is not None and n > max_tokens:
                message = f"prompt is {n} tokens with its tools; the limit is {max_tokens}"
                report.warnings.append(RowIssue(number, task.task_id, "prompt", message, TOO_LONG))

    if strict:
        report.errors += report.warnings
        report.warnings = []
    report.errors.sort(key=lambda i: i.row)  # stable: within a row, issues keep their order
    report.warnings.sort(key=lambda i: i.row)
    report.stats = compute_stats(len(rows), parsed, inventory, report.token_counts)
    return report


def live_write_issues(task: TaskRow, number: int, live_writes: Collection[str]) -> list[RowIssue]:
    """A warning for each distinct tool of the task's plan that writes to a live service: a live backend
    cannot start each episode from the same state or keep episodes apart, and the writes are real."""
    issues, seen = [], set()
    for i, step in enumerate(task.ground_truth.tool_sequence):
        name = f"{step.server}.{step.tool}"
        if name in live_writes and name not in seen:
            seen.add(name)
            message = (
                f"{name} writes to the live {step.server} service: episodes share its real state and cannot be "
                f"isolated (use the offline backend for training)"
            )
            issues.append(RowIssue(number, task.task_id, f"{GT}.tool_sequence[{i}]", message, LIVE_WRITE))
    return issues


def duplicate_id_issues(rows: list[Any], found: dict[str, list[int]] | None = None) -> list[RowIssue]:
    """An error for every row whose task_id an earlier row already has; fills `found` {id: rows}."""
    seen: dict[str, list[int]] = {}
    for number, row in enumerate(rows, 1):
        if (task_id := task_id_of(row)) is not None:
            seen.setdefault(task_id, []).append(number)
    issues = []
    for task_id, numbers in seen.items():
        if len(numbers) > 1:
            if found is not None:
                found[task_id] = numbers
            for number in numbers[1:]:
                message = f"duplicate task_id {task_id!r} (first in row {numbers[0]})"
                issues.append(RowIssue(number, task_id, f"{GT}.task_id", message, DUPLICATE_ID))
    return issues


def compute_stats(rows: int, parsed: dict[int, TaskRow], inventory: Inventory, tokens: dict[int, int]) -> Stats:
    stats = Stats(rows=rows, valid_rows=len(parsed))
    tasks = list(parsed.values())
    if not tasks:
        stats.unused_tools = sorted(f"{s}.{t}" for s, tools in inventory.items() for t in tools)
        return stats
    truths = [t.reward_spec.ground_truth for t in tasks]
    stats.by_complexity = dict(Counter(g.complexity for g in truths).most_common())
    stats.by_method = dict(Counter(t.reward_spec.method for t in tasks).most_common())
    chars = [sum(len(m.content) for m in t.prompt) for t in tasks]
    stats.prompt_chars_mean, stats.prompt_chars_max = sum(chars) / len(chars), max(chars)
    counted = [tokens[n] for n in parsed if n in tokens]
    if counted:
        stats.prompt_tokens_mean, stats.prompt_tokens_max = sum(counted) / len(counted), max(counted)
    calls = Counter(f"{s.server}.{s.tool}" for g in truths for s in g.tool_sequence)
    stats.tool_calls = dict(sorted(calls.items(), key=lambda kv: (-kv[1], kv[0])))
    stats.unused_tools = sorted(f"{s}.{t}" for s, tools in inventory.items() for t in tools if f"{s}.{t}" not in calls)
    turns = [g.max_turns for g in truths]
    stats.max_turns_mean, stats.max_turns_max = sum(turns) / len(turns), max(turns)
    stats.tool_calls_mean = sum(len(g.tool_sequence) for g in truths) / len(truths)
    return stats
