"""One conformance suite for every rollout engine backend (HF transformers, vLLM), on tiny-random.

Each backend gets one engine for the module (vLLM starts in ~30-40 s). Tests that change the
engine's version (LoRA, weights) ask for versions above the current one and run last.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actors.engine_api import EngineError, Generation, RolloutEngine
from configs.schema import Config, SamplingConfig

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

MAX_MODEL_LEN = 512
PROMPT = [1, 2, 3, 400, 500, 6000, 77]
GREEDY = SamplingConfig(temperature=0, max_new_tokens=24, stop=[])

requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
BACKENDS = [pytest.param("hf", id="hf"), pytest.param("vllm", id="vllm", marks=[requires_vllm, pytest.mark.slow])]


def engine_config(backend: str) -> Config:
    return Config.model_validate(
        {
            "model": {"name": "tiny-random"},
            "finetune": {"mode": "lora", "lora": {"r": 8}},
            "rollout": {
                "backend": backend,
                "max_model_len": MAX_MODEL_LEN,
                "vllm_kv_cache_gb": 1,
                "hf_batch_wait_ms": 5,
                "weight_push": "adapter",  # LoRA versions as adapters (merged pushes: test_vllm_merged_push.py)
            },
        }
    )


@pytest.fixture(scope="module", params=BACKENDS)
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[RolloutEngine]:
    from actors.engines import make_engine

    eng = make_engine(engine_config(request.param))
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()


def make_adapter(seed: int) -> dict[str, Any]:
    """A PEFT LoRA on tiny-random with random non-zero B matrices (so outputs change)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from actors.models import load_causal_lm

    torch.manual_seed(seed)
    model = get_peft_model(
        load_causal_lm(Config().model),
        LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
        ),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    return {"config": model.peft_config["default"].to_dict(), "state_dict": get_peft_model_state_dict(model)}


def check_generation(gen: Generation) -> None:
    assert gen.token_ids, "no tokens"
    assert len(gen.logprobs) == len(gen.token_ids)
    assert all(math.isfinite(x) and x <= 0 for x in gen.logprobs)
    assert gen.missing_logprobs == 0
    assert gen.finish_reason in ("stop", "length")


class TestConformance:
    async def test_generates_with_logprobs(self, engine: RolloutEngine) -> None:
        gen = await engine.generate(PROMPT, SamplingConfig(temperature=1.0, max_new_tokens=20, stop=[], seed=1))
        check_generation(gen)
        assert len(gen.token_ids) == 20 and gen.finish_reason == "length"
        assert gen.version == engine.version()

    async def test_logprobs_match_a_plain_forward_pass(self, engine: RolloutEngine) -> None:
        """The chosen-token logprobs are log_softmax of the raw logits: what the learner computes."""
        import torch

        from actors.models import load_causal_lm

        gen = await engine.generate(PROMPT, SamplingConfig(temperature=0.7, max_new_tokens=12, stop=[], seed=3))
        model = load_causal_lm(Config().model).float()
        ids = torch.tensor([PROMPT + gen.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        # bf16 engine vs fp32 reference: close, not equal (tiny-random logprobs are ~ -10).
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=0.15), (gen.logprobs, expected.tolist())

    async def test_same_seed_same_tokens(self, engine: RolloutEngine) -> None:
        sampling = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=16, stop=[], seed=1234)
        first = await engine.generate(PROMPT, sampling)
        second = await engine.generate(PROMPT, sampling)
        other = await engine.generate(PROMPT, sampling.model_copy(update={"seed": 99}))
        assert first.token_ids == second.token_ids
        assert other.token_ids != first.token_ids

    async def test_concurrent_requests_with_different_knobs(self, engine: RolloutEngine) -> None:
        samplings = [
            SamplingConfig(temperature=0, max_new_tokens=5, stop=[]),
            SamplingConfig(temperature=1.0, top_p=0.5, max_new_tokens=9, stop=[], seed=1),
            SamplingConfig(temperature=0.8, repetition_penalty=1.3, max_new_tokens=13, stop=[], seed=2),
        ]
        gens = await asyncio.gather(*(engine.generate(PROMPT[: 3 + i], s) for i, s in enumerate(samplings)))
        for gen, s in zip(gens, samplings, strict=True):
            check_generation(gen)
            assert len(gen.token_ids) == s.max_new_tokens

    async def test_stop_string_ends_and_stays_in_output(self, engine: RolloutEngine) -> None:
        from actors.models import load_tokenizer

        tok = load_tokenizer(Config().model)
        seeded = SamplingConfig(temperature=1.0, max_new_tokens=24, stop=[], seed=7)
        full = await engine.generate(PROMPT, seeded)
        # A stop string: the text of the first generated token whose text is new in the output.
        k = next(
            i for i in range(1, len(full.token_ids))
            if (t := tok.decode([full.token_ids[i]]).strip()) and t not in tok.decode(full.token_ids[:i])
        )  # fmt: skip
        stop = tok.decode([full.token_ids[k]]).strip()
        gen = await engine.generate(PROMPT, seeded.model_copy(update={"stop": [stop]}))
        assert gen.finish_reason == "stop"
        assert gen.token_ids == full.token_ids[: k + 1]
        assert tok.decode(gen.token_ids).endswith(stop)

    async def test_bad_requests_fail_cleanly(self, engine: RolloutEngine) -> None:
        with pytest.raises(EngineError, match="empty prompt"):
            await engine.generate([], GREEDY)
        with pytest.raises(EngineError, match="max_model_len"):
            await engine.generate([5] * (MAX_MODEL_LEN - 10), GREEDY.model_copy(update={"max_new_tokens": 20}))
        check_generation(await engine.generate(PROMPT, GREEDY))  # the engine still serves

    async def test_lora_changes_outputs_and_versions_pin(self, engine: RolloutEngine) -> None:
        v1, v2 = engine.version() + 1, engine.version() + 2
        base = await engine.generate(PROMPT, GREEDY)
        await engine.load_adapter(v1, make_adapter(1))
        assert engine.version() == v1
        long = GREEDY.model_copy(update={"max_new_tokens": 300})
        v1_alone = await engine.generate(PROMPT, long)
        assert v1_alone.version == v1
        assert v1_alone.token_ids[: len(base.token_ids)] != base.token_ids

        # A request starts on v1; v2 is loaded while it runs; a v2 request runs beside it.
        running = asyncio.create_task(engine.generate(PROMPT, long))
        await asyncio.sleep(0.05)  # let it start (sequencing only: the assertions hold either way)
        await engine.load_adapter(v2, make_adapter(2))
        assert engine.version() == v2
        on_v2 = await engine.generate(PROMPT, GREEDY)
        on_v1 = await running
        assert on_v1.version == v1 and on_v1.token_ids == v1_alone.token_ids
        assert on_v2.version == v2 and on_v2.token_ids != v1_alone.token_ids[: len(on_v2.token_ids)]
        # v1 is no longer pinned by any request: it is gone.
        assert engine.stats()["adapters_loaded_now"] == [v2]
        if engine.stats()["backend"] == "hf":  # v2 could not reuse v1's slot (pinned): a second one
            assert engine.stats()["adapter_slots"] == 2

    async def test_a_reused_adapter_slot_never_changes_a_running_request(self, engine: RolloutEngine) -> None:
        """v1 runs a long request; v2, then v3 are loaded meanwhile: v3 takes v2's place (HF: its slot,
        copied in place), never v1's. The v1 request's tokens are those of v1 alone."""
        v1 = engine.version() + 1
        long = GREEDY.model_copy(update={"max_new_tokens": 300})
        await engine.load_adapter(v1, make_adapter(5))
        v1_alone = await engine.generate(PROMPT, long)
        running = asyncio.create_task(engine.generate(PROMPT, long))
        await asyncio.sleep(0.05)
        await engine.load_adapter(v1 + 1, make_adapter(6))
        await engine.load_adapter(v1 + 2, make_adapter(7))
        on_v3 = await engine.generate(PROMPT, GREEDY)
        on_v1 = await running
        assert on_v1.version == v1 and on_v1.token_ids == v1_alone.token_ids
        assert on_v3.version == v1 + 2 and on_v3.token_ids != v1_alone.token_ids[: len(on_v3.token_ids)]
        assert engine.stats()["adapters_loaded_now"] == [v1 + 2]
        if engine.stats()["backend"] == "hf":
            assert engine.stats()["adapter_slots"] <= 3  # grown only while every slot was taken

    async def test_both_adapter_forms_load_the_same_adapter(self, engine: RolloutEngine) -> None:
        """{"config", "safetensors"} (what the learner exports) and {"config", "state_dict"} serve alike."""
        from actors.adapter_io import pack_adapter

        plain = make_adapter(3)
        blob = pack_adapter(plain["config"], plain["state_dict"])
        await engine.load_adapter(engine.version() + 1, plain)
        from_plain = await engine.generate(PROMPT, GREEDY)
        await engine.load_adapter(engine.version() + 1, blob)
        from_blob = await engine.generate(PROMPT, GREEDY)
        assert from_blob.version == engine.version() == from_plain.version + 1
        assert from_blob.token_ids == from_plain.token_ids
        assert from_blob.logprobs == pytest.approx(from_plain.logprobs, abs=1e-4)
        # Not the previous adapter's outputs: the load really replaced it.
        await engine.load_adapter(engine.version() + 1, make_adapter(4))
        assert (await engine.generate(PROMPT, GREEDY)).token_ids != from_blob.token_ids
        if engine.stats()["backend"] == "hf":  # sequential loads reuse slots: no growth per version
            assert engine.stats()["adapter_slots"] <= 3
        with pytest.raises(EngineError, match="one of 'safetensors'"):
            await engine.load_adapter(engine.version() + 1, {"config": plain["config"]})
        with pytest.raises(EngineError, match="not a safetensors file"):
            await engine.load_adapter(engine.version() + 1, {"config": plain["config"], "safetensors": b"junk"})

    async def test_seeded_requests_beyond_one_batch_then_lora_serves_the_merged_model(
        self, engine: RolloutEngine
    ) -> None:
        """More prompt tokens in flight than one engine step takes, every request seeded: vLLM would prefill
        some in chunks and rewind their seeded generators, which kills a CPU engine; ours waits instead. Then a
        learner's adapter through LoRA generates as PEFT's merged model does: with test_vllm_merged_push.py,
        what a merged push serves is what LoRA serves (jobs.evaluate merges on CPU). Before the weight update
        below, which changes the base."""
        import torch

        from tests.actors.test_vllm_merged_push import SAMPLING, changed_learner, chosen_logprobs

        prompts = [[100 + (i * 37 + j) % 40_000 for j in range(300)] for i in range(40)]  # 12,000 tokens
        outs = await asyncio.gather(
            *(engine.generate(p, SamplingConfig(temperature=1.0, max_new_tokens=4, stop=[], seed=i))
              for i, p in enumerate(prompts))
        )  # fmt: skip
        assert all(len(o.token_ids) == 4 for o in outs)
        cfg = engine_config(engine.stats()["backend"])
        cfg.learner.dtype = "float32"
        learner, merged = changed_learner(cfg)
        version = engine.version() + 1
        await engine.load_adapter(version, learner.export_adapter())
        out = await engine.generate(PROMPT, SAMPLING)
        got, want = torch.tensor(out.logprobs), chosen_logprobs(merged, PROMPT, out.token_ids)
        assert out.version == version and torch.allclose(got, want, atol=0.15), (got.tolist(), want.tolist())

    async def test_update_weights_changes_outputs(self, engine: RolloutEngine) -> None:
        import torch

        from actors.models import load_causal_lm

        before = await engine.generate(PROMPT, GREEDY)
        state = load_causal_lm(Config().model).state_dict()
        torch.manual_seed(0)
        # Sent layer by layer, as a learner would; a different model: the base plus noise.
        chunks: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in state.items():
            group = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
            noisy = tensor.float() + 0.05 * torch.randn(tensor.shape)
            chunks.setdefault(group, {})[name] = noisy.to(tensor.dtype)
        version = engine.version() + 1
        await engine.update_weights(version, iter(chunks.values()))
        assert engine.version() == version
        after = await engine.generate(PROMPT, GREEDY)
        check_generation(after)
        assert after.version == version
        assert after.token_ids != before.token_ids
