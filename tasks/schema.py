"""The task: one dataset row, in SkyRL's format.

    {"data_source": "mcprl/rule", "env_class": "MCPToolEnv",
     "prompt": [{"role": "system", ...}, {"role": "user", "content": "..."}],
     "reward_spec": {"method": "rule", "ground_truth": {
         "task_id": "...", "complexity": "medium", "max_turns": 6,
         "success": {"must_call_tool": "polygon.previous_close"},
         "tool_sequence": [{"step": 1, "server": "polygon", "tool": "previous_close", "params": {"ticker": "NVDA"}}],
         "limits": {"max_servers": 2, "max_tools": 3},
         "final_answer": {"value": 186.52, "tolerance": 0.01}}},
     "extra_info": {"template": "...", "method": "rule", ...}}

The prompt holds the system and first user message only: assistant and tool turns are made at run
time. `success.must_call_tool` is `server.tool` (that tool first) or `server` (any of its tools first).

`TaskRow` is the one contract. It is strict: "4" and true are not integers, 1 is a number but not
a string. Integral floats are integers (4.0 is 4): JSON has one number type. `tasks/task_row.schema.json`
is generated from it (`python -m tasks.schema --write`; a test fails when the file drifts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic.json_schema import GenerateJsonSchema

from configs.schema import Complexity

SCHEMA_PATH = Path(__file__).with_name("task_row.schema.json")
SCHEMA_ID = "https://mcprl.dev/schemas/task_row.schema.json"
COMPLEXITY_CALLS = {"simple": (1, 1), "medium": (2, 3), "hard": (4, 12)}  # tool calls per complexity


def _whole(value: Any) -> Any:
    """4.0 -> 4 (json.loads gives a float for "4.0"); 4.5, "4" and true are left for strict int to refuse."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


JsonInt = Annotated[int, BeforeValidator(_whole)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Message(_Strict):
    role: Literal["system", "user"] = Field(description="Only system and user turns live in the data.")
    content: str = Field(min_length=1)


class ToolStep(_Strict):
    step: JsonInt = Field(ge=1, description="1-based position in the expected sequence.")
    server: str = Field(min_length=1, description="MCP server name in the pool (e.g. polygon, or an external one).")
    tool: str = Field(min_length=1, description="Tool name on that server.")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Concrete arguments; valid for the tool's input schema (checked by the gate against the pool).",
    )


class Success(_Strict):
    must_call_tool: str = Field(
        pattern=r"^[^.\s]+(\.\S+)?$",
        description="What the agent must call first: `server.tool` (that tool) or `server` (any tool of that server).",
    )

    def matches(self, server: str, tool: str) -> bool:
        """Whether a call of `server`.`tool` is the call must_call_tool asks for."""
        want, dot, want_tool = self.must_call_tool.partition(".")
        return want == server and (not dot or want_tool == tool)


class Limits(_Strict):
    max_servers: JsonInt = Field(ge=1, description="Most distinct servers the task may use.")
    max_tools: JsonInt = Field(ge=1, description="Most distinct tools the task may use.")


class FinalAnswer(_Strict):
    """A verifiable outcome: the number (or text) a correct final answer contains."""

    value: float | str
    tolerance: float = Field(0.0, ge=0, description="Absolute tolerance for numbers; ignored for text.")
    description: str = Field("", description="What the value is, e.g. 'NVDA close on 2026-11-19 in USD'.")


# The number of tool calls per complexity, as JSON Schema rules (the model checks it in `_consistent`).
_COMPLEXITY_RULES = [
    {
        "description": f"A {name} task makes " + (f"exactly {lo} tool call." if lo == hi else f"{lo}-{hi} tool calls."),
        "if": {"properties": {"complexity": {"const": name}}, "required": ["complexity"]},
        "then": {"properties": {"tool_sequence": {"minItems": lo, "maxItems": hi}}},
    }
    for name, (lo, hi) in COMPLEXITY_CALLS.items()
]


class GroundTruth(_Strict):
    """What an episode is scored against: the expected tool calls, limits and the final answer."""

    model_config = ConfigDict(json_schema_extra={"allOf": _COMPLEXITY_RULES})

    task_id: str = Field(min_length=1, description="Unique within a dataset.")
    complexity: Complexity
    max_turns: JsonInt = Field(ge=1, le=50, description="Turn budget of an episode.")
    success: Success
    tool_sequence: list[ToolStep] = Field(min_length=1, description="The expected tool calls, in order.")
    limits: Limits
    final_answer: FinalAnswer | None = None

    @model_validator(mode="after")
    def _consistent(self) -> GroundTruth:
        steps = [s.step for s in self.tool_sequence]
        if steps != list(range(1, len(steps) + 1)):
            raise ValueError(f"tool_sequence steps must be 1, 2, ... in order; got {steps}")
        first = self.tool_sequence[0]
        if not self.must_call_matches(first.server, first.tool):
            raise ValueError(
                f"success.must_call_tool must be the first step's server.tool '{first.server}.{first.tool}' "
                f"or its server '{first.server}'; got {self.success.must_call_tool!r}"
            )
        if len({s.server for s in self.tool_sequence}) > self.limits.max_servers:
            raise ValueError("tool_sequence uses more servers than limits.max_servers")
        if len({(s.server, s.tool) for s in self.tool_sequence}) > self.limits.max_tools:
            raise ValueError("tool_sequence uses more distinct tools than limits.max_tools")
        lo, hi = COMPLEXITY_CALLS[self.complexity]
        if not lo <= len(self.tool_sequence) <= hi:
            raise ValueError(f"a {self.complexity} task has {lo}-{hi} tool calls, got {len(self.tool_sequence)}")
        if self.max_turns < len(self.tool_sequence):
            raise ValueError("max_turns is smaller than the number of tool calls")
        return self

    def must_call_matches(self, server: str, tool: str) -> bool:
        """Whether a call of `server`.`tool` satisfies success.must_call_tool (either form)."""
        return self.success.matches(server, tool)


class RewardSpec(_Strict):
    """How an episode is scored, and the ground truth it is scored against."""

    method: Literal["rule", "llm_judge", "hybrid"] = "rule"
    ground_truth: GroundTruth


# The prompt's shape, [user] or [system, user], as a JSON Schema rule (the model: `_prompt_shape`).
_PROMPT_SHAPE = {
    "if": {"minItems": 2},
    "then": {
        "prefixItems": [{"properties": {"role": {"const": "system"}}}, {"properties": {"role": {"const": "user"}}}]
    },
    "else": {"prefixItems": [{"properties": {"role": {"const": "user"}}}]},
}


class TaskRow(_Strict):
    """One mcprl task: a dataset row in SkyRL's format (data_source, env_class, prompt, reward_spec, extra_info).

    Generated from tasks/schema.py:TaskRow (python -m tasks.schema --write). Two of the model's
    cross-field rules are stated here too: the prompt's shape ([user] or [system, user]) and the
    number of tool calls per complexity (simple 1, medium 2-3, hard 4-12). The others cannot be
    written in JSON Schema and are checked in code (TaskRow's validators, run by tasks/validate.py):
    tool_sequence steps are 1, 2, ... in order; success.must_call_tool names the first step's server
    (`server`) or its tool (`server.tool`); the distinct servers and tools of tool_sequence fit
    limits.max_servers and limits.max_tools; max_turns is at least the number of tool calls.
    Integers may be written as integral numbers (4.0); strings, booleans and fractions are not integers.
    """

    data_source: str = Field(min_length=1, description="Where the row came from, e.g. mcprl/rule.")
    env_class: Literal["MCPToolEnv"] = Field("MCPToolEnv", description="The skyrl-gym environment that plays the task.")
    prompt: list[Message] = Field(
        min_length=1,
        max_length=2,
        description="The system message (optional) and the first user message; assistant and tool turns are "
        "made at run time.",
        json_schema_extra=_PROMPT_SHAPE,
    )
    reward_spec: RewardSpec
    extra_info: dict[str, Any] = Field(default_factory=dict, description="Free-form: method, template, split...")

    @model_validator(mode="after")
    def _prompt_shape(self) -> TaskRow:
        roles = [m.role for m in self.prompt]
        if roles not in (["user"], ["system", "user"]):
            raise ValueError(f"prompt must be [system?, user]; got roles {roles}")
        return self

    @property
    def task_id(self) -> str:
        return self.reward_spec.ground_truth.task_id

    @property
    def ground_truth(self) -> GroundTruth:
        return self.reward_spec.ground_truth

    @property
    def user_message(self) -> str:
        return self.prompt[-1].content


# --------------------------------------------------------------------------- the JSON Schema file


class _NoFieldTitles(GenerateJsonSchema):
    """Pydantic titles every field ("Max Turns"); the field's name says as much."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def task_row_json_schema() -> dict[str, Any]:
    """TaskRow as a JSON Schema (draft 2020-12): what tasks/task_row.schema.json holds."""
    generated = TaskRow.model_json_schema(schema_generator=_NoFieldTitles)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **generated}


def render_json_schema() -> str:
    """The file's text: the schema, indented, with a final newline."""
    return json.dumps(task_row_json_schema(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write or check tasks/task_row.schema.json (generated from TaskRow).")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"write {SCHEMA_PATH.name}")
    group.add_argument("--check", action="store_true", help=f"exit 1 when {SCHEMA_PATH.name} differs from TaskRow")
    args = parser.parse_args(argv)
    text = render_json_schema()
    if args.write:
        SCHEMA_PATH.write_text(text)
        print(f"wrote {SCHEMA_PATH}")
    elif args.check:
        if not SCHEMA_PATH.is_file() or SCHEMA_PATH.read_text() != text:
            sys.exit(f"{SCHEMA_PATH} is out of date with TaskRow: run python -m tasks.schema --write")
        print(f"{SCHEMA_PATH} is up to date")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
