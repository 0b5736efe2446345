"""Losses: hand-computed values and gradients, numerical gradient checks, and a real tiny-random step."""

from __future__ import annotations

import math

import pytest
import torch

import grpo.losses as losses
from grpo.batch import Sample, pack
from grpo.losses import (
    dr_grpo_normalizer,
    entropy_from_logits,
    kl_divergence,
    masked_mean,
    policy_loss,
    sft_loss,
    token_logprobs,
    value_loss,
)

LN2 = math.log(2.0)


def reference_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The naive full log_softmax, for comparison."""
    return torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)


# --------------------------------------------------------------------------- token_logprobs / entropy


def hand_logits() -> tuple[torch.Tensor, torch.Tensor]:
    # Row 0, position 0: softmax([0, ln2, 0]) = [1/4, 1/2, 1/4]; row 1: softmax([ln3, 0, 0]) = [3/5, 1/5, 1/5].
    # Position 1 (the last) predicts nothing.
    logits = torch.tensor([[[0.0, LN2, 0.0], [5.0, -1.0, 2.0]], [[math.log(3.0), 0.0, 0.0], [0.0, 0.0, 9.0]]])
    input_ids = torch.tensor([[0, 1], [0, 2]])
    return logits, input_ids


def test_token_logprobs_hand_case_and_gradient() -> None:
    logits, ids = hand_logits()
    logits.requires_grad_(True)
    lp = token_logprobs(logits, ids)
    assert lp.shape == (2, 1) and lp.dtype == torch.float32
    assert lp.flatten().tolist() == pytest.approx([math.log(0.5), math.log(0.2)], abs=1e-6)
    lp.sum().backward()
    # ∂logp/∂z = onehot(target) − softmax(z); the last position gets no gradient.
    assert logits.grad[0, 0].tolist() == pytest.approx([-0.25, 0.5, -0.25], abs=1e-6)
    assert logits.grad[1, 0].tolist() == pytest.approx([-0.6, -0.2, 0.8], abs=1e-6)
    assert torch.equal(logits.grad[:, 1], torch.zeros(2, 3))


def test_token_logprobs_temperature() -> None:
    logits, ids = hand_logits()
    lp = token_logprobs(logits * 2, ids, temperature=2.0)
    assert lp.flatten().tolist() == pytest.approx([math.log(0.5), math.log(0.2)], abs=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, ids, temperature=0.0)


def test_token_logprobs_numerical_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 5, (2, 4), generator=g)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, ids), (logits,))
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, ids, temperature=0.7), (logits,))


def test_token_logprobs_chunked_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 11, generator=g)
    ids = torch.randint(0, 11, (3, 7), generator=g)
    whole = token_logprobs(logits, ids)
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 22)  # 2 positions per chunk
    chunked = token_logprobs(logits, ids)
    assert torch.allclose(whole, chunked, atol=1e-6)
    assert torch.allclose(chunked.double(), reference_logprobs(logits, ids), atol=1e-5)


def test_token_logprobs_bfloat16_upcasts() -> None:
    g = torch.Generator().manual_seed(2)
    logits32 = (torch.randn(2, 6, 50, generator=g) * 3).to(torch.bfloat16).float()
    ids = torch.randint(0, 50, (2, 6), generator=g)
    bf = logits32.to(torch.bfloat16).requires_grad_(True)
    f32 = logits32.clone().requires_grad_(True)
    lp_bf, lp_32 = token_logprobs(bf, ids), token_logprobs(f32, ids)
    assert lp_bf.dtype == torch.float32
    # The same (bf16-representable) logits give the same float32 result: the math ran in float32.
    assert torch.allclose(lp_bf, lp_32, atol=1e-6)
    lp_bf.sum().backward()
    lp_32.sum().backward()
    assert bf.grad.dtype == torch.bfloat16
    assert torch.allclose(bf.grad.float(), f32.grad, atol=1e-2)


def test_entropy_uniform_peaked_and_hand_case() -> None:
    v = 7
    uniform = entropy_from_logits(torch.zeros(2, 3, v))
    assert uniform.shape == (2, 2) and torch.allclose(uniform, torch.full((2, 2), math.log(v)))
    peaked = torch.full((1, 2, v), -1e4)
    peaked[..., 0] = 0.0
    assert entropy_from_logits(peaked).abs().max() < 1e-6
    logits, _ = hand_logits()
    h = entropy_from_logits(logits)
    expected0 = -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5))
    expected1 = -(0.6 * math.log(0.6) + 2 * 0.2 * math.log(0.2))
    assert h.flatten().tolist() == pytest.approx([expected0, expected1], abs=1e-6)


def test_entropy_numerical_gradient() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z), (logits,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, temperature=1.5), (logits,))


# --------------------------------------------------------------------------- kl / masked_mean


def test_kl_estimators_values_and_gradient() -> None:
    logp = torch.tensor([-1.0, -0.5], requires_grad=True)
    ref = torch.tensor([-2.0, -0.5])
    # d = ref - logp = [-1, 0]
    assert kl_divergence(logp, ref, "k1").tolist() == pytest.approx([1.0, 0.0])
    assert kl_divergence(logp, ref, "k2").tolist() == pytest.approx([0.5, 0.0])
    k3 = kl_divergence(logp, ref, "k3")
    assert k3.tolist() == pytest.approx([math.exp(-1.0), 0.0], abs=1e-6)
    k3.sum().backward()
    # ∂k3/∂logp = 1 − exp(ref − logp)
    assert logp.grad.tolist() == pytest.approx([1 - math.exp(-1.0), 0.0], abs=1e-6)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_divergence(logp, ref, "k4")
    with pytest.raises(ValueError, match="differ"):
        kl_divergence(logp, ref[:1])


def test_kl_k3_stays_finite_for_a_broken_reference() -> None:
    out = kl_divergence(torch.tensor([-200.0]), torch.tensor([0.0]), "k3")
    assert torch.isfinite(out).all()


def test_masked_mean() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 6.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    assert masked_mean(x, mask, dim=-1).tolist() == pytest.approx([2.0, 0.0])
    mask2 = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    assert masked_mean(x, mask2).item() == pytest.approx(5.0)  # the nan is masked out


# --------------------------------------------------------------------------- policy_loss


def one_token_batch(ratios: list[float], advantages: list[float]) -> tuple[torch.Tensor, ...]:
    logp = torch.tensor([[math.log(r)] for r in ratios], requires_grad=True)
    old = torch.zeros(len(ratios), 1)
    return logp, old, torch.tensor(advantages), torch.ones(len(ratios), 1)


def test_clip_both_sides_for_both_signs() -> None:
    # ε_low 0.2, ε_high 0.28 -> band [0.8, 1.28]
    ratios = [1.5, 0.5, 1.5, 0.5, 1.1]
    advs = [1.0, 1.0, -1.0, -1.0, 1.0]
    logp, old, adv, mask = one_token_batch(ratios, advs)
    loss, m = policy_loss(logp, old, adv, mask, normalizer=1.0)
    # per token: −min(ρA, clip(ρ)A)
    per_token = [-1.28, -0.5, 1.5, 0.8, -1.1]
    assert loss.item() == pytest.approx(sum(per_token), abs=1e-6)
    loss.backward()
    # ∂/∂logp of −ρA is −ρA where the unclipped term is taken, 0 where the clipped one is.
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.5, 1.5, 0.0, -1.1], abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["clip_frac_low"] == pytest.approx(2 / 5) and m["clip_frac_high"] == pytest.approx(2 / 5)
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / 5, abs=1e-6)
    assert m["ratio_std"] == pytest.approx(torch.tensor(ratios).std(correction=0).item(), abs=1e-6)
    assert m["policy_loss"] == pytest.approx(sum(per_token) / 5, abs=1e-6)
    assert m["tokens"] == 5 and m["kl"] == 0.0


def test_symmetric_clip_bounds_are_respected() -> None:
    logp, old, adv, mask = one_token_batch([1.25], [1.0])
    loss, m = policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    assert loss.item() == pytest.approx(-1.2) and m["clip_frac"] == 1.0


def token_vs_sequence_batch() -> tuple[torch.Tensor, ...]:
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    old = torch.full((2, 3), -1.0)  # ratio 1 -> per-token loss −A
    adv = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    return logp, old, adv, mask


def test_token_and_sequence_reduction_with_normalizer() -> None:
    logp, old, adv, mask = token_vs_sequence_batch()
    # token losses: row 0: -1, -1, -1; row 1: -2
    assert policy_loss(logp, old, adv, mask)[0].item() == pytest.approx(-5 / 4)
    assert policy_loss(logp, old, adv, mask, normalizer=10)[0].item() == pytest.approx(-5 / 10)
    assert policy_loss(logp, old, adv, mask, reduction="sequence")[0].item() == pytest.approx((-1 - 2) / 2)
    assert policy_loss(logp, old, adv, mask, reduction="sequence", normalizer=4)[0].item() == pytest.approx(-3 / 4)
    loss, _ = policy_loss(logp, old, adv, mask, reduction="sequence")
    loss.backward()
    # sequence mean: row 0 tokens weigh 1/3 each, row 1's token 1; then / 2 sequences; ∂(−ρA)/∂logp = −A
    expected = torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [-1.0, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected)


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_micro_batches_sum_to_the_whole_batch(reduction: str) -> None:
    g = torch.Generator().manual_seed(4)
    logp = (torch.randn(6, 5, generator=g) * 0.3 - 1).requires_grad_(True)
    old = logp.detach() + torch.randn(6, 5, generator=g) * 0.2
    ref = logp.detach() + torch.randn(6, 5, generator=g) * 0.2
    adv = torch.randn(6, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[2] = 0  # an empty sequence too
    kw = dict(reduction=reduction, ref_logprobs=ref, kl_coef=0.05)
    whole, _ = policy_loss(logp, old, adv, mask, **kw)
    (g_whole,) = torch.autograd.grad(whole, logp)
    norm = float(mask.sum()) if reduction == "token" else float((mask.sum(-1) > 0).sum())
    parts = [
        policy_loss(logp[s], old[s], adv[s], mask[s], normalizer=norm, ref_logprobs=ref[s], kl_coef=0.05,
                    reduction=reduction)[0]
        for s in (slice(0, 2), slice(2, 6))
    ]  # fmt: skip
    total = parts[0] + parts[1]
    (g_parts,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(whole.item(), abs=1e-6)
    assert torch.allclose(g_parts, g_whole, atol=1e-7)


@pytest.mark.parametrize("splits", [[(0, 6)], [(0, 2), (2, 6)], [(0, 1), (1, 3), (3, 4), (4, 6)]])
def test_dr_grpo_constant_normalizer_is_the_same_for_any_split(splits: list[tuple[int, int]]) -> None:
    """Dr. GRPO: Σ_{i,t} m·ℓ / (N_seq · L_max), N_seq = 6 sequences (an empty one included), L_max = 10.
    Hand case: ρ = 1 (logp = old), A = 1 per sequence, so ℓ_t = −1 and L = −(masked tokens) / 60, the same
    whatever the micro-batch split (each micro-batch or rank gets the one constant)."""
    logp = torch.full((6, 5), -1.0, requires_grad=True)
    mask = torch.zeros(6, 5)
    lengths = [5, 1, 0, 3, 2, 4]  # 15 generated tokens; sequence 2 generated nothing
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    norm = dr_grpo_normalizer(6, 10)
    assert norm == 60.0
    total = sum(
        policy_loss(logp[a:b], logp.detach()[a:b], torch.ones(b - a), mask[a:b], normalizer=norm)[0] for a, b in splits
    )
    assert total.item() == pytest.approx(-15 / 60)
    (grad,) = torch.autograd.grad(total, logp)
    # every generated token's gradient is −A / 60, a long sequence's tokens as much as a short one's
    assert torch.allclose(grad, -mask / 60)
    with pytest.raises(ValueError, match="norm_tokens"):
        dr_grpo_normalizer(6, 0)


def test_value_loss_with_and_without_clipping() -> None:
    """Hand case, clip c = 0.2, one row of three tokens, the middle one masked out (garbage there):
    token 0: V 1.0, V_old 0.5, R 0.6 → V^clip = 0.7; max((0.4)², (0.1)²) = 0.16 → 0.08 (unclipped term larger)
    token 2: V 0.0, V_old 0.5, R 1.0 → V^clip = 0.3; max((1.0)², (0.7)²) = 1.0  → 0.5
    token 2 with R = 0.0:             max((0.0)², (0.3)²) = 0.09 → 0.045 (the clipped term: counted)."""
    v = torch.tensor([[1.0, float("nan"), 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 7.0, 0.5]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss, m = value_loss(v, old, torch.tensor([[0.6, 3.0, 1.0]]), mask, clip=0.2)
    assert loss.item() == pytest.approx((0.08 + 0.5) / 2)
    assert m["value_loss"] == pytest.approx(0.29) and m["value_mean"] == pytest.approx(0.5)
    assert m["value_clip_frac"] == 0.0 and m["tokens"] == 2
    (grad,) = torch.autograd.grad(loss, v)
    assert torch.allclose(grad, torch.tensor([[0.4 / 2, 0.0, -1.0 / 2]]))  # (V − R) / 2 tokens

    loss, m = value_loss(v, old, torch.tensor([[0.6, 3.0, 0.0]]), mask, clip=0.2)
    assert loss.item() == pytest.approx((0.08 + 0.045) / 2) and m["value_clip_frac"] == 0.5
    (grad,) = torch.autograd.grad(loss, v)
    assert grad[0, 2] == 0.0  # the clipped term does not depend on V: no gradient (as in PPO)

    loss, m = value_loss(v, old, torch.tensor([[0.6, 3.0, 0.0]]), mask, clip=None, normalizer=4)
    assert loss.item() == pytest.approx((0.08 + 0.0) / 4) and m["value_clip_frac"] == 0.0
    with pytest.raises(ValueError, match="clip"):
        value_loss(v, old, old, mask, clip=0.0)
    with pytest.raises(ValueError, match="returns"):
        value_loss(v, old, old[:, :2], mask)


def test_truncated_importance_weights() -> None:
    logp = torch.zeros(1, 3, requires_grad=True)
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[-math.log(3.0), math.log(2.0), 0.0]])  # old − rollout = ln3, −ln2, 0
    adv, mask = torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = policy_loss(logp, old, adv, mask, rollout_logprobs=rollout, tis_cap=2.0, normalizer=1.0)
    # w = min(exp(old − rollout), 2) = [2, 0.5]; ratio 1 -> per-token −w
    assert loss.item() == pytest.approx(-2.5, abs=1e-6)
    assert m["tis_mean"] == pytest.approx(1.25) and m["tis_clip_frac"] == pytest.approx(0.5)
    assert m["logprob_gap"] == pytest.approx((math.log(3.0) + math.log(2.0)) / 2, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-2.0, -0.5, 0.0], abs=1e-6)
    # rollout without a cap: the gap is reported, nothing is weighted
    loss2, m2 = policy_loss(logp, old, adv, mask, rollout_logprobs=rollout, normalizer=1.0)
    assert loss2.item() == pytest.approx(-2.0) and "tis_mean" not in m2 and "logprob_gap" in m2


def test_kl_and_entropy_terms() -> None:
    logp = torch.full((1, 2), -1.0, requires_grad=True)
    old = logp.detach().clone()
    ref = torch.full((1, 2), -2.0)
    adv, mask = torch.tensor([0.0]), torch.ones(1, 2)
    entropy = torch.full((1, 2), 2.0)
    loss, m = policy_loss(
        logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1, entropy=entropy, entropy_coef=0.01, normalizer=1.0
    )
    k3 = math.exp(-1.0)  # d = ref − logp = −1: e^−1 + 1 − 1
    assert loss.item() == pytest.approx(2 * (0.1 * k3 - 0.01 * 2.0), abs=1e-6)
    assert m["kl"] == pytest.approx(k3, abs=1e-6) and m["entropy"] == pytest.approx(2.0)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.1 * (1 - math.exp(-1.0))] * 2, abs=1e-6)
    # the KL metric is reported with a reference even when it is not in the loss
    _, m0 = policy_loss(logp, old, adv, mask, ref_logprobs=ref)
    assert m0["kl"] == pytest.approx(k3, abs=1e-6)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(logp, old, adv, mask, kl_coef=0.1)


def test_per_token_advantages() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -3.0]]), torch.ones(1, 2), normalizer=1.0)
    assert loss.item() == pytest.approx(2.0)


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_empty_mask_gives_zero_loss_with_a_grad_path(reduction: str) -> None:
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    old = torch.tensor([[float("nan"), 0.0, -1.0], [0.0, 0.0, float("inf")]])  # garbage where masked
    mask = torch.zeros(2, 3)
    for normalizer in (None, 0.0, 7.0):
        loss, m = policy_loss(
            logp,
            old,
            torch.ones(2),
            mask,
            reduction=reduction,
            ref_logprobs=torch.zeros(2, 3),
            kl_coef=0.1,
            entropy=torch.ones(2, 3),
            entropy_coef=0.01,
            rollout_logprobs=torch.zeros(2, 3),
            tis_cap=2.0,
            normalizer=normalizer,
        )
        assert loss.item() == 0.0 and loss.grad_fn is not None
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.equal(grad, torch.zeros(2, 3))
        assert m["tokens"] == 0 and all(math.isfinite(v) for v in m.values())


def test_masked_garbage_does_not_leak() -> None:
    logp = torch.tensor([[-1.0, -50.0]], requires_grad=True)
    old = torch.tensor([[-1.0, float("nan")]])
    rollout = torch.tensor([[-1.0, float("-inf")]])
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), rollout_logprobs=rollout,
                          tis_cap=2.0)  # fmt: skip
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in m.values())


def test_policy_loss_bad_input() -> None:
    logp, old, adv, mask = token_vs_sequence_batch()
    with pytest.raises(ValueError, match="token, sequence"):
        policy_loss(logp, old, adv, mask, reduction="batch")
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        policy_loss(logp, old[:1], adv, mask)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(logp, old, torch.ones(3), mask)
    with pytest.raises(ValueError, match="normalizer is 0"):
        policy_loss(logp, old, adv, mask, normalizer=0)
    with pytest.raises(ValueError, match="normalizer must be"):
        policy_loss(logp, old, adv, mask, normalizer=-1)
    with pytest.raises(ValueError, match="tis_cap"):
        policy_loss(logp, old, adv, mask, rollout_logprobs=old, tis_cap=0.0)


# --------------------------------------------------------------------------- sft_loss


def test_sft_loss() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    loss, m = sft_loss(logp, mask)
    assert loss.item() == pytest.approx(7 / 3) and m == {"sft_loss": pytest.approx(7 / 3), "tokens": 3.0}
    loss.backward()
    assert torch.allclose(logp.grad, -mask / 3)
    assert sft_loss(logp, mask, normalizer=7)[0].item() == pytest.approx(1.0)
    empty, m0 = sft_loss(logp, torch.zeros(2, 2))
    assert empty.item() == 0.0 and empty.grad_fn is not None and m0["tokens"] == 0


# --------------------------------------------------------------------------- a real model


def test_one_step_on_tiny_random_moves_logprobs_with_the_advantage_sign() -> None:
    from actors.models import load_causal_lm
    from configs.schema import ModelConfig

    torch.manual_seed(0)
    model = load_causal_lm(ModelConfig(name="tiny-random", dtype="float32")).train()
    samples = [
        Sample([1, 2, 3], [10, 11, 12, 13], [1, 1, 0, 1], [0.0] * 4, advantage=1.0),
        Sample([4, 5], [20, 21, 22], [1, 0, 1], [0.0] * 3, advantage=-1.0),
    ]
    batch = pack(samples, pad_id=0)

    def logprobs() -> torch.Tensor:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return token_logprobs(out.logits, batch["input_ids"])

    lp = logprobs()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(lp.double(), reference_logprobs(logits.detach(), batch["input_ids"]), atol=1e-5)
    old = lp.detach()
    loss, m = policy_loss(lp, old, batch["advantages"], batch["loss_mask"])
    assert m["ratio_mean"] == pytest.approx(1.0) and m["tokens"] == 5
    model.zero_grad()
    loss.backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt.step()
    with torch.no_grad():
        new = logprobs()
    mask = batch["loss_mask"] > 0
    gain = (new - old)[mask]
    # sample 0 (A = +1) tokens became likelier, sample 1 (A = −1) tokens less likely
    n0 = int(mask[0].sum())
    assert (gain[:n0] > 0).all() and (gain[n0:] < 0).all()
