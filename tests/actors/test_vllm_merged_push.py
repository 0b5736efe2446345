"""rollout.weight_push merged on a real vLLM engine (tiny-random): a LoRA learner's merged weights, pushed
as a full-weight update to an engine started without LoRA, make it generate as PEFT's merged model does."""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import torch

from actors.engine_api import EngineError
from configs.schema import Config, SamplingConfig

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.slow,
]

PROMPT = [1, 2, 3, 400, 500, 6000, 77]
SAMPLING = SamplingConfig(temperature=0.7, max_new_tokens=12, stop=[], seed=3)


def merged_config(weight_push: str = "auto") -> Config:
    return Config.model_validate(
        {
            "model": {"name": "tiny-random"},
            "finetune": {"mode": "lora", "lora": {"r": 8}},
            "learner": {"dtype": "float32"},
            "rollout": {"backend": "vllm", "max_model_len": 512, "vllm_kv_cache_gb": 1, "weight_push": weight_push},
        }
    )


def chosen_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def changed_learner(cfg: Config) -> tuple[Any, torch.nn.Module]:
    """A LoRA learner whose adapter really changes the model (PEFT starts B at 0), and PEFT's merged model."""
    from actors.learner import Learner

    learner = Learner(cfg)
    learner.setup()
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return learner, copy.deepcopy(learner.model).merge_and_unload().float()


async def test_merged_push_serves_the_merged_model(capfd: pytest.CaptureFixture[str]) -> None:
    from actors.engine_api import weight_push
    from actors.engines import make_engine
    from actors.models import load_causal_lm

    cfg = merged_config()
    assert weight_push(cfg) == "merged"  # auto: vLLM on CPU
    assert weight_push(merged_config("adapter")) == "adapter"
    learner, merged = changed_learner(cfg)
    chunks = learner.export_weights()
    assert chunks is not None
    base = load_causal_lm(Config().model).float()

    engine = make_engine(cfg)
    await engine.start()
    try:
        assert engine.stats()["lora"] is False  # started without LoRA: the faster path
        with pytest.raises(EngineError, match="started without LoRA"):
            await engine.load_adapter(1, learner.export_adapter())
        before = await engine.generate(PROMPT, SAMPLING)
        await engine.update_weights(1, chunks)
        after = await engine.generate(PROMPT, SAMPLING)
        stats = engine.stats()
    finally:
        await engine.shutdown()

    assert before.version == 0 and after.version == 1 and engine.version() == 1
    assert after.token_ids != before.token_ids
    got = torch.tensor(after.logprobs)
    want = chosen_logprobs(merged, PROMPT, after.token_ids)
    was = chosen_logprobs(base, PROMPT, after.token_ids)
    # bf16 engine vs fp32 reference: close, not equal; the base model scores the same tokens far off.
    assert torch.allclose(got, want, atol=0.15), (got.tolist(), want.tolist())
    assert (got - was).abs().mean() > 5 * (got - want).abs().mean()
    assert stats["weight_updates"] == 1 and stats["prefix_cache_queries"] >= len(PROMPT)
    assert 0 <= stats["prefix_cache_hits"] <= stats["prefix_cache_queries"]
    # vLLM's worker warned after every push about the layers a checkpoint never holds (rotary tables, the tied
    # LM head under LoRA, every block outside the adapted ones): actors/vllm_worker.py keeps that off the console
    # (capfd: the worker's own output; vLLM logs to stdout).
    said = "".join(capfd.readouterr())
    assert "Failed to load weights" not in said and "not loaded from checkpoint" not in said
