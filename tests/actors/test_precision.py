"""Which dtype computes where: the config's on a GPU and on a CPU with kernels for it, float32 on a CPU
without (actors/precision.py)."""

from __future__ import annotations

import pytest
import torch

from actors import precision
from actors.precision import compute_dtype, dtype_note, for_device
from configs.schema import Config


@pytest.fixture
def no_bf16_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU like an AVX2-only x86 one, whatever this machine has."""
    monkeypatch.setattr(precision, "cpu_has_kernels", lambda dtype: dtype == "float32")


def test_a_cpu_without_kernels_computes_in_float32_and_a_gpu_keeps_the_config(no_bf16_kernels: None) -> None:
    assert compute_dtype("bfloat16", "cpu") == "float32"
    assert compute_dtype("float16", torch.device("cpu")) == "float32"
    assert compute_dtype("float32", "cpu") == "float32"
    assert compute_dtype("bfloat16", "cuda") == "bfloat16"
    assert compute_dtype("bfloat16", torch.device("cuda", 1)) == "bfloat16"
    assert "float32 on this CPU" in dtype_note("bfloat16") and dtype_note("float32") == ""

    cfg = Config()
    cfg.model.dtype, cfg.learner.dtype = "bfloat16", "bfloat16"
    on_cpu = for_device(cfg, "cpu")
    assert (on_cpu.model.dtype, on_cpu.learner.dtype) == ("float32", "float32")
    assert (cfg.model.dtype, cfg.learner.dtype) == ("bfloat16", "bfloat16")  # a copy: the caller's stays
    assert for_device(cfg, "cuda") is cfg


def test_a_cpu_with_kernels_keeps_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "cpu_has_kernels", lambda dtype: True)
    cfg = Config()
    cfg.model.dtype, cfg.learner.dtype = "bfloat16", "bfloat16"
    assert for_device(cfg, "cpu") is cfg
    assert dtype_note("bfloat16") == ""


def test_this_machines_answer_is_torchs_and_the_learner_runs_it() -> None:
    # What oneDNN says it has kernels for: the same answer compute_dtype gives on this machine.
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert precision.cpu_has_kernels("bfloat16") is native
    from actors.learner import Learner

    cfg = Config()
    cfg.finetune.mode = "lora"
    cfg.model.dtype, cfg.learner.dtype = "bfloat16", "bfloat16"
    learner = Learner(cfg)
    info = learner.setup()
    expected = "bfloat16" if native else "float32"
    assert info["dtype"] == expected
    frozen = {p.dtype for p in learner.model.parameters() if not p.requires_grad}  # PEFT keeps its adapter in fp32
    assert frozen == {getattr(torch, expected)}


def test_no_device_means_this_process_s_device(no_bf16_kernels: None) -> None:
    expected = "bfloat16" if torch.cuda.is_available() else "float32"
    assert compute_dtype("bfloat16") == expected
