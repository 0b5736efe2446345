"""Which dtype a model computes in on a device: the config's, except on a CPU that has no kernels for it.

torch multiplies bf16 (and fp16) matrices on a CPU through oneDNN, which needs AVX-512 (bf16), AMX, or an ARM
core with bf16. Without them (an x86 CPU with AVX2 only) it falls back to a scalar loop: on a 2-core AMD EPYC
with AVX2 (torch 2.13, 2026-12-08) a 2048×576 by 576×1536 product took 3.25 s in bf16 against 33 ms in
float32 (1.1 against 111 GFLOP/s), and a GRPO step of the e2e suite's run (SmolLM2-135M) 500 s against 59 s.
So there `model.dtype` and `learner.dtype` of bfloat16 or float16 compute in float32, on every process that
loads a model (the learner, the HF and vLLM engines, the served model); GPUs keep the config's dtype.
Preflight's plan says so (`dtype_note`), and the learner group's line names the dtype it runs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from configs.schema import Config

_ONEDNN_CHECKS = {"bfloat16": "_is_mkldnn_bf16_supported", "float16": "_is_mkldnn_fp16_supported"}


@functools.cache
def cpu_has_kernels(dtype: str) -> bool:
    """Whether this CPU multiplies `dtype` matrices at speed (float32: always). Where torch cannot say (an
    older build without the check), the config's choice stands."""
    check = _ONEDNN_CHECKS.get(dtype)
    if check is None:
        return True
    import torch

    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):
        return True


def compute_dtype(dtype: str, device: str | torch.device | None = None) -> str:
    """`dtype` as it computes on `device` (None: this process's, a GPU where one is visible): float32 on a CPU
    without kernels for it, else `dtype`."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = device if isinstance(device, str) else device.type
    if kind.split(":")[0] != "cpu" or cpu_has_kernels(dtype):
        return dtype
    return "float32"


def for_device(cfg: Config, device: str | torch.device = "cpu") -> Config:
    """A copy of `cfg` whose `model.dtype` and `learner.dtype` are what computes on `device`; `cfg` itself
    when both stand."""
    model, learner = compute_dtype(cfg.model.dtype, device), compute_dtype(cfg.learner.dtype, device)
    if (model, learner) == (cfg.model.dtype, cfg.learner.dtype):
        return cfg
    return cfg.model_copy(
        update={
            "model": cfg.model.model_copy(update={"dtype": model}),
            "learner": cfg.learner.model_copy(update={"dtype": learner}),
        }
    )


def dtype_note(dtype: str) -> str:
    """For a CPU's plan line: '' where `dtype` computes as configured on this CPU, else what it becomes."""
    if compute_dtype(dtype, "cpu") == dtype:
        return ""
    return f" → float32 on this CPU (no {dtype} kernels: ~100× slower)"
