"""actors/engine_api.py: how the learner's weights reach the rollout engines (`weight_push`), by backend and mode."""

from __future__ import annotations

from actors.engine_api import weight_push
from configs.schema import Config


def test_weight_push_auto_is_merged_only_for_vllm_on_cpu() -> None:
    def resolve(**over: object) -> str:
        cfg = Config()
        for key, value in over.items():
            section, field = key.split("__")
            setattr(getattr(cfg, section), field, value)
        return weight_push(cfg)

    assert resolve(finetune__mode="full") == "full"  # the weights themselves, whatever weight_push says
    assert resolve(rollout__backend="vllm") == "merged"  # vLLM on CPU: its LoRA path is ~9x slower
    assert resolve(rollout__backend="hf") == "adapter"
    assert resolve(rollout__backend="hf", rollout__weight_push="merged") == "merged"
    assert resolve(rollout__backend="vllm", rollout__weight_push="adapter") == "adapter"
    # qlora: merged (the dequantized 4-bit base with the adapter in) whatever the engine; the adapter over the
    # unquantized base drifts from the learner's policy (mean logprob gap 1.14 vs 0.09 on SmolLM2-135M)
    assert resolve(finetune__mode="qlora", rollout__backend="vllm") == "merged"
    assert resolve(finetune__mode="qlora", rollout__backend="hf") == "merged"
    assert resolve(finetune__mode="qlora", rollout__backend="hf", rollout__weight_push="adapter") == "adapter"
    gpu = Config()
    gpu.rollout.backend = "vllm"
    gpu.rollout.engine_resources.num_gpus = 1
    assert weight_push(gpu) == "adapter"  # GPU LoRA kernels are fast
