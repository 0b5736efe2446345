"""Per-token log-probabilities and the GRPO/PPO policy loss.

Shapes: logits [N, T, V] and input_ids [N, T] are the model's view of a packed batch (grpo.batch.pack).
Every per-token tensor of the loss is [N, T−1] and aligned with the targets: position t holds
log p(input_ids[:, t+1] | input_ids[:, :t+1]). `mask` is 1.0 where input_ids[:, t+1] is a token the
policy generated, 0.0 on prompt, observation and padding tokens.

The loss, per masked token t of sequence i (A = advantage, ρ = ratio):

    ρ_t     = exp(logp_t − old_t)
    pg_t    = −min(ρ_t·A, clip(ρ_t, 1 − ε_low, 1 + ε_high)·A) · w_t
    w_t     = min(exp(old_t − rollout_t), tis_cap), detached      (truncated importance sampling: the
              rollout engine's sampler and the learner's numerics differ; 1 when not in use)
    ℓ_t     = pg_t + β·KL_t(logp, ref) − α·H_t

    token:     L = Σ_{i,t} m_{i,t} ℓ_{i,t} / normalizer              (default: Σ m, this call's tokens)
    sequence:  L = Σ_i [Σ_t m_{i,t} ℓ_{i,t} / Σ_t m_{i,t}] / normalizer  (default: sequences with a token)

The learner passes `normalizer` = the token (or sequence) count of the whole minibatch across its
micro-batches and ranks, so the micro-batch losses sum to the minibatch mean.

Dr. GRPO (`algorithm.advantage: dr_grpo`; Liu et al. 2025, "Understanding R1-Zero-Like Training") divides
the token sum by a constant instead, so a long response's tokens weigh as much as a short one's:

    dr_grpo:   L = Σ_{i,t} m_{i,t} ℓ_{i,t} / (N_seq · L_max)      (`dr_grpo_normalizer`)

N_seq = the minibatch's sequences (all ranks), L_max = the generation budget of one episode. The paper's
code sums each response's token losses, divides by the generation budget and averages over responses:
the same number. Neither factor depends on the micro-batch split or on the number of ranks.

PPO (`algorithm.name: ppo`) adds a value loss on the value head's V_t, per masked token, reduced like the
policy loss (same reduction and normalizer; R = GAE return, V_old = the scoring pass's values):

    V^clip_t = V_old,t + clip(V_t − V_old,t, −c, c)
    vl_t     = ½ · max((V_t − R_t)², (V^clip_t − R_t)²)               (½ · (V_t − R_t)² without clipping)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
REDUCTIONS: tuple[str, ...] = ("token", "sequence")
# Log-ratios are clamped here before exp(): ρ = e^20 already means the update broke, and an inf
# loss or gradient would poison every parameter through the optimizer state.
_MAX_LOG_RATIO = 20.0


# --------------------------------------------------------------------------- log-probabilities


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log p(input_ids[:, t+1] | prefix) for t = 0..T−2: [N, T, V], [N, T] → [N, T−1].

    logp_t = z_t[target] − logsumexp(z_t), z = logits/temperature, computed in float32 (float64 for
    float64 logits). The work runs over chunks of tokens and the backward pass recomputes softmax
    from the saved logits, so no float32 [N, T, V] tensor (nor a log_softmax of it) is ever held:
    beside the logits and their gradient, memory is O(chunk × V).
    ∂logp_t/∂logits_t = (onehot(target) − softmax(z_t)) / temperature.
    """
    _check_logits(logits, input_ids)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _TokenLogprob.apply(logits, input_ids.long(), float(temperature))


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the next-token distribution at positions 0..T−2: [N, T, V] → [N, T−1].

    H_t = logsumexp(z_t) − Σ_v softmax(z_t)_v · z_t,v  (z = logits/temperature), float32 (float64 for
    float64 logits); chunked like token_logprobs. ∂H/∂z_v = −p_v·(log p_v + H).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [N, T, V], got shape {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _Entropy.apply(logits, float(temperature))


# Float32 elements per chunk of token positions (64 MiB): bounds the upcast copies.
_CHUNK_ELEMENTS = 1 << 24


def _chunks(logits: Tensor) -> Iterator[tuple[int, int, int]]:
    """(row, start, end) slices over positions 0..T−2, each at most _CHUNK_ELEMENTS upcast elements."""
    n, t, v = logits.shape
    step = max(1, _CHUNK_ELEMENTS // max(v, 1))
    for i in range(n):
        for s in range(0, t - 1, step):
            yield i, s, min(s + step, t - 1)


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _upcast(logits: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """A fresh compute-dtype copy of a chunk (never a view: callers work on it in place)."""
    z = logits.to(dtype, copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


# log_softmax on a chunk, not logsumexp: on CPU torch's logsumexp is ~2x slower than the fused
# log_softmax, and a chunk-sized temporary is cheap.
class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, input_ids: Tensor, temperature: float) -> Tensor:
        n, t, _ = logits.shape
        dtype = _compute_dtype(logits)
        out = logits.new_zeros((n, max(t - 1, 0)), dtype=dtype)
        lse = torch.zeros_like(out)
        for i, s, e in _chunks(logits):
            z = _upcast(logits[i, s:e], dtype, temperature)
            target = input_ids[i, s + 1 : e + 1, None]
            out[i, s:e] = torch.log_softmax(z, dim=-1).gather(-1, target).squeeze(-1)
            lse[i, s:e] = z.gather(-1, target).squeeze(-1) - out[i, s:e]
        ctx.save_for_backward(logits, input_ids, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, input_ids, lse = ctx.saved_tensors
        tau = ctx.temperature
        grad = torch.zeros_like(logits)  # the last position predicts nothing: its gradient stays 0
        for i, s, e in _chunks(logits):
            g_out = grad_out[i, s:e, None].to(lse.dtype) / tau
            g = _upcast(logits[i, s:e], lse.dtype, tau).sub_(lse[i, s:e, None]).exp_()  # softmax
            g.mul_(-g_out).scatter_add_(-1, input_ids[i, s + 1 : e + 1, None], g_out)
            grad[i, s:e] = g  # cast to the logits' dtype on copy
        return grad, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float) -> Tensor:
        n, t, _ = logits.shape
        dtype = _compute_dtype(logits)
        ent = logits.new_zeros((n, max(t - 1, 0)), dtype=dtype)
        for i, s, e in _chunks(logits):
            logp = torch.log_softmax(_upcast(logits[i, s:e], dtype, temperature), dim=-1)
            ent[i, s:e] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, ent)
        ctx.temperature = temperature
        return ent

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None]:
        logits, ent = ctx.saved_tensors
        tau = ctx.temperature
        grad = torch.zeros_like(logits)
        for i, s, e in _chunks(logits):
            logp = torch.log_softmax(_upcast(logits[i, s:e], ent.dtype, tau), dim=-1)
            g = logp.exp().mul_(logp.add_(ent[i, s:e, None]))  # p·(log p + H)
            grad[i, s:e] = g.mul_(grad_out[i, s:e, None].to(ent.dtype) / -tau)
        return grad, None


def kl_divergence(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(π || π_ref) from the sampled tokens' logprobs (Schulman's k1/k2/k3).

    With d = ref − logp:  k1 = −d = logp − ref;  k2 = d²/2;  k3 = exp(d) − d − 1  (≥ 0, unbiased).
    d is clamped to ±20 inside exp() so a broken reference cannot produce inf.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ")
    d = ref_logprobs.detach() - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.pow(2)
    if estimator == "k3":
        d = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {', '.join(KL_ESTIMATORS)}")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ mask·x / Σ mask over `dim` (all elements when None); 0 where the mask is empty.

    Masked-out entries are replaced (not multiplied) by 0, so a nan/inf there does not leak in.
    """
    m = mask.to(x.dtype) if x.is_floating_point() else mask.float()
    xs = torch.where(mask > 0, x, torch.zeros_like(x)) * m
    if dim is None:
        return xs.sum() / m.sum().clamp_min(1)
    return xs.sum(dim) / m.sum(dim).clamp_min(1)


# --------------------------------------------------------------------------- losses


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    reduction: str = "token",
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped-surrogate loss of the module docstring, and detached metrics.

    Metrics (python floats; means over this call's masked tokens, so a caller combines micro-batches
    by weighting with "tokens"): policy_loss (mean pg_t), kl (mean KL to the reference, 0 without
    one), approx_kl (mean k3 to old_logprobs), ratio_mean, ratio_std, clip_frac (tokens whose
    gradient the clip removed) with clip_frac_low/clip_frac_high (ρ below/above the band),
    entropy (when given), tis_mean and tis_clip_frac (when TIS is used), logprob_gap (mean
    |old − rollout|, when rollout_logprobs is given), tokens.

    A fully masked input gives a zero loss that is still connected to `logprobs` (every rank can
    run backward on an empty micro-batch) and all-zero metrics.
    """
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T-1], got shape {tuple(shape)}")
    _same_shape(shape, old_logprobs=old_logprobs, mask=mask)
    _same_shape(shape, ref_logprobs=ref_logprobs, entropy=entropy, rollout_logprobs=rollout_logprobs)
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; allowed: {', '.join(REDUCTIONS)}")
    if clip_eps_low < 0 or clip_eps_high < 0:
        raise ValueError(f"clip_eps_low/high must be >= 0, got {clip_eps_low}/{clip_eps_high}")
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError(f"tis_cap must be > 0 or None, got {tis_cap}")
    dtype = _compute_dtype(logprobs)
    adv = _broadcast_advantages(advantages, shape).to(logprobs.device, dtype)

    keep = mask > 0
    m = keep.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    old = old_logprobs.detach().to(dtype)
    logp = logprobs.to(dtype)
    log_ratio = torch.where(keep, logp - old, zero).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    surr = ratio * adv
    surr_clipped = clipped_ratio * adv
    pg = -torch.minimum(surr, surr_clipped)

    tis = None
    if rollout_logprobs is not None and tis_cap is not None:
        gap = torch.where(keep, old - rollout_logprobs.detach().to(dtype), zero)
        tis = torch.exp(gap.clamp(max=_MAX_LOG_RATIO)).clamp(max=tis_cap)
        pg = pg * tis
    per_token = pg
    kl = None
    if ref_logprobs is not None:
        kl = kl_divergence(logp, torch.where(keep, ref_logprobs.detach().to(dtype), logp.detach()), kl_estimator)
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    elif kl_coef > 0:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if entropy is not None and entropy_coef != 0:
        per_token = per_token - entropy_coef * entropy.to(dtype)

    loss = _reduce(per_token, keep, m, reduction, normalizer)

    with torch.no_grad():
        n_tok = float(m.sum())
        clipped = keep & (surr_clipped < surr)  # min() took the clipped term: this token has no gradient
        metrics = {
            "policy_loss": _mean(pg, m),
            "kl": _mean(kl, m) if kl is not None else 0.0,
            "approx_kl": _mean(kl_divergence(logp, old, "k3"), m),
            "ratio_mean": _mean(ratio, m),
            "ratio_std": _std(ratio, m),
            "clip_frac": _mean(clipped.float(), m),
            "clip_frac_low": _mean((ratio < 1.0 - clip_eps_low).float(), m),
            "clip_frac_high": _mean((ratio > 1.0 + clip_eps_high).float(), m),
            "tokens": n_tok,
        }
        if entropy is not None:
            metrics["entropy"] = _mean(entropy.float(), m)
        if tis is not None:
            metrics["tis_mean"] = _mean(tis, m)
            metrics["tis_clip_frac"] = _mean((tis >= tis_cap).float(), m)
        if rollout_logprobs is not None:
            metrics["logprob_gap"] = _mean((old - rollout_logprobs.float()).abs(), m)
    return loss, metrics


def dr_grpo_normalizer(num_sequences: float, norm_tokens: int) -> float:
    """Dr. GRPO's constant loss normalizer: N_seq · L_max (see the module docstring).

    num_sequences: the minibatch's sequences over all ranks (empty ones included: the paper averages
    over every sampled response); norm_tokens: L_max, the generation budget of one episode."""
    if norm_tokens < 1:
        raise ValueError(f"dr_grpo norm_tokens must be >= 1, got {norm_tokens}")
    if num_sequences < 0:
        raise ValueError(f"num_sequences must be >= 0, got {num_sequences}")
    return float(num_sequences) * float(norm_tokens)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    reduction: str = "token",
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's (clipped) value loss of the module docstring, [N, T−1] inputs, and detached metrics.

    Metrics (means over this call's masked tokens): value_loss (mean vl_t), value_mean (mean V_t),
    value_clip_frac (tokens where the clipped term was the larger one, 0 without clipping), tokens."""
    shape = values.shape
    if values.dim() != 2:
        raise ValueError(f"values must be [N, T-1], got shape {tuple(shape)}")
    _same_shape(shape, old_values=old_values, returns=returns, mask=mask)
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; allowed: {', '.join(REDUCTIONS)}")
    if clip is not None and clip <= 0:
        raise ValueError(f"value clip must be > 0 or None, got {clip}")
    dtype = _compute_dtype(values)
    keep = mask > 0
    m = keep.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    # where() before any arithmetic: a nan/inf on a masked-out token must not reach the loss or its gradient.
    v = torch.where(keep, values.to(dtype), zero)
    ret = torch.where(keep, returns.detach().to(dtype), zero)
    err = (v - ret).pow(2)
    if clip is None:
        per_token = 0.5 * err
        clipped = torch.zeros_like(keep)
    else:
        old = torch.where(keep, old_values.detach().to(dtype), zero)
        err_clipped = (old + (v - old).clamp(-clip, clip) - ret).pow(2)
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clipped = keep & (err_clipped > err)
    loss = _reduce(per_token, keep, m, reduction, normalizer)
    with torch.no_grad():
        metrics = {
            "value_loss": _mean(per_token, m),
            "value_mean": _mean(v, m),
            "value_clip_frac": _mean(clipped.float(), m),
            "tokens": float(m.sum()),
        }
    return loss, metrics


def sft_loss(logprobs: Tensor, mask: Tensor, normalizer: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """Masked negative log-likelihood: L = Σ m_t·(−logp_t) / normalizer (default Σ m_t).

    Metrics: sft_loss (mean NLL over this call's masked tokens), tokens. An empty mask gives a zero
    loss still connected to `logprobs`.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T-1], got shape {tuple(logprobs.shape)}")
    _same_shape(logprobs.shape, mask=mask)
    keep = mask > 0
    m = keep.to(_compute_dtype(logprobs))
    nll = -logprobs.to(m.dtype)
    loss = _reduce(nll, keep, m, "token", normalizer)
    with torch.no_grad():
        metrics = {"sft_loss": _mean(nll, m), "tokens": float(m.sum())}
    return loss, metrics


# --------------------------------------------------------------------------- helpers


def _reduce(per_token: Tensor, keep: Tensor, m: Tensor, reduction: str, normalizer: float | None) -> Tensor:
    # where() rather than a product: a nan/inf on a masked-out token must not reach the loss.
    masked = torch.where(keep, per_token, torch.zeros_like(per_token))
    if reduction == "token":
        total, count = masked.sum(), float(m.sum())
    else:
        per_seq_tokens = m.sum(-1)
        total = (masked.sum(-1) / per_seq_tokens.clamp_min(1)).sum()
        count = float((per_seq_tokens > 0).sum())
    if normalizer is None:
        return total / max(count, 1.0)
    normalizer = float(normalizer)
    if not normalizer >= 0 or normalizer == float("inf"):
        raise ValueError(f"normalizer must be a finite number >= 0, got {normalizer}")
    if normalizer == 0:
        if count > 0:
            raise ValueError(f"normalizer is 0 but this call has {count:g} {reduction}s to average")
        normalizer = 1.0  # an empty minibatch everywhere: the loss is 0, keep backward possible
    return total / normalizer


def _mean(x: Tensor, m: Tensor) -> float:
    n = float(m.sum())
    if n == 0:
        return 0.0
    return float(torch.where(m > 0, x.detach().float(), torch.zeros_like(m)).sum() / n)


def _std(x: Tensor, m: Tensor) -> float:
    n = float(m.sum())
    if n == 0:
        return 0.0
    mu = _mean(x, m)
    dev = torch.where(m > 0, x.detach().float() - mu, torch.zeros_like(m))
    return float((dev.pow(2).sum() / n).sqrt())


def _broadcast_advantages(advantages: Tensor | float, shape: torch.Size) -> Tensor:
    adv = torch.as_tensor(advantages)
    if adv.dim() == 1 and adv.shape[0] == shape[0]:
        return adv.unsqueeze(-1).expand(shape)
    if adv.shape == shape:
        return adv
    raise ValueError(f"advantages must be [N] or [N, T-1] = {list(shape)}, got shape {tuple(adv.shape)}")


def _same_shape(shape: torch.Size, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logprobs")


def _check_logits(logits: Tensor, input_ids: Tensor) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [N, T, V], got shape {tuple(logits.shape)}")
    if input_ids.shape != logits.shape[:2]:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} must match logits' [N, T] {tuple(logits.shape[:2])}")
