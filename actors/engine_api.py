"""What every rollout engine offers, whatever its backend (vLLM or HF transformers).

`RolloutEngine` implementations are plain classes (Ray actors where they are wired): the episode
runner only ever calls these methods, so the backends are interchangeable and share one
conformance test suite.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Protocol

from configs.schema import Config, SamplingConfig


class EngineError(RuntimeError):
    """A request the engine cannot serve (empty prompt, prompt over the context length, ...): the
    request's fault; the engine goes on serving others."""


class TurnDoesNotFit(EngineError):
    """The engine will not start a turn it cannot finish within `max_new_tokens` (a scripted engine knows
    its turn's length beforehand, see actors/expert.py): the runner ends the episode at the token
    budget, as when no room is left, instead of recording a cut turn."""


class EngineUnavailable(RuntimeError):
    """The engine cannot serve anything (not started, shut down, its generation loop crashed): the
    runner moves the episode to another engine. Deliberately not an EngineError."""


def check_request(prompt: list[int], sampling: SamplingConfig, max_model_len: int, vocab_size: int) -> None:
    """Refuse what no backend can serve, with the same message whichever backend it is."""
    if not prompt:
        raise EngineError("empty prompt: at least one prompt token is needed")
    if len(prompt) + sampling.max_new_tokens > max_model_len:
        raise EngineError(
            f"prompt of {len(prompt)} tokens + max_new_tokens {sampling.max_new_tokens} exceeds "
            f"max_model_len {max_model_len}"
        )
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise EngineError(f"prompt token ids must lie in [0, {vocab_size})")


@dataclass
class Generation:
    """One generation: the engine's own token ids, never retokenized."""

    token_ids: list[int]
    logprobs: list[float]  # of each chosen token, aligned with token_ids
    finish_reason: str  # "stop" | "length" | "abort"
    version: int  # the policy version (adapter or weights) that produced every token
    missing_logprobs: int = 0  # tokens whose logprob the engine did not return (floored, see rollout config)
    timings: dict[str, float] = field(default_factory=dict)


class RolloutEngine(Protocol):
    async def start(self) -> None:
        """Load the model; called once before anything else (in the actor, so the engine lives there)."""

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Generation: ...

    async def load_adapter(self, version: int, adapter: dict[str, Any]) -> None:
        """Make LoRA `adapter` (PEFT state dict + its config) the version new requests get.
        Requests already running finish on the version they started with."""

    async def update_weights(self, version: int, chunks: Any) -> None:
        """Full fine-tune: replace the weights in place from an iterable of {name: tensor} chunks."""

    def version(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    async def shutdown(self) -> None: ...


# The backend and the push mode are read by the engines themselves (vllm_engine) and by whoever builds them
# (engines.make_engine), so they live here, below both.


def vllm_available() -> bool:
    """Whether `import vllm` can work here (looked up, not imported: importing it takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def choose_backend(cfg: Config) -> str:
    """The backend, "vllm" or "hf". auto: vLLM for LoRA runs when it is installed; HF otherwise, and HF for a full
    fine-tune (vLLM's weight reload goes through tmpfs files; HF copies in place)."""
    backend = cfg.rollout.backend
    if backend != "auto":
        return backend
    if cfg.finetune.trains_adapter and vllm_available():
        return "vllm"
    return "hf"


def merged_push_is_partial(cfg: Config) -> bool:
    """Whether a merged push holds only the blocks that LoRA adapts (`Learner._adapted_blocks`), the engines
    keeping every other weight as they loaded it: LoRA. QLoRA pushes everything: its engines must get the
    learner's dequantized 4-bit base, not the base they loaded."""
    return cfg.finetune.mode == "lora"


def weight_push(cfg: Config) -> str:
    """What the learner pushes to the engines: "full" (finetune.mode full: the weights), "adapter" or
    "merged" (LoRA: `rollout.weight_push`; auto is merged for vLLM engines on CPU, where generating
    through a LoRA adapter is ~9x slower than through plain weights, and adapter elsewhere; QLoRA's auto
    is always merged: an adapter applied over the unquantized base is not the policy the learner trains)."""
    if not cfg.finetune.trains_adapter:
        return "full"
    if cfg.rollout.weight_push != "auto":
        return cfg.rollout.weight_push
    if cfg.finetune.mode == "qlora":
        return "merged"
    on_cpu = cfg.rollout.engine_resources.num_gpus == 0
    return "merged" if on_cpu and choose_backend(cfg) == "vllm" else "adapter"
