"""LLM-judge rewards: one action scored against a rubric, a GRPO group ranked in one call, and hybrid.

The judge is any OpenAI-compatible endpoint, asked through structured outputs (`StructuredClient`:
strict JSON schema, bounded retries on 429/5xx/network, a disk cache by content hash, token counts).

**Per-action score** (`Judge.score`, `reward_llm_judge`). The judge returns exactly four numbers,
scores only, no rationale (`SCORE_SCHEMA`):

    tool_choice ∈ [0, 1]   the tool called (or the answer given) is the right move for this step
    arguments   ∈ [0, 1]   the arguments are plausible and correct for the task
    progress    ∈ [-1, 1]  the action moves the task forward (-1: it undoes or derails it)
    safety      ∈ {0, -1}  -1: the action is unsafe (leaks a secret, destroys, posts unasked, ...)

    total = Σ rubric[k] · score[k]

With non-negative weights the total lies in [-(w_progress + w_safety), w_tool_choice + w_arguments
+ w_progress]; the default rubric (0.35, 0.25, 0.3, 0.1) gives [-0.4, 0.9]. A rubric key missing
counts as weight 0; an unknown key is an error. The judge never decides completion: `task_complete`
is False (in `hybrid`, the heuristic's verdict is kept).

**Group ranking** (`Judge.rank_group`, `group_judge`). One call sees all G trajectories of a group,
named t0..t{G-1}, and gives each a score in [0, 1] relative to the others (`group_schema(G)`). The
answer must name every id exactly once; otherwise the group gets no scores (None, marked with the
reason), never made-up ones.

**What is sent** (both kinds): the task (its system and first user message), the reference plan from
the ground truth, the turns since, and the action being judged, with these guardrails:
- secrets are redacted everywhere: values of `configs.loader.SECRET_ENV_VARS`, of
  `judge.secret_env_vars` and of the API key's variable, read from the environment; and anything
  shaped like a key (sk-..., xox?-..., gh?_..., `Bearer <token>`);
- tool results (role `tool`, and user turns after the first: observations may come back as user
  turns) are cut to `max_tool_result_chars`;
- the whole request (system + user) stays under `max_input_tokens`, counted as 4 chars a token: the
  oldest turns are dropped first; the task, the reference and the judged action stay (cut only when
  they alone would not fit).

**Faults.** A judge that cannot be reached (retries spent, 5xx, auth) or that answers outside the
schema is not the policy's doing: the result has `infra_fault: True`, `judge_error` (the reason) and
total 0.0, and the caller retries or drops the episode rather than learn from it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from typing import Any, Protocol

from configs.loader import SECRET_ENV_VARS, redact
from configs.schema import JudgeConfig
from tasks.openai_client import RequestFailed, StructuredClient, StructuredOutputError

log = logging.getLogger(__name__)

SCORE_NAMES = ("tool_choice", "arguments", "progress", "safety")
SCORE_SCHEMA_NAME = "judge_scores"
GROUP_SCHEMA_NAME = "judge_group_scores"
CHARS_PER_TOKEN = 4
MAX_OUTPUT_TOKENS = 512  # scores only: a few dozen tokens; the cap stops a runaway number
TASK_SHARE, REFERENCE_SHARE, ACTION_SHARE = 0.4, 0.2, 0.4  # of the budget, when these alone overflow it

SCORE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tool_choice": {"type": "number", "minimum": 0, "maximum": 1},
        "arguments": {"type": "number", "minimum": 0, "maximum": 1},
        "progress": {"type": "number", "minimum": -1, "maximum": 1},
        "safety": {"type": "integer", "enum": [0, -1]},
    },
    "required": list(SCORE_NAMES),
    "additionalProperties": False,
}

SCORE_SYSTEM = """You judge one action of an AI agent that solves a task with MCP tools.
Score ONLY the latest action, given the task, a reference plan and the conversation so far.
Answer with scores only, no rationale:
- tool_choice (0..1): 1 if the tool it calls (or the final answer it gives) is the right next move.
- arguments (0..1): 1 if the call's arguments are correct and plausible for the task; 0 if wrong or malformed.
- progress (-1..1): how much the action moves the task toward completion; negative if it derails or undoes it.
- safety (0 or -1): -1 if the action is unsafe (leaks secrets, destructive, posts or sends unasked), else 0.
The reference plan is one good route; other valid routes deserve full marks."""

GROUP_SYSTEM = """You compare several attempts (trajectories) of an AI agent at the same task with MCP tools.
Rank them against each other: give each trajectory id a score from 0 (worst) to 1 (best), using the
full range; equally good attempts get equal scores. Judge correct tool use, correct arguments,
progress toward the task's goal, and safety. Answer with scores only, no rationale, one entry for
every id, each id exactly once. The reference plan is one good route; other valid routes are fine."""

# Strings shaped like credentials, whatever variable (if any) they came from.
TOKEN_PATTERNS = (
    re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"),  # OpenAI and look-alikes (sk-proj-..., sk-ant-...)
    re.compile(r"\bxox[abposre]-[A-Za-z0-9-]{8,}"),  # Slack
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{16,}"),  # GitHub
    re.compile(r"\bBearer\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE),
)
REDACTED = "[redacted]"


class JudgeLike(Protocol):
    """The judge's one interface, what reward code calls. Two classes implement it: `Judge` (in this
    process) and `envs.judge_serve.JudgeHandle` (the Serve deployment, reached by handle; the deployment
    itself only relays these calls). Whatever holds a judge (env, runner, driver) types it as this."""

    async def score(
        self,
        conversation: list[dict[str, Any]],
        latest_action: str,
        ground_truth: dict[str, Any],
        rubric: dict[str, float] | None = None,
    ) -> dict[str, Any]: ...

    async def rank_group(
        self, trajectories: list[list[dict[str, Any]]], ground_truth: dict[str, Any]
    ) -> dict[str, Any]: ...

    async def stats(self) -> dict[str, Any]: ...


class Limiter(Protocol):
    async def acquire(self) -> None: ...


# --------------------------------------------------------------------------- reward arithmetic


def check_rubric(rubric: dict[str, float]) -> None:
    unknown = sorted(set(rubric) - set(SCORE_NAMES))
    if unknown:
        raise ValueError(f"judge rubric: unknown score(s) {unknown}; known: {list(SCORE_NAMES)}")


def combine(scores: dict[str, float], rubric: dict[str, float]) -> float:
    """Σ rubric[k] · scores[k] (missing weights count 0)."""
    return float(sum(rubric.get(k, 0.0) * scores[k] for k in SCORE_NAMES))


def reward_range(rubric: dict[str, float]) -> tuple[float, float]:
    """(lowest, highest) total a rubric can give."""
    lo = {"tool_choice": 0.0, "arguments": 0.0, "progress": -1.0, "safety": -1.0}
    hi = {"tool_choice": 1.0, "arguments": 1.0, "progress": 1.0, "safety": 0.0}
    ends = [(rubric.get(k, 0.0) * lo[k], rubric.get(k, 0.0) * hi[k]) for k in SCORE_NAMES]
    return sum(min(e) for e in ends), sum(max(e) for e in ends)


def infra_fault_result(error: str) -> dict[str, Any]:
    """A reward the trainer must not learn from: the judge, not the policy, failed."""
    return {"total_reward": 0.0, "components": {}, "task_complete": False, "infra_fault": True, "judge_error": error}


def hybrid(heuristic: dict[str, Any], judge: dict[str, Any], judge_weight: float) -> dict[str, Any]:
    """(1 - w)·heuristic + w·judge, components merged as `heuristic/<name>` and `judge/<name>`.

    An infrastructure fault on either side makes the whole reward one (total 0.0, flagged): mixing a
    lone heuristic into a group scored by both would change the reward's scale within the group.
    `task_complete` is the heuristic's (the judge does not decide it).
    """
    if not 0.0 <= judge_weight <= 1.0:
        raise ValueError(f"judge_weight must be in [0, 1], got {judge_weight}")
    components: dict[str, Any] = {}
    for prefix, part in (("heuristic", heuristic), ("judge", judge)):
        components[f"{prefix}/total"] = float(part.get("total_reward", 0.0))
        components.update({f"{prefix}/{k}": v for k, v in (part.get("components") or {}).items()})
    faults = [
        f"{name}: {part.get('judge_error') or part.get('error') or 'infra fault'}"
        for name, part in (("heuristic", heuristic), ("judge", judge))
        if part.get("infra_fault")
    ]
    complete = bool(heuristic.get("task_complete")) or bool(judge.get("task_complete"))
    result = {"components": components, "task_complete": complete, "infra_fault": bool(faults)}
    if faults:
        return {"total_reward": 0.0, **result, "judge_error": "; ".join(faults)}
    total = (1.0 - judge_weight) * float(heuristic["total_reward"]) + judge_weight * float(judge["total_reward"])
    return {"total_reward": total, **result}


# --------------------------------------------------------------------------- redaction and fitting


def secret_values(extra_vars: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Values (≥ 4 chars) of the secret variables now set, longest first (a key inside a longer one)."""
    names = {*SECRET_ENV_VARS, *extra_vars}
    values = {os.environ.get(n, "") for n in names}
    return sorted((v for v in values if len(v) >= 4), key=len, reverse=True)


def scrub(value: Any, secrets: list[str]) -> Any:
    """A copy of `value` (JSON-like) with secret values and key-shaped strings replaced."""
    if isinstance(value, dict):
        return {k: scrub(redact(v, k) if isinstance(v, str) else v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v, secrets) for v in value]
    if not isinstance(value, str):
        return value
    text = redact(value)  # SECRET_ENV_VARS, the project's one list
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    for pattern in TOKEN_PATTERNS:
        text = pattern.sub(REDACTED, text)
    return text


def cut(text: str, limit: int, keep_tail: bool = False) -> str:
    """`text` in at most `limit` chars, saying how much was cut; `keep_tail`: keep both ends."""
    if len(text) <= limit:
        return text
    room = max(0, limit - len(f" …[{len(text)} chars cut]… "))  # the note at its longest
    note = f" …[{len(text) - room} chars cut]… "
    head = room - room // 2 if keep_tail else room
    tail = text[len(text) - (room - head) :] if room > head else ""
    return (text[:head] + note + tail)[:limit]


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    text = content if isinstance(content, str) else "" if content is None else json.dumps(content)
    if message.get("tool_calls"):  # OpenAI-style calls ride next to the text
        text = f"{text}\n{json.dumps(message['tool_calls'])}".strip()
    return text


def _turn(message: dict[str, Any]) -> str:
    return f"[{message.get('role', '?')}] {_content(message)}"


def split_task(conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the task: leading system turns and the first user turn, the turns after it)."""
    for i, m in enumerate(conversation):
        if m.get("role") == "user":
            return conversation[: i + 1], conversation[i + 1 :]
    return conversation, []


def _is_observation(message: dict[str, Any]) -> bool:
    # After the task, a user turn carries a tool result (EnvConfig.observation_role may be "user").
    return message.get("role") in ("tool", "user")


def _cut_observations(turns: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    return [{**m, "content": cut(_content(m), limit)} if _is_observation(m) else m for m in turns]


def fit_turns(turns: list[dict[str, Any]], budget: int, keep_last: bool = False) -> str:
    """The newest turns that fit in `budget` chars, oldest dropped first (with a note of how many).

    `keep_last`: the last turn always stays, cut to fit when it alone is too long.
    """
    lines = [_turn(m) for m in turns]
    kept: list[str] = []
    used = 0
    if keep_last and lines:
        last = cut(lines[-1], max(0, budget - 40), keep_tail=True)  # 40: room for the omission note
        kept, used, lines = [last], len(last) + 1, lines[:-1]
    for line in reversed(lines):
        note = len(f"[{len(lines) - len(kept)} earlier turns omitted]\n")
        if used + len(line) + 1 + note > budget:
            break
        kept.insert(0, line)
        used += len(line) + 1
    omitted = len(turns) - len(kept)
    return "\n".join(([f"[{omitted} earlier turns omitted]"] if omitted else []) + kept)


def reference_text(ground_truth: dict[str, Any]) -> str:
    """The expected plan in a few lines: first tool, the sequence with arguments, the final value."""
    lines = []
    must = (ground_truth.get("success") or {}).get("must_call_tool")
    if must:
        lines.append(f"first call: {must}")
    for step in ground_truth.get("tool_sequence") or []:
        args = json.dumps(step.get("params") or {}, sort_keys=True)
        lines.append(f"{step.get('step', '?')}. {step.get('server')}.{step.get('tool')} {args}")
    final = ground_truth.get("final_answer")
    if final:
        desc = f" ({final['description']})" if final.get("description") else ""
        lines.append(f"final answer: {final.get('value')}{desc}")
    return "\n".join(lines) or "(none)"


def approx_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


# --------------------------------------------------------------------------- prompts


def _fixed_sections(
    cfg: JudgeConfig, system: str, task: list[dict[str, Any]], ground_truth: dict[str, Any], tail: str
) -> tuple[str, str, str, int]:
    """(task text, reference, tail, chars left for the turns), cutting the three only if they overflow."""
    budget = cfg.max_input_tokens * CHARS_PER_TOKEN - len(system) - 200  # 200: headers and newlines
    task_text = "\n".join(_turn(m) for m in task)
    ref = reference_text(ground_truth)
    if len(task_text) + len(ref) + len(tail) > budget:
        task_text = cut(task_text, int(budget * TASK_SHARE), keep_tail=True)
        ref = cut(ref, int(budget * REFERENCE_SHARE))
        tail = cut(tail, int(budget * ACTION_SHARE), keep_tail=True)
    return task_text, ref, tail, max(0, budget - len(task_text) - len(ref) - len(tail))


def score_prompt(
    cfg: JudgeConfig, conversation: list[dict[str, Any]], latest_action: str, ground_truth: dict[str, Any]
) -> str:
    """The user message asking for one action's scores (already redacted, cut and capped)."""
    secrets = secret_values([*cfg.secret_env_vars, cfg.openai.api_key_env])
    conversation = scrub(list(conversation), secrets)
    latest_action = scrub(latest_action, secrets)
    ground_truth = scrub(ground_truth, secrets)
    task, turns = split_task(conversation)
    if turns and turns[-1].get("role") == "assistant" and _content(turns[-1]) == latest_action:
        turns = turns[:-1]  # the judged action is shown once, in its own section
    turns = _cut_observations(turns, cfg.max_tool_result_chars)
    task_text, ref, action, room = _fixed_sections(cfg, SCORE_SYSTEM, task, ground_truth, latest_action)
    history = fit_turns(turns, room) or "(none: this is the first action)"
    return (
        f"## Task\n{task_text}\n\n## Reference plan\n{ref}\n\n"
        f"## Conversation so far\n{history}\n\n## Latest action (score this one)\n{action}"
    )


def group_ids(n: int) -> list[str]:
    return [f"t{i}" for i in range(n)]


def group_schema(n: int) -> dict[str, Any]:
    """One {id, score} per trajectory; the ids are an enum, the count is fixed."""
    return {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "minItems": n,
                "maxItems": n,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string", "enum": group_ids(n)},
                        "score": {"type": "number", "minimum": 0, "maximum": 1},
                    },
                    "required": ["id", "score"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    }


def group_prompt(cfg: JudgeConfig, trajectories: list[list[dict[str, Any]]], ground_truth: dict[str, Any]) -> str:
    """The user message asking to rank a group: the shared task once, then each trajectory's own turns."""
    secrets = secret_values([*cfg.secret_env_vars, cfg.openai.api_key_env])
    trajectories = scrub([list(t) for t in trajectories], secrets)
    ground_truth = scrub(ground_truth, secrets)
    task, _ = split_task(trajectories[0])
    task_text, ref, _, room = _fixed_sections(cfg, GROUP_SYSTEM, task, ground_truth, "")
    ids = group_ids(len(trajectories))
    share = max(0, room // len(trajectories) - 40)  # 40: each trajectory's header
    parts = []
    for tid, traj in zip(ids, trajectories, strict=True):
        turns = _cut_observations(split_task(traj)[1], cfg.max_tool_result_chars)
        parts.append(f"### {tid}\n{fit_turns(turns, share, keep_last=True) or '(no turns)'}")
    body = "\n\n".join(parts)
    return f"## Task\n{task_text}\n\n## Reference plan\n{ref}\n\n## Trajectories ({', '.join(ids)})\n{body}"


def check_group_answer(answer: dict[str, Any], n: int) -> list[float]:
    """Scores in trajectory order; ValueError unless every id appears exactly once with a score in [0, 1]."""
    entries = answer.get("scores")
    if not isinstance(entries, list):
        raise ValueError("no `scores` list")
    ids = group_ids(n)
    counts = Counter(e.get("id") for e in entries if isinstance(e, dict))
    missing = [i for i in ids if counts[i] == 0]
    repeated = sorted(i for i, c in counts.items() if c > 1)
    unknown = sorted(str(i) for i in counts if i not in ids)
    if missing or repeated or unknown or len(entries) != n:
        raise ValueError(f"ids must each appear once: missing {missing}, repeated {repeated}, unknown {unknown}")
    by_id = {e["id"]: e.get("score") for e in entries}
    scores = []
    for i in ids:
        s = by_id[i]
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0.0 <= s <= 1.0:
            raise ValueError(f"score of {i} is {s!r}, not a number in [0, 1]")
        scores.append(float(s))
    return scores


# --------------------------------------------------------------------------- the judge


class Judge(JudgeLike):
    """The judge in this process: a `StructuredClient` and the judge config.

    `limiter`: anything with `async acquire()` (e.g. `serve_apps.tool_host.RateLimiter`), awaited before
    every request, cache hits included. `backoff_s`: the client's first retry wait.
    """

    def __init__(
        self,
        cfg: JudgeConfig,
        *,
        limiter: Limiter | None = None,
        backoff_s: float = 1.0,
        client: StructuredClient | None = None,
    ) -> None:
        check_rubric(cfg.rubric)
        self.cfg = cfg
        self.limiter = limiter
        self.client = client or StructuredClient(cfg.openai, backoff_s=backoff_s, max_output_tokens=MAX_OUTPUT_TOKENS)
        self.counts: Counter[str] = Counter()  # scored, ranked, infra_faults, group_failures
        self.limiter_waiting = 0  # requests waiting on the rate limit right now

    def __repr__(self) -> str:
        return f"Judge({self.client!r})"

    def usage(self) -> dict[str, int]:
        """Tokens spent by this judge's client (requests, prompt/completion/total tokens, cache hits, retries)."""
        return self.client.usage()

    async def stats(self) -> dict[str, Any]:
        """Calls by outcome, requests now waiting on the rate limit, and the tokens spent."""
        counts = {k: self.counts[k] for k in ("scored", "ranked", "infra_faults", "group_failures")}
        return {**counts, "limiter_waiting": self.limiter_waiting, "usage": self.usage()}

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _ask(self, user: str, system: str, schema_name: str, schema: dict[str, Any]) -> dict[str, Any]:
        if self.limiter is not None:
            self.limiter_waiting += 1
            try:
                await self.limiter.acquire()
            finally:
                self.limiter_waiting -= 1
        return await self.client.complete(system, user, schema_name, schema)

    async def score(
        self,
        conversation: list[dict[str, Any]],
        latest_action: str,
        ground_truth: dict[str, Any],
        rubric: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """{total_reward, components (the four scores), task_complete: False, infra_fault} for one action."""
        rubric = self.cfg.rubric if rubric is None else rubric
        check_rubric(rubric)
        user = score_prompt(self.cfg, conversation, latest_action, ground_truth)
        try:
            answer = await self._ask(user, SCORE_SYSTEM, SCORE_SCHEMA_NAME, SCORE_SCHEMA)
        except (RequestFailed, StructuredOutputError) as e:
            self.counts["infra_faults"] += 1
            log.warning("judge failed, reward marked infra_fault: %s", e)
            return infra_fault_result(_reason(e))
        self.counts["scored"] += 1
        scores = {k: float(answer[k]) for k in SCORE_NAMES}
        return {
            "total_reward": combine(scores, rubric),
            "components": scores,
            "task_complete": False,
            "infra_fault": False,
        }

    async def rank_group(
        self, trajectories: list[list[dict[str, Any]]], ground_truth: dict[str, Any]
    ) -> dict[str, Any]:
        """{scores: [one in [0, 1] per trajectory] or None, infra_fault, judge_error} from one call."""
        if not trajectories:
            return {"scores": [], "infra_fault": False, "judge_error": None}
        n = len(trajectories)
        user = group_prompt(self.cfg, trajectories, ground_truth)
        try:
            answer = await self._ask(user, GROUP_SYSTEM, GROUP_SCHEMA_NAME, group_schema(n))
            scores = check_group_answer(answer, n)
        except (RequestFailed, StructuredOutputError, ValueError) as e:
            self.counts["group_failures"] += 1
            log.warning("group judge failed, no scores for the group: %s", e)
            reason = _reason(e) if not isinstance(e, ValueError) else f"coverage: {e}"
            return {"scores": None, "infra_fault": True, "judge_error": reason}
        self.counts["ranked"] += 1
        return {"scores": scores, "infra_fault": False, "judge_error": None}


def _reason(e: Exception) -> str:
    if isinstance(e, RequestFailed):
        return f"request_failed/{e.kind}: {e}"
    if isinstance(e, StructuredOutputError):
        return f"judge_output/{e.reason}: {e}"
    return str(e)


async def reward_llm_judge(
    conversation: list[dict[str, Any]],
    latest_action: str,
    ground_truth: dict[str, Any],
    rubric: dict[str, float],
    *,
    judge: JudgeLike,
) -> dict[str, Any]:
    """The judge's reward for `latest_action`: {total_reward, components, task_complete, infra_fault[, judge_error]}.

    `judge`: an in-process `Judge` or the Serve handle wrapper (`envs.judge_serve.judge_client`).
    """
    return await judge.score(conversation, latest_action, ground_truth, rubric)


async def group_judge(
    trajectories: list[list[dict[str, Any]]],
    ground_truth: dict[str, Any],
    *,
    judge: JudgeLike,
) -> list[float] | None:
    """One score in [0, 1] per trajectory of a GRPO group, from one judge call; None when the judge failed
    (unreachable, or an answer that does not cover every trajectory once): the group is not to be scored."""
    return (await judge.rank_group(trajectories, ground_truth))["scores"]
