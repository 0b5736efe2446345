"""Figures of one rollout batch, from its trajectories: what the driver logs under `rollout/`.

`rollout_metrics(trajs)` splits the batch in two:

- every trajectory counts for the cost and fault figures: `episodes`, `generated_tokens`,
  `infra_faults`, `restarts` and the `finish/<reason>` fractions;
- only the *scored* ones (``infra_fault`` False) count for the policy figures, because an episode
  spoiled by the infrastructure scores 0 by rule and is not the policy's doing (DESIGN: "never
  turned into a negative reward"). With no scored episode the policy keys are left out, so no
  chart shows a made-up 0.

With S the scored trajectories, |S| = n, r_i their rewards, m_i their env metrics
(`MCPToolEnv.get_metrics`, kept in `Trajectory.tool_stats`):

    episode_reward      = (1/n) Σ r_i
    episode_reward_std  = sqrt((1/n) Σ (r_i - mean)²)          (population std of the batch)
    episode_len         = (1/n) Σ turns_i
    episode_tokens      = (1/n) Σ (|prompt_ids_i| + |response_ids_i|)
    success_rate        = (1/n) Σ task_complete_i               (the final answer is right)
    calls_right_rate    = (1/n) Σ calls_right_i                 (every expected call ran; not the success)
    tool_success_rate   = Σ tool_ok_i / Σ tool_calls_i          (pooled over all calls; 0 with no call)
    tool_timeout_rate   = Σ timeouts_i / Σ tool_calls_i         (pooled; 0 with no call)
    parse_failure_rate  = Σ parse_failures_i / Σ turns_i        (per turn; 0 with no turn)

The means and pooled rates come from `MCPToolEnv.aggregate_metrics` (one definition of each).
Over all trajectories T:

    generated_tokens = Σ_T Σ loss_mask      infra_faults = #{t ∈ T : infra_fault}
    restarts         = Σ_T restarts         finish/<reason> = #{t ∈ T : finish_reason = reason} / |T|

Empty input gives {}: a step with no episode has no figures (nothing to plot, nothing to average).

From the engines' stats rather than the trajectories: `prefix_cache_hit_rate` (vLLM engines), the share of
prompt tokens found in the prefix cache between two readings of the counters (the driver: one step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from actors.trajectory import FINISH_REASONS, Trajectory
from envs.mcp_tool_env import MCPToolEnv

DEFAULT_ROW_CHARS = 4000  # a W&B table cell stays readable and the table small


def rollout_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """The batch's figures (see the module docstring for each formula); {} for no trajectories."""
    if not trajs:
        return {}
    bad = [type(t).__name__ for t in trajs if not isinstance(t, Trajectory)]
    if bad:
        raise TypeError(f"rollout_metrics takes Trajectory objects, got {bad[0]} among {len(trajs)} items")
    n_all = len(trajs)
    out: dict[str, float] = {
        "episodes": float(n_all),
        "generated_tokens": float(sum(t.num_generated for t in trajs)),
        "infra_faults": float(sum(t.infra_fault for t in trajs)),
        "restarts": float(sum(t.restarts for t in trajs)),
    }
    for reason in FINISH_REASONS:
        out[f"finish/{reason}"] = sum(t.finish_reason == reason for t in trajs) / n_all

    scored = [t for t in trajs if not t.infra_fault]
    if not scored:
        return out
    n = len(scored)
    agg = MCPToolEnv.aggregate_metrics([t.tool_stats for t in scored])
    rewards = [float(t.reward) for t in scored]
    mean = math.fsum(rewards) / n
    out |= {
        "episode_reward": mean,
        "episode_reward_std": math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / n),
        "episode_len": agg["turns"],
        "episode_tokens": sum(len(t.prompt_ids) + len(t.response_ids) for t in scored) / n,
        "success_rate": agg["task_complete"],
        "calls_right_rate": agg["calls_right"],
        "tool_success_rate": agg["tool_success_rate"],
        "tool_timeout_rate": agg["timeout_rate"],
        # agg holds means over the same n episodes, so their ratio is the pooled ratio of sums.
        "parse_failure_rate": agg["parse_failures"] / agg["turns"] if agg["turns"] else 0.0,
    }
    return out


def prefix_cache_counts(engines: Sequence[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """{engine_id: (prompt tokens looked up in the prefix cache, tokens found)} of the engines that count
    them (vLLM's `stats()`: prefix_cache_queries, prefix_cache_hits); dead or other engines are left out."""
    return {
        str(e["engine_id"]): (int(e["prefix_cache_queries"]), int(e.get("prefix_cache_hits", 0)))
        for e in engines
        if isinstance(e, dict) and "engine_id" in e and "prefix_cache_queries" in e
    }


def prefix_cache_hit_rate(now: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]]) -> float | None:
    """Hits / queries of the prefix cache between two `prefix_cache_counts` (an engine new since `before`,
    or restarted, counts from 0); None when nothing was looked up (no vLLM engine, or no request)."""
    queries = hits = 0
    for engine, (q, h) in now.items():
        q0, h0 = before.get(engine, (0, 0))
        if q < q0:  # counters went back: not the same engine process
            q0 = h0 = 0
        queries += q - q0
        hits += h - h0
    return hits / queries if queries > 0 else None


def conversation_text(messages: Sequence[dict[str, Any]], max_chars: int = DEFAULT_ROW_CHARS) -> str:
    """`role: content` lines; past `max_chars` characters the middle is cut (the start and end show
    what was asked and how it ended), leaving `max_chars` of the text and a one-line note."""
    text = "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in messages)
    if len(text) <= max_chars:
        return text
    tail = max_chars // 3
    head = max_chars - tail
    note = f"\n[... {len(text) - max_chars:,} of {len(text):,} characters cut ...]\n"
    return f"{text[:head]}{note}{text[len(text) - tail :] if tail else ''}"


def sample_rows(trajs: Sequence[Trajectory], n: int, *, max_chars: int = DEFAULT_ROW_CHARS) -> list[dict[str, Any]]:
    """Up to `n` trajectories as table rows, spread over the reward range (best, worst and between,
    so a table shows both what works and what fails); ties keep batch order.

    Row: task_id, sample_index, reward, turns, finish_reason, infra_fault, conversation (text, at most
    about `max_chars` characters).
    """
    if n < 0:
        raise ValueError(f"sample_rows: n must be >= 0, got {n}")
    if not trajs or n == 0:
        return []
    ranked = sorted(range(len(trajs)), key=lambda i: -float(trajs[i].reward))
    if n >= len(ranked):
        picked = ranked
    elif n == 1:
        picked = ranked[:1]
    else:  # n evenly spaced ranks, first and last included
        picked = [ranked[round(k * (len(ranked) - 1) / (n - 1))] for k in range(n)]
    rows = []
    for i in picked:
        t = trajs[i]
        rows.append(
            {
                "task_id": t.task_id,
                "sample_index": t.sample_index,
                "reward": float(t.reward),
                "turns": t.turns,
                "finish_reason": t.finish_reason,
                "infra_fault": t.infra_fault,
                "conversation": conversation_text(t.messages, max_chars),
            }
        )
    return rows


__all__ = ["conversation_text", "prefix_cache_counts", "prefix_cache_hit_rate", "rollout_metrics", "sample_rows"]
