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
time. `tasks/task_row.schema.json` is the same contract as a JSON Schema; a test keeps the two equal.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.schema import Complexity

COMPLEXITY_CALLS = {"simple": (1, 1), "medium": (2, 3), "hard": (4, 12)}  # tool calls per complexity


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(_Strict):
    role: Literal["system", "user"] = Field(description="Only system and user turns live in the data.")
    content: str = Field(min_length=1)


class ToolStep(_Strict):
    step: int = Field(ge=1, description="1-based position in the expected sequence.")
    server: str = Field(min_length=1, description="MCP server name in the pool (e.g. polygon, or an external one).")
    tool: str = Field(min_length=1, description="Tool name on that server.")
    params: dict[str, Any] = Field(default_factory=dict, description="Concrete arguments; valid for the tool's schema.")


class Success(_Strict):
    must_call_tool: str = Field(pattern=r"^[^.\s]+\..+$", description="`server.tool` the agent must call first.")


class Limits(_Strict):
    max_servers: int = Field(ge=1)
    max_tools: int = Field(ge=1, description="Most distinct tools the task may use.")


class FinalAnswer(_Strict):
    """A verifiable outcome: the number (or text) a correct final answer contains."""

    value: float | str
    tolerance: float = Field(0.0, ge=0, description="Absolute tolerance for numbers; ignored for text.")
    description: str = Field("", description="What the value is, e.g. 'NVDA close on 2026-11-19 in USD'.")


class GroundTruth(_Strict):
    task_id: str = Field(min_length=1)
    complexity: Complexity
    max_turns: int = Field(ge=1, le=50)
    success: Success
    tool_sequence: list[ToolStep] = Field(min_length=1)
    limits: Limits
    final_answer: FinalAnswer | None = None

    @model_validator(mode="after")
    def _consistent(self) -> GroundTruth:
        steps = [s.step for s in self.tool_sequence]
        if steps != list(range(1, len(steps) + 1)):
            raise ValueError(f"tool_sequence steps must be 1, 2, ... in order; got {steps}")
        first = self.tool_sequence[0]
        if self.success.must_call_tool != f"{first.server}.{first.tool}":
            raise ValueError("success.must_call_tool must be the first step's server.tool")
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


class RewardSpec(_Strict):
    method: Literal["rule", "llm_judge", "hybrid"] = "rule"
    ground_truth: GroundTruth


class TaskRow(_Strict):
    data_source: str = Field(min_length=1, description="Where the row came from, e.g. mcprl/rule.")
    env_class: Literal["MCPToolEnv"] = "MCPToolEnv"
    prompt: list[Message] = Field(min_length=1, max_length=2)
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
    def user_message(self) -> str:
        return self.prompt[-1].content
