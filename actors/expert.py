"""The expert: each task's ground truth (`tool_sequence`, then the final answer) played as an engine.

`ExpertEngine` is a RolloutEngine whose "model" knows every task's expert turns
(`envs.parsing.expert_turns`: each call in the syntax the prompt teaches, ours (Hermes) with the tool
block in the system message, the template's own (`envs.prompting.call_syntax`) when the chat template
shows the tools; then `<answer>`). The EpisodeRunner drives it like any engine, so expert episodes are
laid out token for token as rollouts are. It is stateless per request: the task is the row whose last
prompt message appears in the decoded prompt before the first assistant header, the turn is the
number of assistant headers in the prompt (the generation prompt included) minus one; so any number
of episodes, of any task, may run at once. It serves the warm start below, the rollout benchmark
(bench/doubles.py) and the runner's tests.

Expert trajectories for the supervised warm start (`expert_trajectories`): a small model may never
make a correct tool call on its own, and then GRPO has no signal (see DESIGN.md, "a small model needs
a warm start"). The warm start trains on what a perfect agent would have generated: the EpisodeRunner
over the rows with an `ExpertEngine` (one episode per row), so that what SFT teaches is exactly what
the env will parse and what GRPO then continues from.

One row → one `Trajectory` (group_id = the row's index, sample_index 0):
- `prompt_ids`: the runner's (the chat template's ids of the env's first messages).
- per expert turn: `encode(text) + eot_ids`, loss_mask 1 on all of them (the model must learn to close
  its turn, so `appended_eot` is False: the end-of-turn is "generated"), rollout_logprobs 0.0 (SFT does
  not use them; 0.0 is a valid log-probability, so `Trajectory.check` holds);
- then, unless the env ended the episode, the observation delta (mask 0, logprob 0.0).

The episodes run against the tool client given (the offline pool: `jobs.sft.build_expert_trajectories`
builds one), with the heuristic reward whatever `reward.backend` says (the rewards are not trained on,
and a judge would cost money for nothing). The token budget (`rollout.max_total_tokens`) cuts an
expert trajectory where the runner cuts any rollout: a turn that does not fit in the room the runner
leaves is not started (`TurnDoesNotFit`; finish_reason `token_budget`, counted as truncated).

A row whose play fails is skipped, counted, and logged with its task id, since broken ground truth
must not teach the model: a row the env rejects, a call that errs or times out, a turn the env rejects
(parse error, unknown tool), an infrastructure fault, an episode the env ends early or leaves open, a
`tool_sequence` the env does not count as done, or an answer that does not earn the outcome.
A row without `reward_spec.ground_truth.tool_sequence` is bad input: `ValueError` before anything runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from actors.engine_api import EngineError, Generation, TurnDoesNotFit
from actors.episode_runner import EpisodeRunner, _task_id
from actors.template_tokens import ChatTemplate
from actors.trajectory import Trajectory
from configs.schema import Config, SamplingConfig
from envs.mcp_tool_env import MCPToolEnv
from envs.parsing import CallFormat, expert_turns
from envs.prompting import call_syntax

log = logging.getLogger(__name__)

MAX_CONCURRENT_ROWS = 8  # rows played at once: tool calls overlap, the token work is cheap


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


# --------------------------------------------------------------------------- the engine


class ExpertEngine:
    """A RolloutEngine that answers turn k of a task's episode with the task's k-th expert turn.

    `closes_turns` True (the warm start's layout): a turn is its text then the template's end-of-turn
    ids, all generated; a turn longer than `max_new_tokens` is refused (`TurnDoesNotFit`). False (as a
    sampling engine with the stop strings returns turns): a call ends on its `</tool_call>` (the runner
    closes the turn), the answer on EOS; a turn longer than `max_new_tokens` is cut (finish "length").
    `call_format`: how calls are written (default: the syntax the prompt teaches, `call_syntax`).
    `delay_s`: each generation's stand-in cost; `logprob`: every token's; `version`: the policy version.
    A request past the task's last turn, or whose task is not (or not uniquely) known, is an EngineError.
    """

    def __init__(
        self,
        tokenizer: Any,
        rows: Sequence[Mapping[str, Any]],
        *,
        closes_turns: bool = True,
        call_format: CallFormat | None = None,
        delay_s: float = 0.0,
        logprob: float = 0.0,
        version: int = 0,
    ) -> None:
        self.tok = tokenizer
        self.closes_turns = closes_turns
        self.delay_s = delay_s
        self.logprob = logprob
        self._version = version
        self.calls = 0
        template = ChatTemplate(tokenizer)
        probe = [{"role": "user", "content": "x"}]
        with_prompt, without = template.render(probe, True), template.render(probe, False)
        self.header = with_prompt[len(without) :].strip() if with_prompt.startswith(without) else ""
        if not self.header:
            raise ValueError("the chat template adds no assistant header for the generation prompt")
        fmt = call_format or call_syntax(tokenizer)
        self.scripts: list[tuple[str, list[list[int]]]] = []  # (the task's last prompt message, turn ids)
        for row in rows:
            texts = expert_turns(row, fmt)
            turns = []
            for text in texts:
                ids = template.encode(text)
                if closes_turns:
                    ids += template.eot_ids
                elif text.startswith("<answer>"):
                    ids.append(tokenizer.eos_token_id)  # the model closed its own turn
                turns.append(ids)
            self.scripts.append((prompt_key(row), turns))
        self._by_head: dict[str, list[list[int]]] = {}  # decoded first-turn prompt -> its task's turns

    async def start(self) -> None:
        return None

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Generation:
        self.calls += 1
        script, turn = self.locate(prompt_token_ids)
        if not 0 <= turn < len(script):
            raise EngineError(f"no expert turn {turn + 1}: the task has {len(script)}")
        ids = list(script[turn])
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            if self.closes_turns:
                raise TurnDoesNotFit(f"expert turn of {len(ids)} tokens > max_new_tokens {sampling.max_new_tokens}")
            ids, finish = ids[: sampling.max_new_tokens], "length"
        return Generation(
            token_ids=ids, logprobs=[self.logprob] * len(ids), finish_reason=finish, version=self._version
        )

    def locate(self, prompt_token_ids: Sequence[int]) -> tuple[list[list[int]], int]:
        """The turns (ids) of the prompt's task, and which turn the prompt asks for (0-based)."""
        text = self.tok.decode(list(prompt_token_ids), skip_special_tokens=False)
        return self._script(text[: text.find(self.header)]), text.count(self.header) - 1

    def _script(self, head: str) -> list[list[int]]:
        """The turns of the task whose last prompt message is in `head` (the longest such, when several)."""
        if head in self._by_head:
            return self._by_head[head]
        found = [(len(user), turns) for user, turns in self.scripts if user in head]
        if not found:
            raise EngineError("no task of this engine matches the prompt")
        longest = max(n for n, _ in found)
        candidates = [turns for n, turns in found if n == longest]
        if any(turns != candidates[0] for turns in candidates):
            raise EngineError("several tasks with different expert turns match the prompt")
        self._by_head[head] = candidates[0]
        return candidates[0]

    async def load_adapter(self, version: int, adapter: Any) -> None:
        self._version = version

    async def update_weights(self, version: int, chunks: Any) -> None:
        self._version = version

    def version(self) -> int:
        return self._version

    def stats(self) -> dict[str, Any]:
        return {"calls": self.calls}

    async def shutdown(self) -> None:
        return None


# --------------------------------------------------------------------------- expert play


async def expert_trajectories(
    cfg: Config, rows: list[dict], tokenizer: Any, tool_client: Any = None, *, stats: dict[str, Any] | None = None
) -> list[Trajectory]:
    """The expert trajectory of each playable row, in row order (failed rows skipped).

    `tool_client`: where the tools are; None = the env's own, from `cfg.env.tools` (default: in-process).

    `stats`, when given, is filled with {rows, played, skipped, skipped_tasks: {task_id: reason},
    truncated, generated_tokens, total_tokens}.
    """
    check_rows(rows)
    budget = cfg.rollout.max_total_tokens
    play_cfg = cfg.model_copy(
        update={
            "reward": cfg.reward.model_copy(update={"backend": "heuristic"}),
            "rollout": cfg.rollout.model_copy(update={"mode": "async"}),
        }
    )
    skipped: dict[str, str] = {}
    playable: list[tuple[int, dict]] = []
    for index, row in enumerate(rows):
        try:
            MCPToolEnv({"env": play_cfg.env, "reward": play_cfg.reward}, extras=row, tool_client=tool_client)
            playable.append((index, dict(row)))
        except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            _skip(skipped, row, index, f"the env rejects the row: {_short(e, 300)}")
    # The room the runner leaves is the only cap on a turn: the expert's turns are as long as they are.
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=budget, stop=[])
    played: dict[int, Trajectory] = {}
    # The engine knows a task by its prompt: rows that share one are played in separate rounds.
    for batch in _rounds(playable):
        tasks = [row for _, row in batch]
        engine = ExpertEngine(tokenizer, tasks)
        runner = EpisodeRunner(
            play_cfg,
            [engine],
            tokenizer,
            max_concurrent_episodes=MAX_CONCURRENT_ROWS,
            progress=False,
            tool_client=tool_client,
        )
        for (index, _), traj in zip(batch, await runner.run(tasks, 1, sampling), strict=True):
            played[index] = traj
    trajs: list[Trajectory] = []
    for index, row in playable:
        traj = played[index]
        traj.group_id, traj.task_id = index, _task_id(row, index)
        problem = _play_problem(traj, row, expert_turns(row, call_syntax(tokenizer)), budget)
        if problem:
            _skip(skipped, row, index, problem)
        else:
            trajs.append(traj)
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


def prompt_key(row: Mapping[str, Any]) -> str:
    """What `ExpertEngine` looks for in a prompt to know its task: the row's last prompt message."""
    return str(row["prompt"][-1]["content"]).strip()


def _rounds(rows: list[tuple[int, dict]]) -> list[list[tuple[int, dict]]]:
    """`rows` split, in order, into as few rounds as possible with no prompt key twice in a round."""
    rounds: list[tuple[set[str], list[tuple[int, dict]]]] = []
    for item in rows:
        key = prompt_key(item[1])
        for keys, batch in rounds:
            if key not in keys:
                keys.add(key)
                batch.append(item)
                break
        else:
            rounds.append(({key}, [item]))
    return [batch for _, batch in rounds]


def _skip(skipped: dict[str, str], row: Mapping[str, Any], index: int, why: str) -> None:
    task_id = _task_id(dict(row), index)
    skipped[task_id] = why
    log.warning("expert play of task %s (row %d) failed, row skipped: %s", task_id, index, why)


def _play_problem(traj: Trajectory, row: Mapping[str, Any], turns: list[str], budget: int) -> str | None:
    """Why an expert episode cannot teach the model, or None when it played as the ground truth says."""
    observations = _observations_by_turn(traj.messages)
    for k, meta in enumerate(traj.env_metadata):
        problem = _turn_problem(meta, observations[k] if k < len(observations) else [])
        if problem:
            return f"turn {k + 1} ({_short(turns[k])}): {problem}"
    if traj.finish_reason in ("done", "max_turns") and traj.turns < len(turns):
        rest, last = turns[traj.turns :], traj.env_metadata[-1]
        # A task without final_answer ends when its sequence is done: the empty answer turn is not played.
        if not (last.get("done_reason") == "sequence_complete" and rest == ["<answer></answer>"]):
            return f"the env ended the episode after turn {traj.turns} of {len(turns)} ({last.get('done_reason')})"
    if traj.finish_reason == "engine_failed":
        if traj.turns >= len(turns):
            return f"the episode is still open after all {len(turns)} expert turns"
        return "the expert engine failed (see the log)"
    if not traj.turns:
        return f"not even the first turn fits the token budget of {budget} (rollout.max_total_tokens)"
    if traj.finish_reason == "done":
        if not traj.env_metadata[-1].get("sequence_done"):
            return "the env does not count the tool_sequence as done after the expert calls"
        final = row["reward_spec"]["ground_truth"].get("final_answer")
        if final is not None and traj.tool_stats.get("reward/outcome", 0.0) <= 0:
            return "the expert answer does not earn the outcome reward (final_answer unreadable?)"
    return None


def _observations_by_turn(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The messages after each assistant turn, up to the next one (its tool results)."""
    out: list[list[dict[str, Any]]] = []
    for m in messages:
        if m.get("role") == "assistant":
            out.append([])
        elif out:
            out[-1].append(m)
    return out


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


__all__ = ["ExpertEngine", "check_rows", "expert_trajectories", "prompt_key"]
