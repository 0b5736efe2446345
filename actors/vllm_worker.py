"""What vLLM runs inside its worker process (the engine core's, on CPU): `worker_extension_cls` of the
rollout engine (actors/vllm_engine.py), imported there by vLLM.

`reload_weights_quietly` is vLLM's `reload_weights` without its "<Layer>: Failed to load weights" warning
for layers a pushed checkpoint holds nothing for, which after every push read as errors: a rotary
embedding (its tables are computed, never stored) and, when the push cannot have changed it, the LM head
(tied to the embedding in small models, so not in the checkpoint; frozen under LoRA), and under LoRA every layer
outside the adapted blocks (a LoRA push holds only those: actors.engine_api.merged_push_is_partial). vLLM keeps
their tensors as they were. Any other layer that loads nothing still warns.
"""

from __future__ import annotations

import logging
from typing import Any

from cluster.console import quiet_third_party, verbose

quiet_third_party()  # this process's own vLLM notices (it is not the actor's process)

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_WARNING = "%s: Failed to load weights"


class NothingToLoad(logging.Filter):
    """Drops the reload warning for layers named by one of `layer_suffixes`."""

    def __init__(self, layer_suffixes: tuple[str, ...]) -> None:
        super().__init__()
        self.layer_suffixes = layer_suffixes

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != RELOAD_WARNING or not record.args:
            return True
        return not str(record.args[0]).endswith(self.layer_suffixes)  # type: ignore[index]


class QuietReload:
    """Mixed into vLLM's worker class; called with `collective_rpc("reload_weights_quietly", ...)`."""

    def reload_weights_quietly(self, head_unchanged: bool, partial: bool = False, **kwargs: Any) -> None:
        """`partial`: the push holds only the blocks LoRA adapts, so every other layer loads nothing, by design."""
        suffixes = ("RotaryEmbedding", "ParallelLMHead") if head_unchanged else ("RotaryEmbedding",)
        quiet = NothingToLoad(("",) if partial else suffixes)  # every name ends with ""
        logger = logging.getLogger(RELOAD_LOGGER)
        if not verbose():
            logger.addFilter(quiet)
        try:
            self.reload_weights(**kwargs)  # type: ignore[attr-defined]
        finally:
            logger.removeFilter(quiet)
