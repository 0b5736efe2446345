"""One played episode, token-exact: what the learner trains on and what the driver scores.

`prompt_ids` is the chat template's rendering of the env's first messages with the generation prompt
(the tools in our system block, or through the template's `tools=`, which `messages` does not hold:
re-rendering them for such a template needs the tool definitions again). `response_ids` interleaves, turn by turn,
- the engine's generated ids (loss_mask 1, `rollout_logprobs` = the engine's logprobs), never
  retokenized, and
- template tokens the model did not choose (loss_mask 0, logprob 0.0): the end-of-turn token when
  the engine stopped on a stop string instead of EOS, then the observation delta (the tool
  messages and the next assistant header).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["done", "max_turns", "token_budget", "engine_failed"]
FINISH_REASONS: tuple[str, ...] = ("done", "max_turns", "token_budget", "engine_failed")


@dataclass
class Trajectory:
    task_id: str
    group_id: int  # index of the task in the runner's input: the GRPO group
    sample_index: int  # which of the group's `group_size` samples
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation the tokens render
    turn_rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    versions: list[int] = field(default_factory=list)  # policy version of each turn's generation
    turn_finish: list[str] = field(default_factory=list)  # the engine's finish_reason per turn
    appended_eot: list[bool] = field(default_factory=list)  # per turn: end-of-turn ids added by the runner
    env_metadata: list[dict[str, Any]] = field(default_factory=list)  # astep metadata per turn
    tool_stats: dict[str, Any] = field(default_factory=dict)  # MCPToolEnv.get_metrics()
    timings: dict[str, float] = field(default_factory=dict)  # generate_s, env_s, wait_s, total_s
    infra_fault: bool = False
    finish_reason: FinishReason = "done"
    restarts: int = 0
    engine: int = -1  # index of the engine that played the returned attempt
    missing_logprobs: int = 0

    @property
    def turns(self) -> int:
        return len(self.turn_rewards)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def generated_segments(self) -> list[list[int]]:
        """The engine's ids of each turn: the maximal runs of loss_mask 1."""
        segments: list[list[int]] = []
        previous = 0
        for token, m in zip(self.response_ids, self.loss_mask, strict=True):
            if m and not previous:
                segments.append([])
            if m:
                segments[-1].append(token)
            previous = m
        return segments

    def add_turn(
        self,
        generated: Sequence[int],
        logprobs: Sequence[float],
        text: str,
        step: Mapping[str, Any],
        *,
        closing: Sequence[int] = (),
        version: int,
        finish: str,
    ) -> None:
        """Record one assistant turn: the engine's `generated` ids (mask 1, with their `logprobs`), then
        the `closing` ids the runner appended to end the turn (mask 0, logprob 0.0; none when the engine
        closed it itself), the assistant message `text` (what the env read), and the env's answer to it
        (`step`: `MCPToolEnv.astep`'s output; its observations are added by `add_observations`)."""
        if len(logprobs) != len(generated):
            raise ValueError(f"{len(generated)} generated ids but {len(logprobs)} logprobs")
        self.response_ids += generated
        self.loss_mask += [1] * len(generated)
        self.rollout_logprobs += logprobs
        self.response_ids += closing
        self.loss_mask += [0] * len(closing)
        self.rollout_logprobs += [0.0] * len(closing)
        self.messages.append({"role": "assistant", "content": text})
        meta = dict(step.get("metadata") or {})
        self.turn_rewards.append(float(step["reward"]))
        self.versions.append(int(version))
        self.turn_finish.append(finish)
        self.appended_eot.append(bool(closing))
        self.env_metadata.append(meta)
        self.infra_fault = self.infra_fault or bool(meta.get("infra_fault"))

    def add_observations(self, messages: list[dict[str, Any]], delta: list[int], budget: int) -> bool:
        """Append tool messages and their template ids (mask 0, logprob 0.0) when they fit in `budget`
        tokens; otherwise mark the episode `token_budget` and append nothing. Returns whether they fit."""
        if len(self.prompt_ids) + len(self.response_ids) + len(delta) > budget:
            self.finish_reason = "token_budget"  # the observation does not fit: end before it
            return False
        self.messages += messages
        self.response_ids += delta
        self.loss_mask += [0] * len(delta)
        self.rollout_logprobs += [0.0] * len(delta)
        return True

    def check(self, max_total_tokens: int | None = None) -> None:
        """Raise ValueError naming the first broken invariant."""

        def fail(what: str) -> None:
            raise ValueError(f"trajectory {self.task_id}#{self.sample_index}: {what}")

        n = len(self.response_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            fail(f"lengths differ: response {n}, mask {len(self.loss_mask)}, logprobs {len(self.rollout_logprobs)}")
        if self.finish_reason not in FINISH_REASONS:
            fail(f"unknown finish_reason {self.finish_reason!r}")
        if not self.prompt_ids and self.finish_reason != "engine_failed":
            fail("empty prompt")
        if any(m not in (0, 1) for m in self.loss_mask):
            fail("loss_mask holds values other than 0/1")
        for i, (m, lp) in enumerate(zip(self.loss_mask, self.rollout_logprobs, strict=True)):
            if not m and lp != 0.0:
                fail(f"logprob {lp} at masked-out position {i} (must be 0.0)")
            if m and not (math.isfinite(lp) and lp <= 0.0):
                fail(f"logprob {lp} at generated position {i} is not a finite log-probability")
        turns = len(self.turn_rewards)
        for name in ("versions", "turn_finish", "appended_eot", "env_metadata"):
            if len(getattr(self, name)) != turns:
                fail(f"{name} has {len(getattr(self, name))} entries for {turns} turns")
        generated = len(self.generated_segments())
        if generated > turns:
            fail(f"{generated} generated segments for {turns} turns")
        if not math.isclose(self.reward, math.fsum(self.turn_rewards), abs_tol=1e-9):
            fail(f"reward {self.reward} is not the sum of turn rewards {self.turn_rewards}")
        if self.infra_fault is False and self.finish_reason == "engine_failed":
            fail("engine_failed without infra_fault")
        # A prompt alone over the budget gives a 0-turn trajectory (finish token_budget), not a broken one.
        if max_total_tokens is not None and n and len(self.prompt_ids) + n > max_total_tokens:
            fail(f"{len(self.prompt_ids) + n} tokens over the budget of {max_total_tokens}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_sample(self, advantage: float = 0.0, *, ppo: bool = False) -> dict[str, Any]:
        """The learner's sample of this episode, for GRPO, PPO and SFT alike: a plain dict of
        grpo.batch.Sample's fields (it crosses Ray as it is; the learner validates it with `as_sample`).
        `advantage`: the episode's (GRPO; SFT and PPO's per-token advantages do not read it). `ppo`: with
        `token_rewards`, each turn's reward on its last generated token (grpo.gae.token_rewards)."""
        sample: dict[str, Any] = {
            "prompt_ids": list(self.prompt_ids),
            "response_ids": list(self.response_ids),
            "loss_mask": list(self.loss_mask),
            "rollout_logprobs": list(self.rollout_logprobs),
            "advantage": float(advantage),
        }
        if ppo:
            from grpo.gae import token_rewards  # torch: only where samples are made, not wherever trajectories are

            sample["token_rewards"] = token_rewards(self.loss_mask, self.turn_rewards, self.reward)
        return sample


__all__ = ["FINISH_REASONS", "FinishReason", "Trajectory"]
