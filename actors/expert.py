"""Expert trajectories for the supervised warm start: each task's `tool_sequence` played through the env.

A small model may never make a correct tool call on its own, and then GRPO has no signal (see
DESIGN.md, "a small model needs a warm start"). The warm start trains on what a perfect agent would
have generated, laid out token for token as the episode runner lays out a rollout, so that what
SFT teaches is exactly what the env will parse and what GRPO then continues from.

One row → one `Trajectory` (group_id = the row's index, sample_index 0):
- `prompt_ids`: the chat template's ids of the env's first messages (`ChatTemplate.prompt_ids`, with
  the env's `tool_definitions` as the runner renders them).
- per expert turn t (`envs.parsing.expert_turns`: each call in the syntax the prompt teaches, then
  `<answer>`: ours (Hermes) with the tool block in the system message, the template's own
  (`envs.prompting.call_syntax`) when the chat template shows the tools):
  `encode(text_t) + eot_ids`, loss_mask 1 on all of them (the model must learn to close its turn,
  so `appended_eot` is False: the end-of-turn is "generated"), rollout_logprobs 0.0 (SFT does not
  use them; 0.0 is a valid log-probability, so `Trajectory.check` holds);
- then, unless the env ended the episode, `ChatTemplate.observation_delta` (mask 0, logprob 0.0).

The turns are played through a real `MCPToolEnv` against the tool client given (the offline pool:
`jobs.sft.build_expert_trajectories` builds one), with the heuristic reward whatever `reward.backend` says (the
rewards are not trained on, and a judge would cost money for nothing). The token budget
(`rollout.max_total_tokens`) cuts an expert trajectory where the runner would cut a rollout
(finish_reason `token_budget`, counted as truncated).

A row whose play fails is skipped, counted, and logged with its task id, since broken ground truth
must not teach the model: a call that errs or times out, a turn the env rejects (parse error,
unknown tool), an infrastructure fault, an episode the env ends early or leaves open, a
`tool_sequence` the env does not count as done, or an answer that does not earn the outcome.
A row without `reward_spec.ground_truth.tool_sequence` is bad input: `ValueError` before anything runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from actors.episode_runner import ChatTemplate, _task_id, env_config_for
from actors.trajectory import Trajectory
from configs.schema import Config
from envs.mcp_tool_env import MCPToolEnv
from envs.parsing import expert_turns
from envs.prompting import call_syntax

log = logging.getLogger(__name__)

MAX_CONCURRENT_ROWS = 8  # rows played at once: tool calls overlap, the token work is cheap


class ExpertPlayError(RuntimeError):
    """The expert play of one row failed; the message says at which turn and why."""


def check_rows(rows: Sequence[Any]) -> None:
    """Raise ValueError naming the first row that cannot give expert turns (0-based index and task id)."""
    for i, row in enumerate(rows):
        where = f"row {i}"
        if not isinstance(row, Mapping):
            raise ValueError(f"{where}: a task row must be an object, got {type(row).__name__}")
        spec = row.get("reward_spec")
        gt = spec.get("ground_truth") if isinstance(spec, Mapping) else None
        if not isinstance(gt, Mapping):
            raise ValueError(f"{where}: no reward_spec.ground_truth")
        if gt.get("task_id"):
            where += f" ({gt['task_id']})"
        seq = gt.get("tool_sequence")
        if not isinstance(seq, list) or not seq:
            raise ValueError(f"{where}: reward_spec.ground_truth.tool_sequence is missing or empty")
        for j, step in enumerate(seq):
            if not (isinstance(step, Mapping) and {"server", "tool", "params"} <= set(step)):
                raise ValueError(f"{where}: tool_sequence[{j}] needs server, tool and params")
        if not isinstance(row.get("prompt"), list) or not row["prompt"]:
            raise ValueError(f"{where}: no prompt messages")


async def expert_trajectories(
    cfg: Config, rows: list[dict], tokenizer: Any, tool_client: Any = None, *, stats: dict[str, Any] | None = None
) -> list[Trajectory]:
    """The expert trajectory of each playable row, in row order (failed rows skipped).

    `tool_client`: where the tools are; None = the env's own, from `cfg.env.tools` (default: in-process).

    `stats`, when given, is filled with {rows, played, skipped, skipped_tasks: {task_id: reason},
    truncated, generated_tokens, total_tokens}.
    """
    check_rows(rows)
    template = ChatTemplate(tokenizer)
    play_cfg = cfg.model_copy(
        update={
            "env": env_config_for(cfg.env, template),  # the prompt the runner will show this model
            "reward": cfg.reward.model_copy(update={"backend": "heuristic"}),
        }
    )
    limit = asyncio.Semaphore(MAX_CONCURRENT_ROWS)
    skipped: dict[str, str] = {}

    async def one(index: int, row: dict) -> Trajectory | None:
        async with limit:
            try:
                return await _play(play_cfg, row, index, template, tool_client)
            except ExpertPlayError as e:
                task_id = _task_id(row, index)
                skipped[task_id] = str(e)
                log.warning("expert play of task %s (row %d) failed, row skipped: %s", task_id, index, e)
                return None

    results = await asyncio.gather(*(one(i, dict(row)) for i, row in enumerate(rows)))
    trajs = [t for t in results if t is not None]
    if stats is not None:
        stats.update(
            rows=len(rows),
            played=len(trajs),
            skipped=len(rows) - len(trajs),
            skipped_tasks=skipped,
            truncated=sum(t.finish_reason == "token_budget" for t in trajs),
            generated_tokens=sum(t.num_generated for t in trajs),
            total_tokens=sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs),
        )
    return trajs


async def _play(cfg: Config, row: dict, index: int, tmpl: ChatTemplate, tool_client: Any) -> Trajectory:
    """Play one row's expert turns; the layout follows `EpisodeRunner._attempt` step for step."""
    t0 = time.perf_counter()
    env_s = 0.0
    budget = cfg.rollout.max_total_tokens
    turns = expert_turns(row, call_syntax(tmpl.tok))
    try:
        env = MCPToolEnv(cfg, extras=row, tool_client=tool_client)
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        raise ExpertPlayError(f"the env rejects the row: {_short(e, 300)}") from e
    messages, info = await env.ainit(None)
    tools = info["tool_definitions"]
    traj = Trajectory(task_id=_task_id(row, index), group_id=index, sample_index=0)
    traj.messages = [dict(m) for m in messages]
    traj.prompt_ids = tmpl.prompt_ids(messages, tools)
    try:
        for k, text in enumerate(turns):
            ids = tmpl.encode(text) + tmpl.eot_ids
            if len(traj.prompt_ids) + len(traj.response_ids) + len(ids) > budget:
                traj.finish_reason = "token_budget"  # the runner's engine would be cut here too
                break
            t = time.perf_counter()
            out = await env.astep(text)
            env_s += time.perf_counter() - t
            meta = dict(out.get("metadata") or {})
            problem = _turn_problem(meta, out.get("observations") or [])
            if problem:
                raise ExpertPlayError(f"turn {k + 1} ({_short(text)}): {problem}")
            traj.add_turn(ids, [0.0] * len(ids), text, out, version=0, finish="stop")
            if out["done"]:
                rest = turns[k + 1 :]
                # A task without final_answer ends when its sequence is done: the empty answer turn is not played.
                if rest and not (meta.get("done_reason") == "sequence_complete" and rest == ["<answer></answer>"]):
                    raise ExpertPlayError(
                        f"the env ended the episode after turn {k + 1} of {len(turns)} ({meta.get('done_reason')})"
                    )
                traj.finish_reason = "done"
                break
            observations = [dict(m) for m in out["observations"]]
            delta = tmpl.observation_delta(traj.messages, observations, tools)
            if not traj.add_observations(observations, delta, budget):
                break
        else:
            raise ExpertPlayError(f"the episode is still open after all {len(turns)} expert turns")
    finally:
        traj.reward = math.fsum(traj.turn_rewards)
        traj.tool_stats = env.get_metrics()
        traj.timings = {"generate_s": 0.0, "env_s": env_s, "wait_s": 0.0, "total_s": time.perf_counter() - t0}
    if not traj.turns:
        raise ExpertPlayError(f"not even the first turn fits the token budget of {budget} (rollout.max_total_tokens)")
    if traj.finish_reason == "done":
        if not env.state.sequence_done(env.ground_truth):
            raise ExpertPlayError("the env does not count the tool_sequence as done after the expert calls")
        if env.ground_truth.final_answer is not None and traj.tool_stats.get("reward/outcome", 0.0) <= 0:
            raise ExpertPlayError("the expert answer does not earn the outcome reward (final_answer unreadable?)")
    return traj


def _turn_problem(meta: dict[str, Any], observations: list[dict[str, Any]]) -> str | None:
    """Why an expert turn failed, or None when every call ran ok and nothing was rejected."""
    if meta.get("error"):
        return f"the env failed: {meta['error']}"
    for err in meta.get("parse_errors") or []:
        return f"the env rejected the turn ({err['kind']}): {err['message']}"
    for i, call in enumerate(meta.get("calls") or []):
        if not call.get("ok"):
            said = observations[i]["content"] if i < len(observations) else ""  # the env's "x.y failed (kind): ..."
            kind = "infrastructure fault" if call.get("infra_fault") else call.get("error_kind") or "error"
            return _short(said, 300) if said else f"{call['name']} failed ({kind})"
    if meta.get("infra_fault"):
        return "infrastructure fault"
    return None


def _short(text: str, n: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


__all__ = ["ExpertPlayError", "check_rows", "expert_trajectories"]
