"""The learner at world size 1, in-process, on tiny-random: GRPO and SFT steps learn, adapters and
weights reach the HF engine, checkpoints resume bit for bit."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from actors.adapter_io import adapter_safetensors, adapter_state_dict, pack_adapter
from actors.hf_engine import HFEngine
from actors.learner import CheckpointError, Learner
from actors.precision import compute_dtype
from configs.schema import Config, SamplingConfig

PROMPT_LEN = 8
CHOSEN = [1500, 2500, 3500, 4500, 5500, 6500]  # the "good" response every sample carries


def make_cfg(mode: str = "lora", lr: float = 1e-2, **learner: object) -> Config:
    cfg = Config()
    cfg.finetune.mode = mode
    cfg.finetune.lora.r = 8
    cfg.learner.optim.lr = lr
    for k, v in learner.items():
        setattr(cfg.learner, k, v)
    return cfg


def fixed_batch(n: int = 4, advantage: float = 1.0) -> list[dict]:
    """n samples with different prompts and the chosen response; token 3 of it is an observation (mask 0)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        prompt = torch.randint(100, 40_000, (PROMPT_LEN,), generator=g).tolist()
        mask = [1, 1, 1, 0, 1, 1]
        out.append(
            {
                "prompt_ids": prompt,
                "response_ids": list(CHOSEN),
                "loss_mask": mask,
                "rollout_logprobs": [-10.8 * m for m in mask],
                "advantage": advantage,
            }
        )
    return out


def chosen_logprob(learner: Learner, batch: list[dict]) -> float:
    """Mean logprob of the trained (mask 1) response tokens."""
    rows = learner.score(batch)
    vals = [lp for row, s in zip(rows, batch, strict=True) for lp, m in zip(row, s["loss_mask"], strict=True) if m]
    return sum(vals) / len(vals)


def trained(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def lora_learner() -> Learner:
    """A LoRA learner (with a KL reference: the adapter disabled) after three GRPO steps."""
    cfg = make_cfg("lora")
    cfg.algorithm.kl_coef = 0.01
    learner = Learner(cfg)
    info = learner.setup()
    assert info["world_size"] == 1 and 0 < info["trainable"] < info["params"]
    batch = fixed_batch()
    learner.before = chosen_logprob(learner, batch)  # type: ignore[attr-defined]
    learner.history = [learner.train_step(batch) for _ in range(3)]  # type: ignore[attr-defined]
    return learner


@pytest.fixture(scope="module")
def full_learner() -> Learner:
    learner = Learner(make_cfg("full", lr=1e-3))
    info = learner.setup()
    assert info["trainable"] == info["params"]
    batch = fixed_batch()
    learner.before = chosen_logprob(learner, batch)  # type: ignore[attr-defined]
    learner.history = [learner.train_step(batch) for _ in range(2)]  # type: ignore[attr-defined]
    return learner


def test_lora_grpo_raises_logprob_of_advantaged_tokens(lora_learner: Learner) -> None:
    after = chosen_logprob(lora_learner, fixed_batch())
    assert after > lora_learner.before + 0.1
    first, *_, last = lora_learner.history
    expected = {"policy_loss", "kl", "ratio_mean", "ratio_std", "clip_frac", "entropy", "grad_norm", "lr"}
    expected |= {"logprob_gap", "tokens", "samples", "step_time_s", "tokens_per_s"}
    assert expected <= set(first)
    assert "ratio_std_after_first" not in first  # one optimizer step per iteration
    assert all(isinstance(v, float) and v == v for v in first.values())
    assert first["tokens"] == 4 * 5 and first["samples"] == 4
    assert first["lr"] == pytest.approx(1e-2)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # the adapter starts as the identity
    assert last["kl"] > 0  # the policy has left the reference
    assert first["grad_norm"] > 0 and first["tokens_per_s"] > 0


def test_full_mode_grpo_raises_logprob_of_advantaged_tokens(full_learner: Learner) -> None:
    after = chosen_logprob(full_learner, fixed_batch())
    assert after > full_learner.before + 0.1


def test_several_minibatches_and_epochs() -> None:
    cfg = make_cfg("lora", micro_batch_tokens=64)
    cfg.train.minibatches = 2
    cfg.train.epochs = 2
    cfg.learner.optim.warmup_steps = 2
    learner = Learner(cfg)
    learner.setup()
    m = learner.train_step(fixed_batch(6))
    assert learner.step == 4 and learner.iteration == 1
    assert m["ratio_std_after_first"] > 0  # later minibatches see the updated policy
    assert m["lr"] == pytest.approx(1e-2)  # the 4th step's lr: warmup (2 steps) is over
    assert m["samples"] == 6


def test_sft_step_lowers_nll() -> None:
    cfg = make_cfg("lora")
    cfg.sft_warmup.lr = 1e-2
    learner = Learner(cfg)
    learner.setup()
    batch = [{k: v for k, v in s.items() if k in ("prompt_ids", "response_ids", "loss_mask")} for s in fixed_batch()]
    losses = [learner.sft_step(batch)["sft_loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.1
    with pytest.raises(ValueError, match="loss_mask 1"):
        learner.sft_step([{**batch[0], "loss_mask": [0] * len(CHOSEN)}])


def test_after_a_warm_start_the_reference_is_the_warm_started_policy(lora_learner: Learner) -> None:
    """With sft_warmup (and kl_coef > 0) the reference is a frozen adapter copy, which reset_reference
    sets to the policy after the SFT steps: the first GRPO step starts at KL 0, not at the base model."""
    cfg = make_cfg("lora")
    cfg.algorithm.kl_coef = 0.05
    cfg.sft_warmup.enabled = True
    cfg.sft_warmup.lr = 1e-2
    learner = Learner(cfg)
    assert learner.setup()["reference"] == "adapter"
    sft = [{k: v for k, v in s.items() if k in ("prompt_ids", "response_ids", "loss_mask")} for s in fixed_batch()]
    for _ in range(2):
        learner.sft_step(sft)
    params = dict(learner.model.named_parameters())
    pairs = [(n, n.replace(".reference.", ".default.")) for n in params if ".reference." in n]
    assert pairs and any(not torch.equal(params[r], params[p]) for r, p in pairs)  # SFT moved the policy only
    assert learner.reset_reference() == "adapter"
    assert all(torch.equal(params[r], params[p]) for r, p in pairs)
    assert learner.train_step(fixed_batch())["kl"] < 1e-4  # ~0.39 against the base (no reset): measured
    # Without a copy (the base model under the disabled adapter) there is nothing to set.
    with pytest.raises(ValueError, match="cannot move"):
        lora_learner.reset_reference()


def test_bad_sample_is_named() -> None:
    learner = Learner(make_cfg("lora"))
    learner.setup()
    bad = fixed_batch(2)
    bad[1] = {**bad[1], "loss_mask": [1, 1]}
    with pytest.raises(ValueError, match="sample 1: loss_mask"):
        learner.train_step(bad)


def test_exported_adapter_loads_into_hf_engine_and_changes_it(lora_learner: Learner, tmp_path: Path) -> None:
    adapter = lora_learner.export_adapter()
    assert adapter is not None
    json.dumps(adapter["config"])  # JSON-able
    assert set(adapter) == {"config", "safetensors"} and isinstance(adapter["safetensors"], bytes)
    tensors = adapter_state_dict(adapter)
    assert all(".default." not in k and "lora_" in k for k in tensors)
    assert all(t.device.type == "cpu" for t in tensors.values())
    # The blob is the learner's own adapter, tensor for tensor.
    params = dict(lora_learner.model.named_parameters())
    key = next(iter(tensors))
    assert torch.equal(tensors[key], params[key.replace(".weight", ".default.weight")].detach().cpu())
    again_blob = lora_learner.export_adapter()  # the second export maps keys from a cache: the same bytes
    assert again_blob is not None and again_blob["safetensors"] == adapter["safetensors"]
    prompt = fixed_batch(1)[0]["prompt_ids"]

    async def go() -> tuple[list[float], list[float], int]:
        engine = HFEngine(Config())
        await engine.start()
        try:
            sampling = SamplingConfig(temperature=0, max_new_tokens=4, stop=[])
            base = (await engine.generate(prompt, sampling)).logprobs
            await engine.load_adapter(1, adapter)
            tuned = await engine.generate(prompt, sampling)
            return base, tuned.logprobs, tuned.version
        finally:
            await engine.shutdown()

    base, tuned, version = asyncio.run(go())
    assert version == 1
    assert max(abs(a - b) for a, b in zip(base, tuned, strict=False)) > 1e-3

    # PEFT format on disk: PEFT itself loads it, and a learner can start from it.
    lora_learner.save_adapter(str(tmp_path / "adapter"))
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == adapter["safetensors"]
    cfg = make_cfg("lora")
    cfg.finetune.init_adapter = str(tmp_path / "adapter")
    warm = Learner(cfg)
    warm.setup()
    again = warm.export_adapter()
    assert again is not None
    again_tensors = adapter_state_dict(again)
    assert again_tensors.keys() == tensors.keys()
    for k, v in tensors.items():
        assert torch.equal(again_tensors[k], v), k


def test_adapter_wire_forms_round_trip_and_bad_ones_are_named() -> None:
    state = {"base_model.model.x.lora_A.weight": torch.arange(6.0).reshape(2, 3)}
    packed = pack_adapter({"r": 2, "target_modules": {"q_proj"}}, state)
    assert packed["config"] == {"r": 2, "target_modules": ["q_proj"]}  # sets become JSON lists
    bf16 = {"base_model.model.y.lora_B.weight": torch.randn(3, 2).to(torch.bfloat16)}
    views = adapter_state_dict(pack_adapter({}, {**state, **bf16}), copy=False)  # zero-copy views of the blob
    assert views.keys() == {*state, *bf16}
    for k, v in {**state, **bf16}.items():
        assert views[k].dtype == v.dtype and torch.equal(views[k], v), k
    for form in (packed, {"config": packed["config"], "state_dict": state}):
        got = adapter_state_dict(form)
        assert got.keys() == state.keys() and torch.equal(
            got["base_model.model.x.lora_A.weight"], state[next(iter(state))]
        )
        assert adapter_state_dict({"config": {}, "safetensors": adapter_safetensors(form)}).keys() == state.keys()
    with pytest.raises(ValueError, match="one of 'safetensors'"):
        adapter_state_dict({"config": {}})
    with pytest.raises(ValueError, match="one of 'safetensors'"):
        adapter_state_dict({"config": {}, "state_dict": state, "safetensors": b""})
    with pytest.raises(ValueError, match="must be bytes"):
        adapter_state_dict({"config": {}, "safetensors": state})
    with pytest.raises(ValueError, match="not a safetensors file"):
        adapter_state_dict({"config": {}, "safetensors": b"not a safetensors file"})


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_on_policy_step_reuses_the_forward_and_matches_the_scoring_pass(kl_coef: float) -> None:
    """epochs = minibatches = 1: old_t from the training forward gives the same metrics and update as
    the separate no-grad scoring pass (ratio 1, gradient ∇log π); the logprob gap is still measured."""

    def run(reuse: bool) -> tuple[Learner, dict[str, float], list[str]]:
        cfg = make_cfg("lora", micro_batch_tokens=64)  # 5 samples of 14 tokens: 2 micro-batches
        cfg.algorithm.kl_coef = kl_coef
        learner = Learner(cfg)
        learner.setup()
        learner.reuse_forward_logprobs = reuse
        calls: list[str] = []
        score = learner._score

        def spy(batch, reference=True, policy=True):  # type: ignore[no-untyped-def]
            calls.append("policy" if policy else "reference-only")
            return score(batch, reference, policy)

        learner._score = spy  # type: ignore[method-assign]
        return learner, learner.train_step(fixed_batch(5)), calls

    fast, m_fast, calls_fast = run(True)
    slow, m_slow, calls_slow = run(False)
    assert calls_fast == ["reference-only"] and calls_slow == ["policy"]
    assert m_fast.keys() == m_slow.keys()
    for k in ("policy_loss", "kl", "ratio_mean", "ratio_std", "clip_frac", "entropy", "logprob_gap", "grad_norm"):
        assert m_fast[k] == pytest.approx(m_slow[k], rel=1e-4, abs=1e-6), k
    assert m_fast["ratio_mean"] == pytest.approx(1.0) and m_fast["ratio_std"] == pytest.approx(0.0, abs=1e-6)
    assert m_fast["logprob_gap"] > 0.01  # measured: rollout logprobs are -10.8, the policy's differ
    assert m_fast["tokens"] == m_slow["tokens"] == 5 * 5 and m_fast["samples"] == 5
    assert m_fast["grad_norm"] > 0
    fast_params, slow_params = trained(fast), trained(slow)
    assert fast_params.keys() == slow_params.keys()
    for name, value in slow_params.items():  # the same update (after one AdamW step)
        assert torch.allclose(fast_params[name], value, rtol=1e-4, atol=1e-6), name


def test_several_optimizer_steps_per_iteration_keep_the_scoring_pass() -> None:
    """π_old differs from the policy after the first optimizer step: old_t needs the separate pass (the reuse
    above holds only for epochs = minibatches = 1; one run, not one per kl_coef above)."""
    cfg = make_cfg("lora")
    cfg.train.epochs = 2
    multi = Learner(cfg)
    multi.setup()
    seen: list[bool] = []
    score = multi._score
    multi._score = lambda b, reference=True, policy=True: (seen.append(policy), score(b, reference, policy))[1]  # type: ignore[method-assign]
    multi.train_step(fixed_batch(2))
    assert seen == [True]


def test_exported_weights_update_hf_engine(full_learner: Learner) -> None:
    chunks = full_learner.export_weights(max_chunk_bytes=1)  # every layer its own chunk
    assert chunks is not None
    base_names = {n for n, _ in full_learner.model.named_parameters()}
    seen = [n for c in chunks for n in c]
    assert sorted(seen) == sorted(base_names) and len(seen) == len(set(seen))
    assert "model.layers.0.self_attn.q_proj.weight" in seen
    for chunk in chunks:  # whole layers: one layer per chunk, never split
        layers = {".".join(n.split(".")[:3]) for n in chunk if n.startswith("model.layers.")}
        assert len(layers) <= 1
    layer0 = next(c for c in chunks if "model.layers.0.mlp.up_proj.weight" in c)
    assert sum(n.startswith("model.layers.0.") for n in layer0) == 9  # 7 linears + 2 norms
    whole = full_learner.export_weights()
    assert whole is not None and len(whole) == 1  # all fits one default-sized chunk
    sent = getattr(torch, compute_dtype("bfloat16"))  # model.dtype as this CPU computes it (actors/precision.py)
    assert all(t.dtype == sent for t in whole[0].values())
    prompt = fixed_batch(1)[0]["prompt_ids"]

    async def go() -> tuple[list[float], list[float], int]:
        engine = HFEngine(Config())
        await engine.start()
        try:
            sampling = SamplingConfig(temperature=0, max_new_tokens=4, stop=[])
            before = (await engine.generate(prompt, sampling)).logprobs
            await engine.update_weights(1, chunks)
            after = await engine.generate(prompt, sampling)
            return before, after.logprobs, after.version
        finally:
            await engine.shutdown()

    before, after, version = asyncio.run(go())
    assert version == 1
    assert max(abs(a - b) for a, b in zip(before, after, strict=False)) > 1e-3


def test_export_matches_mode(full_learner: Learner) -> None:
    with pytest.raises(ValueError, match="use export_weights"):
        full_learner.export_adapter()


def test_lora_export_weights_are_peft_merge_and_unload() -> None:
    """LoRA `export_weights` (rollout.weight_push merged): the base model's names and PEFT's own merge of
    the trained adapter, key by key; the trained parameters (and the reference adapter) are untouched."""
    import copy

    cfg = make_cfg("lora", dtype="float32")
    cfg.model.dtype = "float32"
    cfg.algorithm.kl_coef = 0.01
    cfg.learner.reference = "ema"  # a second adapter ("reference") that must not be merged
    learner = Learner(cfg)
    learner.setup()
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator(p.device).manual_seed(len(name)))
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}

    chunks = learner.export_weights(max_chunk_bytes=1)
    assert chunks is not None and len(chunks) > 1
    got = {k: v for c in chunks for k, v in c.items()}
    assert sum(len(c) for c in chunks) == len(got)  # each name once

    reference = copy.deepcopy(learner.model).merge_and_unload(adapter_names=["default"])
    merged = dict(reference.named_parameters())
    # only the attention blocks, which hold the adapted q, k, v, o: every other weight is the engines' own
    want = {k: v for k, v in merged.items() if ".self_attn." in k}
    assert got.keys() == want.keys()
    for k, v in merged.items():
        if k not in want:
            torch.testing.assert_close(v, before[f"base_model.model.{k}"], msg=k)
    assert "model.layers.0.self_attn.q_proj.weight" in got and not any("lora_" in k for k in got)
    changed = 0
    for k, v in want.items():
        assert got[k].dtype == torch.float32 and got[k].shape == v.shape, k
        torch.testing.assert_close(got[k], v.detach().cpu(), rtol=1e-5, atol=1e-6, msg=k)  # exported to the CPU
        base = before.get(f"base_model.model.{k}".replace(".weight", ".base_layer.weight"))
        changed += base is not None and not torch.equal(base.cpu(), got[k])
    assert changed == 4 * 2  # q, k, v, o of tiny-random's two layers: the adapter is really in
    after = dict(learner.model.named_parameters())
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n].detach(), t) for n, t in before.items())


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_checkpoint_round_trip_is_exact(mode: str, tmp_path: Path) -> None:
    def make() -> Learner:
        cfg = make_cfg(mode, lr=1e-2 if mode == "lora" else 1e-3)
        cfg.algorithm.kl_coef = 0.05
        cfg.learner.reference = "ema"  # a moving reference: its state is checkpointed too
        cfg.learner.reference_ema = 0.5
        cfg.learner.reference_every = 1  # it moves after every step (tests/actors/test_reference.py: every N)
        cfg.learner.optim.schedule = "cosine"
        cfg.train.steps = 4
        learner = Learner(cfg)
        learner.setup()
        return learner

    batch = fixed_batch()
    first = make()
    first.train_step(batch)
    first.save_checkpoint(str(tmp_path / "ckpt"), {"data_position": 17, "epoch": [1, 2]})
    assert not list(tmp_path.glob(".ckpt.tmp-*"))  # the temporary folder was renamed
    expected_metrics = first.train_step(batch)
    expected = trained(first)
    del first

    second = make()
    extra = second.load_checkpoint(str(tmp_path / "ckpt"))
    assert extra == {"data_position": 17, "epoch": [1, 2]}
    assert second.step == 1 and second.iteration == 1
    metrics = second.train_step(batch)
    for k in ("policy_loss", "kl", "ratio_mean", "grad_norm", "lr"):
        assert metrics[k] == expected_metrics[k], k
    got = trained(second)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    # saving over an existing checkpoint replaces it
    second.save_checkpoint(str(tmp_path / "ckpt"), {"data_position": 18})
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["extra"] == {"data_position": 18}


def test_bad_checkpoint_folder_is_a_clear_error(lora_learner: Learner, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        lora_learner.load_checkpoint(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"meta\.json"):
        lora_learner.load_checkpoint(str(tmp_path / "empty"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "meta.json").write_text(json.dumps({"format": 1, "mode": "full"}))
    with pytest.raises(CheckpointError, match="'full' model"):
        lora_learner.load_checkpoint(str(tmp_path / "other"))
    with pytest.raises(ValueError, match="JSON"):
        lora_learner.save_checkpoint(str(tmp_path / "x"), {"bad": object()})


def test_bad_setup_inputs() -> None:
    with pytest.raises(ValueError, match="rank 2"):
        Learner(make_cfg(), rank=2, world_size=2, master_port=1234)
    cfg = make_cfg()
    cfg.finetune.init_adapter = "/nonexistent/adapter"
    with pytest.raises(FileNotFoundError, match="init_adapter"):
        Learner(cfg).setup()


@pytest.mark.parametrize(("kl_coef", "entropy_coef", "epochs"), [(0.0, 0.0, 1), (0.05, 0.01, 2)])
def test_selective_logits_give_the_full_paths_metrics_and_update(
    kl_coef: float, entropy_coef: float, epochs: int
) -> None:
    """The LM head only at trained positions (learner.selective_logits) is the same computation: the same
    metrics and parameters after GRPO steps (with a KL reference, an entropy term, a scoring pass) and
    after an SFT step, over two micro-batches; the LM head then saw only the trained positions."""

    def run(selective: bool) -> tuple[dict[str, float], dict[str, float], dict[str, torch.Tensor]]:
        # float32: on CUDA, bf16 products of different shapes (K kept rows or all) round differently (1% in kl)
        cfg = make_cfg("lora", micro_batch_tokens=64, selective_logits=selective, dtype="float32")
        cfg.model.dtype = "float32"
        cfg.algorithm.kl_coef = kl_coef
        cfg.algorithm.entropy_coef = entropy_coef
        cfg.train.epochs = epochs
        learner = Learner(cfg)
        learner.setup()
        rows: list[int] = []
        head = learner.model.get_output_embeddings()
        hook = head.register_forward_hook(lambda _m, _a, out: rows.append(out.shape[0] * out.shape[1]))
        sft = learner.sft_step(fixed_batch(3))
        grpo = learner.train_step(fixed_batch(5, advantage=0.5))
        hook.remove()
        # A micro-batch of n samples of 14 tokens, 5 trained: n·5 + 1 logit rows instead of n·14.
        assert set(rows) <= ({3 * 5 + 1, 4 * 5 + 1, 1 * 5 + 1} if selective else {3 * 14, 4 * 14, 1 * 14}), rows
        return sft, grpo, trained(learner)

    sft_a, grpo_a, params_a = run(True)
    sft_b, grpo_b, params_b = run(False)
    assert sft_a["sft_loss"] == pytest.approx(sft_b["sft_loss"], rel=1e-3) and sft_a["tokens"] == sft_b["tokens"]
    assert grpo_a.keys() == grpo_b.keys()
    for k in ("policy_loss", "kl", "ratio_mean", "clip_frac", "entropy", "logprob_gap", "grad_norm", "tokens"):
        if k in grpo_b:
            assert grpo_a[k] == pytest.approx(grpo_b[k], rel=2e-3, abs=1e-5), k
    assert grpo_a["entropy"] > 0
    for name, value in params_b.items():  # Adam turns float32 rounding into ~5e-5 on a few elements; a step is ~1e-2
        assert torch.allclose(params_a[name], value, rtol=1e-3, atol=1e-4), name


def grouped_batch(groups: int = 3, group_size: int = 4) -> list[dict]:
    """GRPO-shaped: `groups` prompts of 10-20 tokens, each with `group_size` responses of 3-12 tokens
    (an observation token here and there: loss mask 0), shuffled."""
    import random

    rng = random.Random(0)
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(100, 40_000) for _ in range(rng.randint(10, 20))]
        for _ in range(group_size):
            mask = [int(rng.random() > 0.3) for _ in range(rng.randint(3, 12))]
            out.append(
                {
                    "prompt_ids": prompt,
                    "response_ids": [rng.randrange(100, 40_000) for _ in mask],
                    "loss_mask": mask,
                    "rollout_logprobs": [-10.8 * m for m in mask],
                    "advantage": rng.gauss(0.0, 1.0),
                }
            )
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("micro_batch_tokens", [64, 4096])
def test_shared_prompt_rows_give_the_same_steps_on_fewer_tokens(micro_batch_tokens: int) -> None:
    """learner.shared_prompt: each group's prompt computed once, its responses attending to it, gives the
    plain path's metrics and parameters (a KL term against an EMA reference adapter, an entropy term, two
    epochs; at 64 tokens per micro-batch groups are split into several rows), and the model reads fewer
    tokens."""

    def run(shared: bool) -> tuple[dict[str, float], dict[str, torch.Tensor], int]:
        cfg = make_cfg("lora", micro_batch_tokens=micro_batch_tokens, shared_prompt=shared, dtype="float32")
        cfg.model.dtype = "float32"
        cfg.algorithm.kl_coef = 0.05
        cfg.algorithm.entropy_coef = 0.01
        cfg.learner.reference, cfg.learner.reference_every = "ema", 1
        cfg.train.epochs = 2
        learner = Learner(cfg)
        learner.setup()
        read: list[int] = []
        embed = learner.model.get_input_embeddings()
        hook = embed.register_forward_hook(lambda _m, args, _out: read.append(int(args[0].numel())))
        batch = grouped_batch()
        learner.train_step(batch)
        metrics = learner.train_step(batch)
        hook.remove()
        return metrics, trained(learner), sum(read)

    shared, params_a, read_a = run(True)
    plain, params_b, read_b = run(False)
    for k in ("policy_loss", "kl", "ratio_mean", "entropy", "logprob_gap", "grad_norm", "tokens"):
        assert shared[k] == pytest.approx(plain[k], rel=1e-4, abs=1e-6), k
    for name, value in params_b.items():  # float32 rounding, through Adam, as in the selective-logits test
        assert torch.allclose(params_a[name], value, rtol=1e-3, atol=1e-4), name
    assert read_a < read_b


def test_groups_of_long_responses_run_whole_with_the_same_steps() -> None:
    """learner.shared_prompt_when cheaper: a group whose responses are long against its prompt runs as whole
    episodes, without a mask (grpo.batch.share_pays), and gives the always-shared path's metrics and
    parameters; a group of short responses is still shared."""
    rng = torch.Generator().manual_seed(1)

    def group(prompt_len: int, response_len: int) -> list[dict]:
        prompt = torch.randint(100, 40_000, (prompt_len,), generator=rng).tolist()
        return [
            {
                "prompt_ids": prompt,
                "response_ids": torch.randint(100, 40_000, (response_len + k,), generator=rng).tolist(),
                "loss_mask": [1] * (response_len + k),
                "rollout_logprobs": [-10.8] * (response_len + k),
                "advantage": float(k) - 1.5,
            }
            for k in range(4)
        ]

    long_group, short_group = group(8, 120), group(120, 4)

    def run(when: str) -> tuple[dict[str, float], dict[str, torch.Tensor], list[str]]:
        cfg = make_cfg("lora", shared_prompt_when=when, dtype="float32")
        cfg.model.dtype = "float32"
        learner = Learner(cfg)
        learner.setup()
        masks: list[str] = []
        hook = learner.model.register_forward_pre_hook(
            lambda _m, _args, kw: masks.append("none" if kw.get("attention_mask") is None else "rows"),
            with_kwargs=True,
        )
        metrics = learner.train_step(long_group + short_group)
        hook.remove()
        return metrics, trained(learner), masks

    cheaper, params_a, masks_a = run("cheaper")
    always, params_b, masks_b = run("always")
    assert sorted(masks_a) == ["none", "rows"] and masks_b == ["rows"]
    for k in ("policy_loss", "ratio_mean", "logprob_gap", "grad_norm", "tokens"):
        assert cheaper[k] == pytest.approx(always[k], rel=1e-4, abs=1e-6), k
    for name, value in params_b.items():
        assert torch.allclose(params_a[name], value, rtol=1e-3, atol=1e-4), name


def test_no_padding_mask_gives_the_same_steps() -> None:
    """learner.pad_mask false: right-padded episodes go to attention without a mask (the causal one hides
    the padding), and an SFT step then a GRPO step on episodes of different lengths (each whole) give the
    masked path's metrics and parameters."""

    def run(pad_mask: bool) -> tuple[dict[str, float], dict[str, float], dict[str, torch.Tensor], list[bool]]:
        cfg = make_cfg("lora", shared_prompt=False, pad_mask=pad_mask, dtype="float32")
        cfg.model.dtype = "float32"
        learner = Learner(cfg)
        learner.setup()
        masked: list[bool] = []
        hook = learner.model.register_forward_pre_hook(
            lambda _m, _args, kwargs: masked.append(kwargs.get("attention_mask") is not None), with_kwargs=True
        )
        batch = grouped_batch()
        sft = learner.sft_step(batch)
        grpo = learner.train_step(batch)
        hook.remove()
        return sft, grpo, trained(learner), masked

    sft_a, grpo_a, params_a, masked_a = run(False)
    sft_b, grpo_b, params_b, masked_b = run(True)
    assert masked_a and masked_b and not any(masked_a) and all(masked_b)
    assert sft_a["sft_loss"] == pytest.approx(sft_b["sft_loss"], rel=1e-5)
    for k in ("policy_loss", "ratio_mean", "logprob_gap", "grad_norm", "tokens"):
        assert grpo_a[k] == pytest.approx(grpo_b[k], rel=1e-4, abs=1e-6), k
    for name, value in params_b.items():
        assert torch.allclose(params_a[name], value, rtol=1e-3, atol=1e-4), name


def test_dr_grpo_divides_by_a_constant_whatever_the_micro_batches() -> None:
    """advantage dr_grpo: the loss is Σ tokens / (N_seq · dr_grpo_norm_tokens), not / its token count.
    fixed_batch(4) has 4 × 5 = 20 trained tokens; with L_max = 10 the constant is 40, so the gradient is
    20/40 = half the token mean's. The same with 1 or 4 micro-batches. lr ≈ 0: the steps barely move the
    policy, so the four steps see the same one."""
    cfg = make_cfg("lora", lr=1e-12)
    cfg.learner.optim.grad_clip = 1e9  # grad_norm is the norm before clipping; keep clipping out of it
    cfg.algorithm.dr_grpo_norm_tokens = 10
    learner = Learner(cfg)
    learner.setup()
    batch = fixed_batch(4)
    token_mean = learner.train_step(batch)["grad_norm"]
    cfg.algorithm.advantage = "dr_grpo"
    assert learner.dr_grpo_norm_tokens == 10
    dr = learner.train_step(batch)
    cfg.learner.micro_batch_tokens = 64  # one 14-token sample per micro-batch
    dr_split = learner.train_step(batch)
    assert dr["grad_norm"] == pytest.approx(0.5 * token_mean, rel=1e-4)
    assert dr_split["grad_norm"] == pytest.approx(dr["grad_norm"], rel=1e-4)
    assert dr["policy_loss"] == pytest.approx(dr_split["policy_loss"], rel=1e-4)  # a per-token mean, as before
    cfg.algorithm.dr_grpo_norm_tokens = None  # the default: the episode's generation budget
    assert learner.dr_grpo_norm_tokens == cfg.rollout.sampling.max_new_tokens * cfg.generation.max_turns


def ppo_batch(n: int = 4) -> list[dict]:
    """fixed_batch with PPO's per-token rewards: 0.5 for turn 1 (tokens 0-2), 1.0 for turn 2 (tokens 4-5)."""
    from grpo.gae import token_rewards

    return [{**s, "token_rewards": token_rewards(s["loss_mask"], [0.5, 1.0])} for s in fixed_batch(n)]


def make_ppo(mode: str) -> Learner:
    cfg = make_cfg(mode, lr=1e-2 if mode == "lora" else 1e-3)
    cfg.algorithm.name = "ppo"
    cfg.algorithm.kl_coef = 0.01
    cfg.learner.reference = "ema"  # a moving reference: blended from the policy without its value head
    learner = Learner(cfg)
    learner.setup()
    return learner


def value_head(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters() if "value_head" in n}


def test_ppo_trains_a_value_head_that_checkpoints_resume_and_engines_never_see(tmp_path: Path) -> None:
    """algorithm.name ppo, LoRA: the value head trains beside the adapter (value_loss falls on a fixed
    batch), is saved in checkpoints and restored on resume (the next step is then the same), and is
    neither in the adapter nor in the merged weights pushed to the engines."""
    first = make_ppo("lora")
    head = value_head(first)
    assert set(head) == {"value_head.weight", "value_head.bias"} and all(not t.any() for t in head.values())
    batch = ppo_batch()
    history = [first.train_step(batch) for _ in range(3)]
    for key in ("value_loss", "value_mean", "value_clip_frac", "explained_variance", "returns_mean"):
        assert all(key in m and m[key] == m[key] for m in history), key
    assert history[0]["value_mean"] == 0.0  # zero-initialised: V = 0 before the first update
    assert history[-1]["value_loss"] < history[0]["value_loss"]
    assert history[-1]["value_mean"] > 0.1  # moving towards the returns (≈ 1.2 here)
    assert history[0]["returns_mean"] > 1.0
    assert any(t.any() for t in value_head(first).values())

    adapter = adapter_state_dict(first.export_adapter())
    assert adapter and not any("value" in k for k in adapter)
    pushed = [k for chunk in first.iter_weights() for k in chunk]
    assert pushed and not any("value_head" in k for k in pushed)

    first.save_checkpoint(str(tmp_path / "ckpt"), {})
    saved_head = value_head(first)
    expected = first.train_step(batch)
    expected_head = value_head(first)
    second = make_ppo("lora")
    second.load_checkpoint(str(tmp_path / "ckpt"))
    for name, value in value_head(second).items():
        assert torch.equal(value, saved_head[name]), name
    got = second.train_step(batch)
    for k in ("policy_loss", "value_loss", "value_mean", "explained_variance", "grad_norm"):
        assert got[k] == expected[k], k
    for name, value in value_head(second).items():
        assert torch.equal(value, expected_head[name]), name

    with pytest.raises(ValueError, match="sample 0 has no token_rewards"):
        second.train_step(fixed_batch())


def test_ppo_full_fine_tune_keeps_the_value_head_out_of_the_weights_and_reference() -> None:
    learner = make_ppo("full")
    m = learner.train_step(ppo_batch())
    assert m["value_loss"] > 0 and learner.ref_kind == "model"
    assert not any("value_head" in n for n, _ in learner.reference.named_parameters())
    pushed = [k for chunk in learner.iter_weights() for k in chunk]
    assert "lm_head.weight" in pushed or "model.embed_tokens.weight" in pushed
    assert not any("value_head" in k for k in pushed)
