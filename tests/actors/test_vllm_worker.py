"""actors/vllm_worker.py's reload filters, in process: after a partial LoRA push, vLLM's warnings about the weights
outside the pushed blocks stay off the console, while a weight left out inside a pushed block still warns.
(tests/actors/test_vllm_merged_push.py checks the console of a real vLLM engine after such a push.)"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from actors.vllm_worker import (
    RELOAD_LOGGER,
    RELOAD_WARNING,
    UNLOADED_LOGGER,
    UNLOADED_WARNING,
    QuietReload,
    checkpoint_names,
    pushed_blocks,
)
from cluster.console import VERBOSE_ENV


class Worker(QuietReload):
    """vLLM's worker as far as the filters see it: a reload that warns about what `unloaded` names."""

    def __init__(self, unloaded: set[str]) -> None:
        self.unloaded = unloaded

    def reload_weights(self, **kwargs: Any) -> None:
        for name in sorted(self.unloaded):
            logging.getLogger(RELOAD_LOGGER).warning(RELOAD_WARNING, f"{name} (RMSNorm)")
        logging.getLogger(UNLOADED_LOGGER).warning(UNLOADED_WARNING, self.unloaded)


def attention_push(folder: Path) -> str:
    save_file(
        {f"model.layers.{i}.self_attn.{p}_proj.weight": torch.zeros(2, 2) for i in (0, 1) for p in "qkvo"},
        str(folder / "model-00000.safetensors"),
    )
    return str(folder)


def test_pushed_blocks_are_the_prefixes_vllm_packed_names_share(tmp_path: Path) -> None:
    names = checkpoint_names(attention_push(tmp_path))
    assert len(names) == 8
    assert pushed_blocks(names) == ("model.layers.0.self_attn.", "model.layers.1.self_attn.")
    assert "model.layers.1.self_attn.qkv_proj.weight".startswith(pushed_blocks(names))


@pytest.mark.parametrize("partial", [True, False])
def test_weights_outside_a_partial_push_load_nothing_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, partial: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    outside = {"model.layers.0.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight"}
    with caplog.at_level(logging.WARNING):
        Worker(outside).reload_weights_quietly(False, partial=partial, weights_path=attention_push(tmp_path))
    said = caplog.text
    # a full push that leaves weights out is worth a warning; a LoRA push leaves them out by design
    assert ("not loaded from checkpoint" in said) is not partial
    assert ("Failed to load weights" in said) is not partial


def test_a_weight_left_out_inside_a_pushed_block_still_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = {"model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"}
    with caplog.at_level(logging.WARNING):
        Worker(missing).reload_weights_quietly(False, partial=True, weights_path=attention_push(tmp_path))
    assert "not loaded from checkpoint" in caplog.text and "self_attn.qkv_proj" in caplog.text
