"""QLoRA (`finetune.mode: qlora`): the frozen base in 4 bit (bitsandbytes NF4, double quantization) with a
LoRA adapter on top, for one small GPU. The learner treats it as LoRA in every other respect.

- Loading: every nn.Linear of the base but the output layer becomes a bitsandbytes `Linear4bit` whose
  weight is a `Params4bit` (two 4-bit codes per byte, plus per-block scales); the forward computes in
  `learner.dtype`. PEFT's `prepare_model_for_kbit_training` then keeps the remaining (small) weights,
  norms and embeddings, in float32, as the QLoRA recipe does.
- Where it runs: CUDA, and bitsandbytes' CPU backend (measured with 0.50.2 on torch 2.13 CPU: tiny-random
  and SmolLM2-135M train); one rank only (`learner.workers: 1`): FSDP2 does not shard `Params4bit`.
- Weight pushes: `adapter` sends the adapter; the engines apply it over the unquantized base, so the
  learner/engine logprob gap also holds the quantization error (truncated IS corrects it). `merged` sends
  the dequantized 4-bit base with the adapter merged in (`W_nf4 + scaling·B@A`, in `model.dtype`): the
  engines then run exactly the policy the learner trains, rounded to `model.dtype`. Measured on SmolLM2-135M
  (bf16, r=16, 40 tokens of random sequences): mean |learner − engine| logprob 1.14 by adapter, 0.09 merged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel

    from configs.schema import ModelConfig

INSTALL_HINT = "pip install -e '.[qlora]' (bitsandbytes 0.50.2)"


class QloraUnavailableError(RuntimeError):
    """finetune.mode qlora where bitsandbytes cannot load a 4-bit model."""


def require_bitsandbytes() -> Any:
    """The bitsandbytes module, or QloraUnavailableError naming the config key, the cause and the fix."""
    try:
        import bitsandbytes
    except ImportError as e:
        raise QloraUnavailableError(
            f"finetune.mode qlora needs bitsandbytes, which does not import here ({e}): {INSTALL_HINT}"
        ) from e
    return bitsandbytes


def load_4bit_causal_lm(cfg: ModelConfig, compute_dtype: str, device: str | torch.device = "cpu") -> PreTrainedModel:
    """The model `cfg.name` with its linear layers in NF4 (double quantization), computing in `compute_dtype`,
    on `device`, prepared for k-bit training (non-quantized weights in float32, all frozen)."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from actors.models import resolve_model

    require_bitsandbytes()
    dtype = getattr(torch, compute_dtype)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            resolve_model(cfg.name, cfg.cache_dir),
            quantization_config=quant,
            dtype=dtype,
            device_map={"": str(device)},  # quantized where it will run (on a GPU: by CUDA kernels)
            local_files_only=True,
        )
    except (ImportError, RuntimeError, NotImplementedError) as e:
        raise QloraUnavailableError(
            f"finetune.mode qlora: bitsandbytes could not load model {cfg.name!r} in 4 bit on {device} ({e}). "
            f"It needs CUDA or bitsandbytes' CPU backend: {INSTALL_HINT}"
        ) from e
    layers = [m for m in model.modules() if is_4bit(getattr(m, "weight", None))]
    if not layers:
        raise QloraUnavailableError(f"finetune.mode qlora: model {cfg.name!r} has no layer that loaded in 4 bit")
    for layer in layers:
        # On a CPU with AVX512-BF16, a Linear4bit in eval mode without grad (the learner's scoring pass) repacks
        # its weight in place for an inference kernel (gemv_4bit) that has no backward; every later training
        # forward then uses it too, and the gradient through the base is silently wrong (measured: 176% off).
        layer.support_avx512bf16_for_cpu = False
    # Gradient checkpointing is the learner's own switch (learner.gradient_checkpointing), set after this.
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def is_4bit(param: Any) -> bool:
    """Whether a parameter is a bitsandbytes 4-bit weight (packed codes with a quantization state)."""
    return getattr(param, "quant_state", None) is not None


def numel(param: torch.Tensor) -> int:
    """Elements of the weight a parameter stands for: a 4-bit one's unpacked shape, not its packed bytes."""
    import math

    return int(math.prod(param.quant_state.shape)) if is_4bit(param) else param.numel()


def dequantize(param: torch.Tensor) -> torch.Tensor:
    """A 4-bit weight as a dense tensor of its original shape and dtype, on the CPU."""
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(param.data, param.quant_state).detach().to("cpu", copy=True)


def dequantized(
    model: nn.Module, named: Iterable[tuple[str, torch.Tensor | None]]
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """`named` (parameter name, tensor) of `model`, with every 4-bit weight replaced by its dense value."""
    params = dict(model.named_parameters())
    for name, tensor in named:
        param = params.get(name)
        yield name, dequantize(param) if tensor is not None and param is not None and is_4bit(param) else tensor
