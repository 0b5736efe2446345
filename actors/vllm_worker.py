"""What vLLM runs inside its worker process (the engine core's, on CPU): `worker_extension_cls` of the
rollout engine (actors/vllm_engine.py), imported there by vLLM.

`reload_weights_quietly` is vLLM's `reload_weights` without its warnings about layers a pushed checkpoint
holds nothing for, which after every push read as errors: "<Layer>: Failed to load weights" for a rotary
embedding (its tables are computed, never stored) and, when the push cannot have changed it, the LM head
(tied to the embedding in small models, so not in the checkpoint; frozen under LoRA); and under LoRA, for every
weight outside the adapted blocks (a LoRA push holds only those: actors.engine_api.merged_push_is_partial),
both that warning and "Following weights were not loaded from checkpoint". vLLM keeps those tensors as they
were. Any other layer that loads nothing, and any weight left out inside a pushed block, still warns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cluster.console import quiet_third_party, verbose

quiet_third_party()  # this process's own vLLM notices (it is not the actor's process)

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_WARNING = "%s: Failed to load weights"
UNLOADED_LOGGER = "vllm.model_executor.model_loader.reload.inplace"
UNLOADED_WARNING = "Following weights were not loaded from checkpoint: %s"


class NothingToLoad(logging.Filter):
    """Drops the reload warning for layers named by one of `layer_suffixes`."""

    def __init__(self, layer_suffixes: tuple[str, ...]) -> None:
        super().__init__()
        self.layer_suffixes = layer_suffixes

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != RELOAD_WARNING or not record.args:
            return True
        return not str(record.args[0]).endswith(self.layer_suffixes)  # type: ignore[index]


class OutsidePushedBlocks(logging.Filter):
    """Drops the not-loaded-weights warning when every weight it names lies outside the pushed blocks."""

    def __init__(self, blocks: tuple[str, ...]) -> None:
        super().__init__()
        self.blocks = blocks

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != UNLOADED_WARNING or not record.args:
            return True
        names = record.args[0] if isinstance(record.args, tuple) else record.args
        return any(str(name).startswith(self.blocks) for name in names)  # type: ignore[union-attr]


def pushed_blocks(names: Iterable[str]) -> tuple[str, ...]:
    """The blocks a push holds, as name prefixes: 'model.layers.3.self_attn.' for
    'model.layers.3.self_attn.q_proj.weight' (vLLM's packed 'model.layers.3.self_attn.qkv_proj.weight' too)."""
    return tuple(sorted({name.rsplit(".", 2)[0] + "." for name in names if name.count(".") >= 2}))


def checkpoint_names(folder: str) -> list[str]:
    """The tensor names of a folder of safetensors files (their headers only)."""
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    return names


class QuietReload:
    """Mixed into vLLM's worker class; called with `collective_rpc("reload_weights_quietly", ...)`."""

    def reload_weights_quietly(self, head_unchanged: bool, partial: bool = False, **kwargs: Any) -> None:
        """`partial`: the push holds only the blocks LoRA adapts, so every other layer loads nothing, by design."""
        filters: list[tuple[logging.Logger, logging.Filter]] = []
        if not verbose():
            suffixes = ("RotaryEmbedding", "ParallelLMHead") if head_unchanged else ("RotaryEmbedding",)
            if partial:
                suffixes = ("",)  # every layer name ends with ""
            filters.append((logging.getLogger(RELOAD_LOGGER), NothingToLoad(suffixes)))
            if partial:
                blocks = pushed_blocks(checkpoint_names(kwargs["weights_path"]))
                filters.append((logging.getLogger(UNLOADED_LOGGER), OutsidePushedBlocks(blocks)))
        for logger, quiet in filters:
            logger.addFilter(quiet)
        try:
            self.reload_weights(**kwargs)  # type: ignore[attr-defined]
        finally:
            for logger, quiet in filters:
                logger.removeFilter(quiet)
