"""finetune.mode qlora at the learner, in-process on tiny-random with bitsandbytes' CPU backend: the base is
4-bit, the adapter learns with the same gradient as over the dense dequantized base, the KL reference works,
merged pushes dequantize, checkpoints resume exactly; and what cannot run is refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from actors.learner import Learner
from actors.models import count_parameters, resolve_model
from actors.precision import compute_dtype
from configs.loader import ConfigError, load_config
from tests.actors.test_learner import chosen_logprob, fixed_batch, make_cfg, trained

bnb = pytest.importorskip("bitsandbytes", reason="finetune.mode qlora needs the `qlora` extra (make install has it)")
COMPUTE = getattr(torch, compute_dtype("bfloat16"))  # bf16, or float32 on a CPU without its kernels

from actors.qlora import QloraUnavailableError, dequantize, is_4bit  # noqa: E402


def qlora_cfg(**learner: object) -> object:
    cfg = make_cfg("qlora", **learner)
    cfg.finetune.lora.target_modules = ["q_proj", "v_proj", "up_proj"]  # mlp gate/down stay plain 4-bit
    return cfg


@pytest.fixture(scope="module")
def qlora_learner() -> Learner:
    """QLoRA in bf16 compute, KL reference = the 4-bit base with the adapter disabled, after three steps."""
    cfg = qlora_cfg()
    cfg.algorithm.kl_coef = 0.01
    learner = Learner(cfg)
    learner.info = learner.setup()  # type: ignore[attr-defined]
    batch = fixed_batch()
    learner.before = chosen_logprob(learner, batch)  # type: ignore[attr-defined]
    learner.history = [learner.train_step(batch) for _ in range(3)]  # type: ignore[attr-defined]
    return learner


def test_qlora_base_is_4bit_and_the_adapter_learns(qlora_learner: Learner) -> None:
    model = qlora_learner.model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n}
    four_bit = {n for n, m in linears.items() if isinstance(m, bnb.nn.Linear4bit)}
    # every linear of the decoder is 4-bit (wrapped by LoRA or not); the output layer stays dense
    assert four_bit == {n for n in linears if ".layers." in n} and len(four_bit) == 2 * 7
    assert all(isinstance(linears[n].weight, bnb.nn.Params4bit) for n in four_bit)
    assert all(linears[n].weight.quant_state.quant_type == "nf4" for n in four_bit)
    assert all(linears[n].compute_dtype == COMPUTE for n in four_bit)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    # the parameter count is the unpacked one: the stored model's plus the adapter's
    base_params = count_parameters(resolve_model("tiny-random"))
    assert qlora_learner.info["params"] == base_params + sum(p.numel() for p in trainable.values())  # type: ignore[attr-defined]
    assert qlora_learner.info["reference"] == "disabled_adapter"  # type: ignore[attr-defined]

    first, *_, last = qlora_learner.history  # type: ignore[attr-defined]
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and last["kl"] > 0  # the 4-bit base is the reference
    assert last["policy_loss"] != first["policy_loss"] and first["grad_norm"] > 0
    assert chosen_logprob(qlora_learner, fixed_batch()) > qlora_learner.before + 0.1  # type: ignore[attr-defined]


def test_gradient_through_the_4bit_base_is_the_dense_dequantized_ones() -> None:
    """After a no-grad scoring pass (which on an AVX512-BF16 CPU used to repack the weights for an inference
    kernel without backward), the adapter's gradient equals the one through dense copies of the
    dequantized weights."""
    from grpo.batch import as_sample

    learner = Learner(qlora_cfg(dtype="float32"))
    learner.setup()
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:  # B = 0 at init: give the adapter a real path
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    batch = fixed_batch()
    learner.score(batch)
    assert not any(
        getattr(p.quant_state, "packing_format_for_cpu", False) for p in learner.model.parameters() if is_4bit(p)
    )
    packed = learner._pack([as_sample(s, i) for i, s in enumerate(batch)])

    def grads() -> dict[str, torch.Tensor]:
        learner.model.train()
        learner.model.zero_grad()
        logp, _ = learner._token_logprobs(learner.model, packed, selective=False)
        (logp * packed["loss_mask"]).sum().backward()
        return {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.requires_grad}

    through_4bit = grads()
    for parent in list(learner.model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=False)
                dense.weight = torch.nn.Parameter(dequantize(child.weight).float(), requires_grad=False)
                setattr(parent, child_name, dense)
    through_dense = grads()
    assert through_4bit.keys() == through_dense.keys()
    for name, g in through_dense.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(through_4bit[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_merged_push_is_the_dequantized_base_plus_the_adapter(qlora_learner: Learner) -> None:
    """rollout.weight_push merged: dense weights under the base model's names, W_nf4 + scaling·B@A."""
    from transformers import AutoModelForCausalLM

    chunks = qlora_learner.export_weights()
    assert chunks is not None
    got = {k: v for c in chunks for k, v in c.items()}
    plain = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random"), local_files_only=True)
    want = {k: v.detach() for k, v in plain.named_parameters()}
    assert got.keys() == want.keys()
    assert all(got[k].shape == v.shape and got[k].dtype == COMPUTE for k, v in want.items())  # model.dtype

    peft = qlora_learner.model.base_model.model.model.layers[1]
    for proj, wrapped in (("self_attn.q_proj", peft.self_attn.q_proj), ("mlp.up_proj", peft.mlp.up_proj)):
        delta = wrapped.lora_B["default"].weight.float() @ wrapped.lora_A["default"].weight.float()
        expected = dequantize(wrapped.base_layer.weight).float() + wrapped.scaling["default"] * delta
        torch.testing.assert_close(got[f"model.layers.1.{proj}.weight"], expected.to(COMPUTE))
        assert delta.abs().max() > 0, proj  # the adapter moved: the push carries it
    plain_down = dequantize(peft.mlp.down_proj.weight).float()  # not LoRA-wrapped: dequantized as it is
    torch.testing.assert_close(got["model.layers.1.mlp.down_proj.weight"], plain_down.to(COMPUTE))
    # NF4 is close to, but not, the stored base
    diff = (got["model.layers.1.mlp.down_proj.weight"].float() - want["model.layers.1.mlp.down_proj.weight"]).abs()
    assert 0 < float(diff.max()) < 0.05
    adapter = qlora_learner.export_adapter()  # rollout.weight_push adapter: the PEFT adapter as for LoRA
    assert adapter is not None and sorted(adapter["config"]["target_modules"]) == ["q_proj", "up_proj", "v_proj"]


def test_qlora_checkpoint_round_trip_is_exact(tmp_path: Path) -> None:
    """With a moving (ema) reference adapter; a qlora checkpoint is not a lora one."""
    from actors.learner import CheckpointError

    def make(mode: str = "qlora") -> Learner:
        cfg = qlora_cfg()
        cfg.finetune.mode = mode
        cfg.algorithm.kl_coef = 0.05
        cfg.learner.reference = "ema"
        cfg.learner.reference_ema = 0.5
        learner = Learner(cfg)
        learner.setup()
        return learner

    batch = fixed_batch()
    first = make()
    first.train_step(batch)
    first.save_checkpoint(str(tmp_path / "ckpt"), {"data_position": 3})
    expected_metrics = first.train_step(batch)
    expected = trained(first)
    assert first.ref_kind == "adapter"  # a second, frozen adapter over the 4-bit base
    del first

    second = make()
    assert second.load_checkpoint(str(tmp_path / "ckpt")) == {"data_position": 3}
    metrics = second.train_step(batch)
    for k in ("policy_loss", "kl", "grad_norm"):
        assert metrics[k] == expected_metrics[k], k
    got = trained(second)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], v) for n, v in expected.items())
    with pytest.raises(CheckpointError, match=r"holds a 'qlora' model, but finetune\.mode is 'lora'"):
        make("lora").load_checkpoint(str(tmp_path / "ckpt"))


def test_what_qlora_cannot_run_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ConfigError, match=r"finetune.mode qlora runs on one learner rank.*learner.workers must be 1 \(got 2\)"
    ):
        load_config(None, ["finetune.mode=qlora", "learner.workers=2"])
    with pytest.raises(ValueError, match=r"finetune\.mode qlora runs on one rank"):
        Learner(make_cfg("qlora"), rank=0, world_size=2, master_port=1)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if the `qlora` extra were not installed
    with pytest.raises(QloraUnavailableError, match=r"needs bitsandbytes.*pip install -e '\.\[qlora\]'"):
        Learner(make_cfg("qlora")).setup()
