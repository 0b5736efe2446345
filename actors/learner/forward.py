"""The learner's forward passes: micro-batches (the same count on every rank), packing, the (selective)
forward to token logprobs, entropy and PPO's values, the reference's logprobs, and the scoring pass with
no gradient (`score`) (a mixin of `Learner`, actors/learner/__init__.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from actors.learner.model import REF_ADAPTER

if TYPE_CHECKING:
    import torch
    from torch import nn

    from grpo.batch import Sample


class ForwardPasses:
    """Batches through the policy and the reference; uses the attributes `Learner.__init__` sets."""

    def score(self, samples: list[dict[str, Any]]) -> list[list[float]]:
        """The current policy's logprob of every response token of each sample (no update; a collective)."""
        from grpo.batch import as_sample

        self._require_setup()
        batch = [as_sample(s, i) for i, s in enumerate(samples)]
        old, _, _ = self._score(batch, reference=False, selective=False)
        assert old is not None
        return [old[i][len(s.prompt_ids) - 1 :].tolist() for i, s in enumerate(batch)]

    def _score(
        self,
        batch: list[Sample],
        reference: bool = True,
        policy: bool = True,
        selective: bool = True,
        values_out: list[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None, dict[str, float]]:
        """Per sample (length num_tokens−1): the current policy's logprobs (None when not `policy`), and
        the reference's (None without one); `selective`: only at trained positions (0 elsewhere).
        `values_out` (PPO, with `policy`): filled with the value head's values per sample, like the logprobs.
        Metrics: entropy (0 when not `policy`), tokens, samples, batch_tokens. With neither to compute,
        no forward runs (the counts are still reduced)."""
        import torch

        from grpo.losses import masked_mean

        old: list[torch.Tensor | None] | None = [None] * len(batch) if policy else None
        vals: list[torch.Tensor | None] = [None] * len(batch)
        ref: list[torch.Tensor | None] | None = [None] * len(batch) if reference and self.ref_kind != "none" else None
        ent_sum = 0.0
        tokens = 0.0 if policy else float(sum(sum(s.loss_mask) for s in batch))
        self.model.eval()
        with torch.no_grad():
            for micro in self._micro_batches(batch, indices=True) if old is not None or ref is not None else ():
                packed = self._pack([batch[i] for i in micro])
                logp = None
                if old is not None:
                    sink = [] if values_out is not None else None
                    logp, entropy = self._token_logprobs(
                        self.model, packed, entropy=True, selective=selective, values=sink
                    )
                    logp = logp.float()
                    mask = packed["loss_mask"].to(logp.device)
                    if micro:
                        n_tok = float(mask.sum())
                        ent_sum += float(masked_mean(entropy, mask)) * n_tok
                        tokens += n_tok
                    del entropy
                ref_logp = self._reference_logprobs(packed, selective) if ref is not None else None
                for row, i in enumerate(micro):
                    n = batch[i].num_tokens - 1
                    if old is not None:
                        old[i] = logp[row, :n].cpu()
                        if sink:
                            vals[i] = sink[0][row, :n].detach().float().cpu()
                    if ref is not None:
                        ref[i] = ref_logp[row, :n].cpu()
        if old is not None or self.ref_kind in ("disabled_adapter", "adapter"):
            self.backend.reshard(self.model)
        if self.ref_kind == "model" and ref is not None:
            self.backend.reshard(self.reference)
        if values_out is not None and old is not None:
            values_out[:] = vals
        batch_tokens = float(sum(s.num_tokens for s in batch))
        totals = self._all_reduce_sum([ent_sum, tokens, float(len(batch)), batch_tokens])
        metrics = {
            "entropy": totals[0] / totals[1] if totals[1] else 0.0,
            "tokens": totals[1],
            "samples": totals[2],
            "batch_tokens": totals[3],
        }
        return old, ref, metrics  # type: ignore[return-value]

    def _reference_logprobs(self, packed: dict[str, torch.Tensor], selective: bool = True) -> torch.Tensor:
        if self.ref_kind == "disabled_adapter":
            with self.model.disable_adapter():
                logp, _ = self._token_logprobs(self.model, packed, selective=selective)
        elif self.ref_kind == "adapter":
            logp, _ = self._token_logprobs(self.model, packed, selective=selective, adapter=REF_ADAPTER)
        elif self.ref_kind == "model":
            logp, _ = self._token_logprobs(self.reference, packed, selective=selective)
        else:  # offloaded_model: whole, on the CPU
            with _cpu_autocast(self.reference, self.cfg.learner.dtype):
                logp, _ = self._token_logprobs(self.reference, packed, selective=selective, device="cpu")
        return logp.float()

    def _micro_batches(self, batch: Sequence[Sample], indices: bool = False) -> Iterator[list[Any]]:
        """Micro-batches of `batch` (index lists, or samples), padded with empty ones to the largest
        count of any rank: every rank must run the same number of forwards and backwards."""
        from grpo.batch import split_by_tokens, split_shared

        budget = self.cfg.learner.micro_batch_tokens
        if not batch:
            groups = []
        elif self._shared:
            groups = split_shared(batch, budget, self._pair_cost)
        else:
            groups = split_by_tokens(batch, budget)
        count = int(self._all_reduce_max(len(groups)))
        for k in range(count):
            group = groups[k] if k < len(groups) else []
            yield group if indices else [batch[i] for i in group]

    @property
    def _shared(self) -> bool:
        """Shared-prompt rows (`learner.shared_prompt`) serve the selective path only: it needs no logits at
        the positions a row does not have."""
        return self.cfg.learner.shared_prompt and self.cfg.learner.selective_logits

    @property
    def _pair_cost(self) -> float:
        """grpo.batch.share_pays' constant: 0 (always share) with `learner.shared_prompt_when: always`."""
        from grpo.batch import attention_pair_cost

        when = self.cfg.learner.shared_prompt_when
        return attention_pair_cost(self.hidden_size) if when == "cheaper" and self.hidden_size > 0 else 0.0

    def _pack(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        """grpo.batch.pack (pack_shared with `learner.shared_prompt`), or for an empty micro-batch a
        two-pad-token row with nothing to learn."""
        import torch

        from grpo.batch import pack, pack_shared, shares

        if samples:
            # rows with an attention mask of their own only where a prompt is shared (not for SFT demonstrations,
            # nor for groups whose long responses make a row cost more than its episodes whole)
            cost = self._pair_cost
            if self._shared and shares(samples, cost):
                return pack_shared(samples, self.pad_id, cost)
            return pack(samples, self.pad_id)
        return {
            "input_ids": torch.full((1, 2), self.pad_id, dtype=torch.long),
            "attention_mask": torch.ones((1, 2), dtype=torch.long),
            "loss_mask": torch.zeros((1, 1)),
            "rollout_logprobs": torch.zeros((1, 1)),
            "advantages": torch.zeros(1),
        }

    def _token_logprobs(
        self,
        model: nn.Module,
        packed: dict[str, torch.Tensor],
        *,
        entropy: bool | str = False,
        selective: bool = True,
        device: str | None = None,
        values: list[torch.Tensor] | None = None,
        adapter: str | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p of each next token, [N, T−1], and with `entropy` the next-token entropy ("metric": without
        gradient). Selective (`learner.selective_logits`): the output layer runs only where the loss mask
        is 1 (about a fifth of an episode's tokens), and both are 0 elsewhere; the float32 softmax over
        the vocabulary at every position is most of a small model's step otherwise.
        `values` (PPO): the value head runs on the same forward's last hidden states and its [N, T−1]
        values (aligned like logp, 0 where logp is 0) are appended to this list."""
        import torch

        from grpo.losses import entropy_from_logits, token_logprobs

        assert self.backend is not None and self.device is not None
        ids = packed["input_ids"]
        dev = device or self.device
        keep = picked = None
        inputs = {"input_ids": ids.to(dev)}
        if self.cfg.learner.pad_mask:
            inputs["attention_mask"] = packed["attention_mask"].to(dev)
        if selective and self.cfg.learner.selective_logits:
            keep = torch.zeros(ids.shape, dtype=torch.bool)
            keep[:, :-1] = packed["loss_mask"] > 0
            if "rows" not in packed:
                picked = keep.flatten().nonzero().squeeze(1)
            else:  # shared-prompt rows: the same positions, found where the rows hold them
                picked = packed["source"][keep[:, :-1]]
                inputs = {
                    "input_ids": packed["rows"].to(dev),
                    "position_ids": packed["row_positions"].to(dev),
                    "attention_mask": packed["row_mask"].to(dev),
                    "row_segments": [[n for n in row if n >= 0] for row in packed["row_segments"].tolist()],
                }
        if adapter is not None:  # PEFT's per-row adapter choice
            kwargs["adapter_names"] = [adapter] * inputs["input_ids"].shape[0]
        raw_values: list[torch.Tensor] = []
        head = self.value_head if values is not None else None
        # The value hook is registered after the selecting one, so it sees the same (selected) hidden states.
        with self.backend.compute(), _output_layer_at(model, picked), _value_head_at(model, head, raw_values):
            logits = self.backend.forward(model, **inputs, use_cache=False, **kwargs).logits
        if values is not None:
            v = raw_values[0]
            values.append(v[:, :-1] if keep is None else _scatter_kept(v, keep))
        if keep is None:
            logp = token_logprobs(logits, ids.to(logits.device))
            with torch.no_grad() if entropy == "metric" else contextlib.nullcontext():
                ent = entropy_from_logits(logits) if entropy else None
            return logp, ent
        # logits: [1, K+1, V], row k predicting the k-th kept target; the last row is a placeholder.
        targets = torch.cat([ids.new_zeros(1), ids[:, 1:][keep[:, :-1]]]).to(logits.device)
        logp = _scatter_kept(token_logprobs(logits, targets[None]), keep)
        with torch.no_grad() if entropy == "metric" else contextlib.nullcontext():
            ent = _scatter_kept(entropy_from_logits(logits), keep) if entropy else None
        return logp, ent


def _cpu_autocast(model: nn.Module, dtype: str) -> contextlib.AbstractContextManager[Any]:
    """Compute in `dtype` on the CPU when the model's weights are stored wider (an ema reference)."""
    import torch

    stored = next(model.parameters()).dtype
    if stored == getattr(torch, dtype):
        return contextlib.nullcontext()
    return torch.autocast(device_type="cpu", dtype=getattr(torch, dtype))


@contextlib.contextmanager
def _output_layer_at(model: nn.Module, picked: torch.Tensor | None) -> Iterator[None]:
    """While open, the model's output layer (LM head) sees only the hidden states at `picked` (K flat
    indices b·L + l into the forward's [B, L] positions; one may repeat), as one row [1, K+1, H], then the
    last position of row 0 as a placeholder (never picked: in a plain batch it predicts nothing). The
    placeholder keeps every layer in the graph when K is 0 (an empty micro-batch), so all ranks still run
    the same backward collectives. A forward pre-hook, so it works whatever wraps the model (PEFT, FSDP2)."""
    if picked is None:
        yield
        return
    import torch

    def select(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        rows = torch.cat([hidden.flatten(0, 1)[picked.to(hidden.device)], hidden[0, -1:]])
        return (rows[None], *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _value_head_at(model: nn.Module, head: nn.Module | None, out: list[torch.Tensor]) -> Iterator[None]:
    """While open (with a `head`), each forward appends head(h) to `out`, h the output layer's input (the
    last hidden states, [N, T, H], or the rows `_output_layer_at` selected, [1, K+1, H]): [N, T] or
    [1, K+1] in float32. Run inside the forward, so a sharded model's parameters are there."""
    if head is None:
        yield
        return

    def run(_module: nn.Module, args: tuple[Any, ...]) -> None:
        hidden = args[0]
        out.append(head(hidden.to(head.weight.dtype)).squeeze(-1).float())

    handle = model.get_output_embeddings().register_forward_pre_hook(run)
    try:
        yield
    finally:
        handle.remove()


def _scatter_kept(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[1, K] values of the kept positions → [N, T−1], 0 elsewhere (differentiable)."""
    mask = keep[:, :-1].to(values.device)
    return values.new_zeros(mask.shape).masked_scatter(mask, values[0])
