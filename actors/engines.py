"""Build the rollout engine the config picks (the choice itself: actors.engine_api.choose_backend)."""

from __future__ import annotations

import logging

from actors.engine_api import RolloutEngine, choose_backend
from configs.schema import Config

log = logging.getLogger(__name__)


def make_engine(cfg: Config) -> RolloutEngine:
    """A rollout engine for `cfg` (not started: call `await engine.start()`)."""
    backend = choose_backend(cfg)
    log.info("rollout backend: %s (configured %s)", backend, cfg.rollout.backend)
    if backend == "vllm":
        from actors.vllm_engine import VLLMEngine

        return VLLMEngine(cfg)
    from actors.hf_engine import HFEngine

    return HFEngine(cfg)
