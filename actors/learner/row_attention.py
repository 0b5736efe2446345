"""Attention over shared-prompt rows (grpo.batch.pack_shared) at the cost of the pairs that attend.

A shared-prompt row is one prompt, then G responses, each response attending to the prompt and to its own
earlier tokens. Through the dense [L, L] mask, SDPA's CPU kernel computes every query-key pair of the row,
masked or not: for a 350-token prompt and 4 responses of 175 tokens, 1.1M pairs a head, where 0.43M attend.
Here the prompt runs under the causal kernel (which skips the upper triangle), and the responses as one
batch, each against [prompt; itself] under a small mask. The same softmax over the same keys: the same
attention, up to the order of float additions.

The model is switched to this function (`use_row_attention`) under a name of its own; a forward without
`row_segments` (every batch that is not made of shared rows) runs transformers' SDPA attention unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

NAME = "mcprl_shared_rows"


def shared_rows_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    row_segments: Sequence[Sequence[int]] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, H, L, D], key/value [B, H_kv, L, D] → [B, L, H, D].

    `row_segments[b]` = [prompt length, response lengths...] of row b, in the order pack_shared lays them out;
    positions after the last response (padding) get zeros, which no loss position reads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if row_segments is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    repeat = query.shape[1] // key.shape[1]  # grouped-query attention: each kv head serves `repeat` query heads
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    rows = [_row(query[b], key[b], value[b], segments, scaling, dropout) for b, segments in enumerate(row_segments)]
    return torch.stack(rows).transpose(1, 2).contiguous(), None


def _row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[int], scale: float | None, dropout: float
) -> torch.Tensor:
    """One row's attention output [H, L, D]; q, k, v: [H, L, D]."""
    p, lengths = int(segments[0]), [int(r) for r in segments[1:]]
    # The causal kernel skips the upper triangle. As a batch of one: SDPA's fused CPU kernel takes 4-d inputs
    # only, and with 3-d ones its math path ran (~1.3x the time, forward and backward, on e2e's prompt).
    prompt = F.scaled_dot_product_attention(
        q[None, :, :p], k[None, :, :p], v[None, :, :p], dropout_p=dropout, is_causal=True, scale=scale
    )[0]
    parts = [prompt]
    if lengths:
        width = max(lengths)
        starts = [p + sum(lengths[:i]) for i in range(len(lengths))]

        def padded(x: torch.Tensor, start: int, r: int) -> torch.Tensor:
            return F.pad(x[:, start : start + r], (0, 0, 0, width - r))

        qs = torch.stack([padded(q, s, r) for s, r in zip(starts, lengths, strict=True)])
        prompt_k, prompt_v = k[:, :p].expand(len(lengths), -1, -1, -1), v[:, :p].expand(len(lengths), -1, -1, -1)
        ks = torch.cat([prompt_k, torch.stack([padded(k, s, r) for s, r in zip(starts, lengths, strict=True)])], dim=2)
        vs = torch.cat([prompt_v, torch.stack([padded(v, s, r) for s, r in zip(starts, lengths, strict=True)])], dim=2)
        # [G, 1, width, p + width]: the prompt, then the response's own earlier tokens (a padded query row
        # sees its own column too, so no softmax row is empty)
        own = torch.ones((width, width), dtype=torch.bool, device=q.device).tril()
        mask = torch.cat([torch.ones((width, p), dtype=torch.bool, device=q.device), own], dim=1)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[None, None], dropout_p=dropout, scale=scale)
        parts += [out[i, :, :r] for i, r in enumerate(lengths)]
    used = p + sum(lengths)
    if used < q.shape[1]:
        parts.append(q.new_zeros((q.shape[0], q.shape[1] - used, q.shape[2])))
    return torch.cat(parts, dim=1)


def use_row_attention(model: torch.nn.Module) -> None:
    """Switch a transformers model (before PEFT and sharding wrap it) to `shared_rows_attention`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, shared_rows_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # plain batches get SDPA's masks as before
    model.set_attn_implementation(NAME)
