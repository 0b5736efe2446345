"""actors/learner/row_attention.py: shared-prompt rows' attention without the dense mask's masked pairs equals
SDPA under the dense row mask of grpo.batch.pack_shared, values and gradients, and the learner runs it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from actors.learner.row_attention import NAME, shared_rows_attention
from grpo.batch import Sample, pack_shared


def episodes(prompt: list[int], lengths: list[int]) -> list[Sample]:
    return [Sample(prompt, [9] * n, [1] * n, [0.0] * n) for n in lengths]


def test_rows_attention_is_the_masked_attention_of_the_row() -> None:
    # two rows of different widths (the second padded), one with a response of 0 tokens; 4 query heads over
    # 2 kv heads (grouped-query attention)
    batch = episodes([1, 2, 3, 4, 5], [3, 7, 0, 4]) + episodes([6, 7], [2, 5])
    packed = pack_shared(batch, pad_id=0)
    segments = [[n for n in row if n >= 0] for row in packed["row_segments"].tolist()]
    assert segments == [[5, 3, 7, 0, 4], [2, 2, 5]]
    b, width = packed["rows"].shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, 4, width, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, 2, width, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, 2, width, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(b, width, 4, 8, generator=gen, dtype=torch.float64)
    real = torch.zeros(b, width, 1, 1, dtype=torch.float64)  # the row positions that hold tokens
    for row, seg in enumerate(segments):
        real[row, : sum(seg)] = 1

    got, _ = shared_rows_attention(torch.nn.Module(), q, k, v, packed["row_mask"], scaling=0.3, row_segments=segments)
    k2, v2 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = F.scaled_dot_product_attention(q, k2, v2, attn_mask=packed["row_mask"], scale=0.3).transpose(1, 2)
    assert got.shape == want.shape == (b, width, 4, 8)
    torch.testing.assert_close(got * real, want * real)
    assert not got[1, sum(segments[1]) :].any()  # padding: zeros, read by no loss position

    grads = torch.autograd.grad((got * real * weights).sum(), (q, k, v))
    wanted = torch.autograd.grad((want * real * weights).sum(), (q, k, v))
    for g, w in zip(grads, wanted, strict=True):
        torch.testing.assert_close(g, w)


def test_without_row_segments_it_is_transformers_sdpa() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=gen) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    got, _ = shared_rows_attention(module, q, k, v, None, scaling=0.5)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5).transpose(1, 2)
    torch.testing.assert_close(got, want)


def test_the_learner_runs_rows_through_it_and_only_with_shared_prompts() -> None:
    from actors.learner import Learner
    from configs.schema import Config

    def learner(shared: bool) -> Learner:
        cfg = Config.model_validate(
            {"model": {"name": "tiny-random"}, "finetune": {"mode": "lora"}, "learner": {"shared_prompt": shared}}
        )
        out = Learner(cfg)
        out.setup()
        return out

    assert learner(True).model.config._attn_implementation == NAME
    assert learner(False).model.config._attn_implementation == "sdpa"
