"""PPO's per-token rewards and Generalized Advantage Estimation over a multi-turn episode.

The actions of an episode are its generated tokens (loss_mask 1); the observation and template tokens
between turns (loss_mask 0) are the environment's answer, not actions. So GAE runs over the sequence of
generated tokens only, a_1 … a_n in order, and steps over the observation tokens: the state after the
last token of turn k is the first generated token of turn k+1 (one step of γ, whatever the observation's
length), and the state after a_n is terminal (V = 0).

Rewards: turn k's reward (`Trajectory.turn_rewards[k]`) is placed on the last generated token of turn k;
every other token's reward is 0. When the episode's reward differs from the sum of its turn rewards (a
group judge rescored the whole episode), the difference goes on the last generated token.

With r_j, V_j the reward and value of action j (V_{n+1} = 0):

    δ_j = r_j + γ·V_{j+1} − V_j
    A_j = δ_j + γ·λ·A_{j+1}            (A_{n+1} = 0)
    R_j = A_j + V_j                    (the value target, "return")

V_j is the value head's output at the position that predicts a_j: the state before a_j is chosen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def token_rewards(loss_mask: Sequence[int], turn_rewards: Sequence[float], total: float | None = None) -> list[float]:
    """Per response token: turn k's reward on the last generated token of turn k, 0 elsewhere.

    Turns are the maximal runs of loss_mask 1. If their count differs from len(turn_rewards) (a turn that
    generated nothing has no run), the turns cannot be matched to runs and the whole reward goes on the
    last generated token. `total` (the episode's reward) adds total − Σ turn_rewards on the last generated
    token. An episode without generated tokens gets all zeros (it has no action to credit)."""
    ends = [j for j, m in enumerate(loss_mask) if m and (j + 1 == len(loss_mask) or not loss_mask[j + 1])]
    out = [0.0] * len(loss_mask)
    if not ends:
        return out
    rewards = [float(r) for r in turn_rewards]
    if len(ends) == len(rewards):
        for j, r in zip(ends, rewards, strict=True):
            out[j] += r
    else:
        out[ends[-1]] += math.fsum(rewards)
    if total is not None:
        out[ends[-1]] += float(total) - math.fsum(rewards)
    return out


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 0.99, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Advantages and returns per token, [N, L] each (0 where mask is 0), from [N, L] rewards, values and
    mask, by the recursion of the module docstring, run over each row's masked positions only.

    Computed in float64 on the CPU and returned in the values' dtype. Raises ValueError when a reward sits
    on a masked-out position (it would be lost) or when γ or λ is outside [0, 1]."""
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    if not rewards.shape == values.shape == mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} must be "
            "the same [N, L]"
        )
    keep = (mask > 0).cpu()
    r = rewards.detach().to("cpu", torch.float64)
    stray = (r != 0) & ~keep
    if stray.any():
        i, t = (int(x) for x in stray.nonzero()[0])
        raise ValueError(f"row {i}: reward {float(r[i, t])} at position {t}, which is not a generated token")
    v = values.detach().to("cpu", torch.float64)
    adv = torch.zeros_like(r)
    for i in range(r.shape[0]):
        next_value = 0.0
        next_adv = 0.0
        for t in reversed(keep[i].nonzero().flatten().tolist()):
            delta = float(r[i, t]) + gamma * next_value - float(v[i, t])
            next_adv = delta + gamma * lam * next_adv
            next_value = float(v[i, t])
            adv[i, t] = next_adv
    returns = torch.where(keep, adv + v, torch.zeros_like(adv))
    return adv.to(values.dtype), returns.to(values.dtype)
