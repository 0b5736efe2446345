"""Pick the rollout engine backend from the config."""

from __future__ import annotations

import importlib.util
import logging

from actors.engine_api import RolloutEngine
from configs.schema import Config

log = logging.getLogger(__name__)


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


def make_engine(cfg: Config) -> RolloutEngine:
    """A rollout engine for `cfg` (not started: call `await engine.start()`)."""
    backend = choose_backend(cfg)
    log.info("rollout backend: %s (configured %s)", backend, cfg.rollout.backend)
    if backend == "vllm":
        from actors.vllm_engine import VLLMEngine

        return VLLMEngine(cfg)
    from actors.hf_engine import HFEngine

    return HFEngine(cfg)
