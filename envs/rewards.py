"""The heuristic reward: step-wise shaped, deterministic, from `HeuristicWeights`.

`reward_heuristic` scores one event of a turn — one tool call with its result, one parse error, or
the final answer — and updates the episode's `RewardState`. The env sums the events of a turn per
component and clips the turn's total (see below).

Components (default weights in brackets):

- allowed_tool [+0.2]: the call ran and its tool is allowed. Allowed = the distinct {server, tool}
  of the task's `tool_sequence` (not every tool on its servers: calling a tool the task never needs
  earns nothing). Not paid again for an exact repeat (same tool, same arguments) of an earlier call.
- must_call_first [+0.4]: the first call of the episode that ran is `success.must_call_tool`: that
  tool (`server.tool`), or any tool of that server (`server`) that the task's `tool_sequence` holds.
- expected_next [+0.2]: the call is the next expected step of `tool_sequence` and returned ok; the
  expected step then advances. params_match [+0.1] more when every expected param is given with an
  equal value (strings compared case-insensitively, numbers by value; extra arguments allowed).
- tool_ok [+0.1]: the call returned ok and its tool is allowed (not for an exact repeat). A call that runs
  but does not serve the task earns nothing: paying "any call that runs" taught GRPO on the demo to make
  the training set's most frequent call on every task.
- malformed [−0.2]: unreadable call, no action, empty or oversized turn, call refused past
  max_calls_per_turn, or arguments the tool rejected (invalid_arguments): such a call did not run,
  so it earns nothing else and does not count as the first call.
- unknown_tool [−0.2]: no such tool (or an ambiguous bare name).
- timeout [−0.2]: the tool ran past its time limit; it earns nothing else (a timed-out call could
  otherwise be repeated for shaping reward).
- guess [−0.5]: the final answer came before anything else: no call ran or was rejected, no
  turn failed to parse, on a task whose `tool_sequence` is not empty. Without it a guessed answer
  (0) pays more than a call whose arguments the tool rejected (−0.2), and GRPO on a model that
  rarely calls well learns to stop calling; with it, up to two failed attempts before the answer
  still beat a guess.
- outcome [+1.0]: the final answer matches `final_answer`: numbers — one of the first 20 numbers in
  the answer's first 2,000 characters is within `tolerance` (absolute) of the value; text — the
  value is contained in the answer, case-insensitively, whitespace collapsed. A task without
  `final_answer` pays the outcome when the answer comes after the whole tool_sequence was done.
- An infrastructure fault (`result.infra_fault`: upstream, unavailable) scores 0 in every
  component and sets `infra_fault` in the returned dict; it never counts against the policy.

`task_complete` (the episode's success) means the final answer is right: the outcome was paid. A task
without `final_answer` is complete once its whole tool_sequence ran. `RewardState.sequence_done` (the
expected calls all ran, "calls right") is reported beside it, never as the success.

Ranges with the default weights. One call: −0.2 ≤ r ≤ 1.0 (0.2+0.4+0.2+0.1+0.1). One answer: 0 or 1
(−0.5 or 0.5 when it is a guess: nothing tried before it). A turn (several calls, errors and maybe
an answer) sums its events and is clipped to [−1, 1] by `clip_step` (the components stay unclipped,
for logging): four failing calls plus a refused fifth would reach −1.0, a good call plus a correct
answer in one turn 2.0. An episode of T turns (T ≤ max_turns) therefore totals within [−T, T]. A
model that follows the expected sequence of S steps and answers correctly earns 0.4 + 0.6·S + 1.0
with the default weights (e.g. 2.0 for a one-step task); a call that does not advance the sequence
earns at most 0.3 (allowed_tool + tool_ok), and nothing when it repeats an earlier call exactly.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from configs.schema import HeuristicWeights
from envs.parsing import ParseError, ToolCall
from tasks.schema import GroundTruth

COMPONENTS = (
    "allowed_tool",
    "must_call_first",
    "expected_next",
    "params_match",
    "tool_ok",
    "malformed",
    "unknown_tool",
    "timeout",
    "guess",
    "outcome",
)
STEP_MIN, STEP_MAX = -1.0, 1.0
ANSWER_SCAN_CHARS = 2000
ANSWER_MAX_NUMBERS = 20
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


@dataclass
class RewardState:
    """What the reward remembers across the steps of one episode."""

    calls_run: int = 0  # calls that reached a tool and ran (not rejected, not infra faults)
    calls_tried: int = 0  # call events of any outcome, parse errors included
    next_step: int = 0  # index into tool_sequence of the next expected step
    seen_calls: set[str] = field(default_factory=set)  # canonical (tool, args) of calls already made
    answered: bool = False

    def sequence_done(self, ground_truth: GroundTruth) -> bool:
        return self.next_step >= len(ground_truth.tool_sequence)


def zero_components() -> dict[str, float]:
    return dict.fromkeys(COMPONENTS, 0.0)


def clip_step(total: float) -> float:
    return min(STEP_MAX, max(STEP_MIN, total))


def reward_heuristic(
    action: ToolCall | ParseError | str | None,
    tool_name: str | None,
    tool_result: Any,
    ground_truth: GroundTruth | dict[str, Any],
    state: RewardState,
    weights: HeuristicWeights | None = None,
) -> dict[str, Any]:
    """Score one event and update `state`.

    action: a `ToolCall` (with `tool_name` "server.tool" and its `tool_result`), a `ParseError`
    (a call that never ran), the final answer text, or None (nothing to score).
    Returns {"total_reward", "components", "task_complete", "infra_fault"}; total is unclipped
    (a single event stays within [−0.2, 1] with default weights).
    """
    w = weights or HeuristicWeights()
    gt = ground_truth if isinstance(ground_truth, GroundTruth) else GroundTruth.model_validate(ground_truth)
    comp = zero_components()
    infra = False
    if isinstance(action, ParseError | ToolCall):
        state.calls_tried += 1
    if isinstance(action, ParseError):
        if action.kind == "unknown_tool":
            comp["unknown_tool"] = w.unknown_tool
        else:
            comp["malformed"] = w.malformed
    elif isinstance(action, ToolCall):
        infra = _score_call(action, tool_name or action.name, tool_result, gt, state, w, comp)
    elif isinstance(action, str):
        state.answered = True
        if state.calls_tried == 0 and gt.tool_sequence:
            comp["guess"] = w.guess
        if answer_matches(action, gt, state):
            comp["outcome"] = w.outcome
    total = math.fsum(comp.values())
    complete = comp["outcome"] > 0 or (gt.final_answer is None and state.sequence_done(gt))
    return {"total_reward": total, "components": comp, "task_complete": complete, "infra_fault": infra}


def _score_call(
    call: ToolCall, name: str, result: Any, gt: GroundTruth, state: RewardState, w: HeuristicWeights, comp: dict
) -> bool:
    """Fill `comp` for one call; returns whether it was an infrastructure fault."""
    if result is None:
        return False
    if bool(getattr(result, "infra_fault", False)):
        return True
    ok = bool(getattr(result, "ok", False))
    kind = getattr(result, "error_kind", None)
    if not ok and kind == "unknown_tool":
        comp["unknown_tool"] = w.unknown_tool
        return False
    if not ok and kind == "invalid_arguments":
        comp["malformed"] = w.malformed
        return False
    if not ok and kind == "timeout":
        comp["timeout"] = w.timeout
        return False

    key = f"{name}\x00{_canonical(call.arguments)}"
    repeat = key in state.seen_calls
    state.seen_calls.add(key)
    allowed = {f"{s.server}.{s.tool}" for s in gt.tool_sequence}
    needed = name in allowed  # no component pays a tool the task does not need
    if name in allowed and not repeat:
        comp["allowed_tool"] = w.allowed_tool
    server, _, tool = name.partition(".")  # server names hold no dots; tool names may
    if state.calls_run == 0 and needed and gt.must_call_matches(server, tool):
        comp["must_call_first"] = w.must_call_first
    state.calls_run += 1
    if ok and not repeat and needed:
        comp["tool_ok"] = w.tool_ok
    if ok and not state.sequence_done(gt):
        step = gt.tool_sequence[state.next_step]
        if name == f"{step.server}.{step.tool}":
            comp["expected_next"] = w.expected_next
            if params_match(call.arguments, step.params):
                comp["params_match"] = w.params_match
            state.next_step += 1
    return False


def params_match(given: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Every expected param is given with an equal value (extra arguments are fine)."""
    return all(k in given and _equal(given[k], v) for k, v in expected.items())


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, str) and isinstance(b, str):
        return " ".join(a.split()).casefold() == " ".join(b.split()).casefold()
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def answer_matches(answer: str, gt: GroundTruth, state: RewardState | None = None) -> bool:
    """Whether the answer text states the task's final answer (see the module docstring)."""
    fa = gt.final_answer
    if fa is None:
        return state is not None and state.sequence_done(gt)
    text = answer[:ANSWER_SCAN_CHARS]
    if isinstance(fa.value, str):
        want = " ".join(fa.value.split()).casefold()
        return bool(want) and want in " ".join(text.split()).casefold()
    return any(abs(x - fa.value) <= fa.tolerance for x in numbers_in(text))


def numbers_in(text: str) -> list[float]:
    """The first numbers written in `text` ("1,234.5" is one number)."""
    out = []
    for m in _NUMBER.finditer(text):
        try:
            x = float(m.group().replace(",", ""))
        except ValueError:
            continue
        if math.isfinite(x):
            out.append(x)
        if len(out) >= ANSWER_MAX_NUMBERS:
            break
    return out


def _canonical(args: Any) -> str:
    try:
        return json.dumps(args, sort_keys=True, ensure_ascii=True, default=str)
    except (TypeError, ValueError, RecursionError):
        return repr(args)
