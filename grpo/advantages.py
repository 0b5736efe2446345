"""Advantages from scalar episode rewards, computed within GRPO groups.

A group is the G trajectories sampled for one task in one step (they share a `group_id`). Every
method first subtracts a per-group baseline, so a group whose rewards are all equal (a "zero-variance
group") carries no learning signal: its advantages are exactly 0, whatever the method, and it is
counted in the stats.

For trajectory i in group g with G_g members, mean m_g = (1/G_g) Σ_j r_j and

    grpo          A_i = (r_i − m_g) / (σ_g + eps)      σ_g = sqrt((1/G_g) Σ_j (r_j − m_g)²)
                  A_i =  r_i − m_g                     when std_normalize is False
    dr_grpo       A_i =  r_i − m_g                     always: std_normalize is ignored
    rloo          A_i = r_i − (1/(G_g−1)) Σ_{j≠i} r_j  = G_g/(G_g−1) · (r_i − m_g);   0 for singletons
    reinforce_pp  A_i = (r_i − m_g) / (σ_B + eps)      σ_B = sqrt((1/N) Σ_k (r_k − m_{g(k)})²)
                  A_i =  r_i − m_g                     when std_normalize is False

σ_g is the population std (ddof 0): the group is the whole population of samples drawn for that
prompt this step, and with ddof 0 the normalised advantages of every non-degenerate group have unit
RMS whatever G is (Bessel's correction would shrink them by sqrt((G−1)/G), which matters at G=2..4).
dr_grpo (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training") drops the division by σ_g:
it weights questions by difficulty (a group with a small spread is blown up to unit scale), so it
ignores `std_normalize`; its other half, the constant length normalisation of the loss, is in
grpo/losses.py (`dr_grpo_normalizer`).
rloo ignores `std_normalize`: its baseline is already unbiased and leave-one-out has no std of its own.
reinforce_pp (REINFORCE++ with a group baseline) normalises by the std of the whole batch of centred
rewards, so groups with a small spread are not blown up to unit scale as they are in grpo.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ADVANTAGE_METHODS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp")


def group_advantages(
    rewards: Sequence[float] | torch.Tensor,
    group_ids: Sequence[int] | torch.Tensor,
    method: str = "grpo",
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-trajectory advantages [N] (float32) and batch stats.

    Stats: groups (distinct group ids), zero_variance_groups (groups whose rewards are all equal,
    singletons included), zero_variance_frac, reward_mean and reward_std (population std over the
    batch), advantage_std and advantage_abs_max.
    Raises ValueError for an unknown method, mismatched lengths, non-1-D input or a non-finite reward.
    """
    if method not in ADVANTAGE_METHODS:
        raise ValueError(f"unknown advantage method {method!r}; allowed: {', '.join(ADVANTAGE_METHODS)}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = _as_1d(rewards, "rewards", torch.float64)
    gid = _as_1d(group_ids, "group_ids", torch.long)
    if r.numel() != gid.numel():
        raise ValueError(f"rewards has {r.numel()} entries but group_ids has {gid.numel()}")
    bad = (~torch.isfinite(r)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"rewards[{i}] is {float(r[i])}: every reward must be finite")
    n = r.numel()
    if n == 0:
        empty = {"groups": 0.0, "zero_variance_groups": 0.0, "zero_variance_frac": 0.0}
        empty |= {"reward_mean": 0.0, "reward_std": 0.0, "advantage_std": 0.0, "advantage_abs_max": 0.0}
        return torch.zeros(0, dtype=torch.float32), empty

    # inverse[i] is the dense index (0..n_groups-1) of trajectory i's group.
    _, inverse = torch.unique(gid, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    size = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, r)
    mean = total / size
    centred = r - mean[inverse]
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, centred**2) / size
    std = var.sqrt()
    # Equal rewards, tested exactly (max == min) rather than std < tol so that tiny real spreads count.
    gmax = torch.full((n_groups,), -math.inf, dtype=torch.float64).scatter_reduce_(0, inverse, r, "amax")
    gmin = torch.full((n_groups,), math.inf, dtype=torch.float64).scatter_reduce_(0, inverse, r, "amin")
    zero_var = gmax == gmin  # singletons included
    centred = torch.where(zero_var[inverse], torch.zeros_like(centred), centred)

    if method == "grpo":
        adv = centred / (std[inverse] + eps) if std_normalize else centred
    elif method == "dr_grpo":
        adv = centred
    elif method == "rloo":
        g = size[inverse]
        adv = torch.where(g > 1, centred * g / (g - 1).clamp_min(1), torch.zeros_like(centred))
    else:  # reinforce_pp
        adv = centred / (centred.pow(2).mean().sqrt() + eps) if std_normalize else centred
    adv = torch.where(zero_var[inverse], torch.zeros_like(adv), adv)

    n_zero = int(zero_var.sum())
    stats = {
        "groups": float(n_groups),
        "zero_variance_groups": float(n_zero),
        "zero_variance_frac": n_zero / n_groups,
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(correction=0)),
        "advantage_std": float(adv.std(correction=0)),
        "advantage_abs_max": float(adv.abs().max()),
    }
    return adv.to(torch.float32), stats


def _as_1d(x: Sequence | torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    try:
        t = x.detach().to("cpu") if isinstance(x, torch.Tensor) else torch.tensor(list(x))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name} must be a 1-D sequence of numbers: {exc}") from exc
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if dtype == torch.long and t.is_floating_point():
        if not torch.equal(t, t.round()):
            raise ValueError(f"{name} must hold integers")
    return t.to(dtype)
