"""The learner's steps: a GRPO or PPO iteration (`train_step`) and a supervised one (`sft_step`)
(a mixin of `Learner`, actors/learner/__init__.py).

One GRPO iteration (`train_step`) on this rank's share of the batch:

1. Score, once, with no gradient: old_t = log π_old(token) (the policy before this iteration's updates),
   ref_t = log π_ref(token) when `algorithm.kl_coef > 0`, and the entropy of π_old as a metric.
   Strictly on-policy (train.epochs = 1 and train.minibatches = 1: one optimizer step) π_old is the policy
   that the training forward runs, so no policy scoring pass: old_t = the forward's own logprobs, detached
   (ρ_t = 1, ∇ρ_t = ∇log π_t: the same gradient), and the entropy metric comes from that forward too.
2. For each epoch, for each of `train.minibatches` slices: micro-batches of at most
   `learner.micro_batch_tokens` padded tokens (grpo.batch.split_by_tokens), gradients accumulated,
       L = Σ_micro Σ_tokens ℓ_t / N_minibatch        (grpo.losses.policy_loss)
   where N_minibatch is the minibatch's masked token (or sequence) count summed over all ranks, so the
   micro-batch losses of all ranks add up to the minibatch mean. The gradient norm is clipped to
   `learner.optim.grad_clip`, then one optimizer and one scheduler step.
3. The reference moves per `learner.reference`, every `reference_every` iterations (N): fixed; periodic
   (ref ← policy); ema (ref ← a·ref + (1−a)·policy). The iteration counter that times it is checkpointed
   with the reference, so a resumed run updates it at the same iterations as an unbroken one.

Dr. GRPO (`algorithm.advantage: dr_grpo`): step 2's N_minibatch is the constant N_seq · L_max instead
(grpo/losses.py), N_seq the minibatch's samples over all ranks.

PPO (`algorithm.name: ppo`): the policy carries a value head (Linear(hidden, 1) on the output layer's input,
read by a forward pre-hook in the same forward as the logprobs; trained beside the adapter or the full
model, checkpointed, never pushed to the engines nor copied into the reference). Step 1 always runs the
scoring pass, which also gives V_old; GAE over each sample's generated tokens (grpo/gae.py) gives
per-token advantages, whitened over the batch's generated tokens on all ranks, and returns; step 2 adds
`value_loss_coef` × the (clipped) value loss, reduced like the policy loss.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from grpo.batch import Sample


class TrainingSteps:
    """GRPO, PPO and SFT optimizer steps; uses the attributes `Learner.__init__` sets and the other mixins."""

    @property
    def dr_grpo_norm_tokens(self) -> int:
        """Dr. GRPO's L_max: `algorithm.dr_grpo_norm_tokens`, else the episode's generation budget
        (max_new_tokens per turn × the turn budget)."""
        alg = self.cfg.algorithm
        if alg.dr_grpo_norm_tokens is not None:
            return alg.dr_grpo_norm_tokens
        return self.cfg.rollout.sampling.max_new_tokens * self.cfg.generation.max_turns

    def train_step(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """One GRPO iteration on this rank's share of the batch; metrics are global (all ranks).

        tokens: masked (trained) tokens; tokens_per_s: prompt+response tokens of the whole batch (all
        ranks) per second of step time; ratio_std_after_first: ratio std over the optimizer steps after
        the first (absent with one step per iteration)."""
        from grpo.batch import as_sample

        self._require_setup()
        t0 = time.monotonic()
        self._sft_optimizer = None  # supervised warm start is over: free its state
        batch = [as_sample(s, i) for i, s in enumerate(samples)]
        tr, alg = self.cfg.train, self.cfg.algorithm
        # PPO's GAE needs the values before the update: it always runs the scoring pass.
        on_policy = self.reuse_forward_logprobs and tr.epochs == 1 and tr.minibatches == 1 and not self.ppo
        ppo, ppo_metrics = None, {}
        if self.ppo:
            old_values: list[torch.Tensor] = []
            old, ref, score_metrics = self._score(batch, values_out=old_values)
            ppo, ppo_metrics = self._ppo_targets(batch, old_values)
        else:
            old, ref, score_metrics = self._score(batch, policy=not on_policy)

        slices = [list(range(len(batch)))[k :: tr.minibatches] for k in range(tr.minibatches)]
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        grad_norms: list[float] = []
        lr = 0.0
        opt_steps = 0
        for _ in range(tr.epochs):
            for idx in slices:
                lr = self.optimizer.param_groups[0]["lr"]
                m, norm = self._optimizer_step(
                    [batch[i] for i in idx],
                    [old[i] for i in idx] if old is not None else None,
                    [ref[i] for i in idx] if ref is not None else None,
                    tuple([rows[i] for i in idx] for rows in ppo) if ppo is not None else None,
                )
                grad_norms.append(norm)
                _accumulate(sums, weights, m, m["tokens"])
                if opt_steps > 0:
                    _accumulate(sums, weights, {"ratio_std_after_first": m["ratio_std"]}, m["tokens"])
                opt_steps += 1
                self.step += 1
        self.iteration += 1
        self._refresh_reference()

        # Metrics were reduced over ranks already (weighted by tokens); the score pass gives entropy.
        out = {k: sums[k] / weights[k] if weights[k] else 0.0 for k in sums}
        out.pop("tokens", None)
        if alg.entropy_coef == 0 and not on_policy:
            out["entropy"] = score_metrics["entropy"]
        out.update(ppo_metrics)
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["lr"] = float(lr)
        out["tokens"] = score_metrics["tokens"]
        out["samples"] = score_metrics["samples"]
        elapsed = time.monotonic() - t0
        out["step_time_s"] = elapsed
        out["tokens_per_s"] = score_metrics["batch_tokens"] / elapsed if elapsed > 0 else 0.0
        if opt_steps <= 1:
            out.pop("ratio_std_after_first", None)
        return out

    def sft_step(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """One optimizer step of masked NLL over `samples` (loss_mask marks the assistant tokens).

        Uses its own AdamW at `sft_warmup.lr` (constant), so the RL optimizer's moments and schedule
        start clean; that optimizer is dropped at the first `train_step`. Returns sft_loss (the mean NLL
        before the step, all ranks), grad_norm, tokens, samples, step_time_s, tokens_per_s.
        """
        from grpo.batch import as_sample
        from grpo.losses import sft_loss

        self._require_setup()
        t0 = time.monotonic()
        batch = [as_sample(s, i, supervised=True) for i, s in enumerate(samples)]
        if self._sft_optimizer is None:
            self._sft_optimizer = self._adamw(self.cfg.sft_warmup.lr)
        normalizer = self._all_reduce_sum([float(sum(sum(s.loss_mask) for s in batch))])[0]
        if normalizer == 0:
            raise ValueError("sft_step: no sample of any rank has a token with loss_mask 1")
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        self.model.train()
        for micro in self._micro_batches(batch):
            packed = self._pack(micro)
            logp, _ = self._token_logprobs(self.model, packed)
            loss, m = sft_loss(logp, packed["loss_mask"].to(logp.device), normalizer=normalizer)
            self.backend.backward(loss)
            _accumulate(sums, weights, {"sft_loss": m["sft_loss"]}, m["tokens"])
        norm = self.backend.step(self._sft_optimizer, self._trainable, self.cfg.learner.optim.grad_clip)
        batch_tokens = float(sum(s.num_tokens for s in batch))
        totals = self._all_reduce_sum(
            [sums.get("sft_loss", 0.0), weights.get("sft_loss", 0.0), float(len(batch)), batch_tokens]
        )
        elapsed = time.monotonic() - t0
        return {
            "sft_loss": totals[0] / totals[1] if totals[1] else 0.0,
            "grad_norm": norm,
            "tokens": totals[1],
            "samples": totals[2],
            "step_time_s": elapsed,
            "tokens_per_s": totals[3] / elapsed if elapsed > 0 else 0.0,
        }

    def _ppo_targets(
        self, batch: list[Sample], old_values: list[torch.Tensor]
    ) -> tuple[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]], dict[str, float]]:
        """PPO: per sample (length num_tokens−1, 0 off the trained tokens) the GAE advantages (whitened over
        the whole batch's generated tokens, all ranks, with `algorithm.whiten_advantages`), the old values
        and the returns (grpo/gae.py); and global metrics: returns_mean, explained_variance (of the returns
        by the old values; 0 when the returns do not vary), advantage_mean/advantage_std (before whitening)."""
        import torch

        from grpo.gae import gae

        alg = self.cfg.algorithm
        advs, rets = [], []
        for i, (s, values) in enumerate(zip(batch, old_values, strict=True)):
            if s.token_rewards is None:
                raise ValueError(f"algorithm.name is ppo, but sample {i} has no token_rewards (grpo.gae.token_rewards)")
            p, n = len(s.prompt_ids), s.num_tokens - 1
            rewards, mask = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
            rewards[p - 1 :] = torch.tensor(s.token_rewards, dtype=torch.float64)
            mask[p - 1 :] = torch.tensor(s.loss_mask, dtype=torch.float64)
            a, r = gae(rewards[None], values.double()[None], mask[None], alg.gamma, alg.lam)
            advs.append(a[0])
            rets.append(r[0])
        m = [torch.tensor([0.0] * (len(s.prompt_ids) - 1) + [float(x) for x in s.loss_mask]) for s in batch]
        sums = [
            sum(float((t * k).sum()) for t, k in zip(ts, m, strict=True))
            for ts in (
                [torch.ones_like(k) for k in m],
                advs,
                [a * a for a in advs],
                rets,
                [r * r for r in rets],
                [r - v.double() for r, v in zip(rets, old_values, strict=True)],
                [(r - v.double()) ** 2 for r, v in zip(rets, old_values, strict=True)],
            )
        ]
        count, a_sum, a_sq, r_sum, r_sq, e_sum, e_sq = self._all_reduce_sum(sums)
        n = max(count, 1.0)
        a_mean, r_mean = a_sum / n, r_sum / n
        a_std = math.sqrt(max(a_sq / n - a_mean**2, 0.0))
        r_var = max(r_sq / n - r_mean**2, 0.0)
        e_var = max(e_sq / n - (e_sum / n) ** 2, 0.0)
        if alg.whiten_advantages:
            advs = [(a - a_mean) / (a_std + 1e-8) * k for a, k in zip(advs, m, strict=True)]
        metrics = {
            "returns_mean": r_mean,
            "explained_variance": 1.0 - e_var / r_var if r_var > 0 else 0.0,
            "advantage_mean": a_mean,
            "advantage_std": a_std,
        }
        as32 = [[t.float() for t in rows] for rows in (advs, old_values, rets)]
        return (as32[0], as32[1], as32[2]), metrics

    def _optimizer_step(
        self,
        minibatch: list[Sample],
        old: list[torch.Tensor] | None,
        ref: list[torch.Tensor] | None,
        ppo: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> tuple[dict[str, float], float]:
        """Accumulate the minibatch's gradients over micro-batches, clip, step. Metrics are global.

        `old` None: strictly on-policy, old_t = this forward's logprobs, detached; the entropy metric is
        then taken from this forward as well (when the loss does not compute it already).
        `ppo`: per sample, (advantages, old values, returns) from `_ppo_targets`: per-token advantages and
        the value loss beside the policy loss, reduced alike."""

        from grpo.losses import dr_grpo_normalizer, masked_mean, policy_loss, value_loss

        alg = self.cfg.algorithm
        reduction = alg.loss_reduction
        if alg.advantage == "dr_grpo" and not self.ppo:
            # A constant: episodes of the minibatch (all ranks) × the generation budget, not its token count.
            reduction = "token"
            normalizer = dr_grpo_normalizer(self._all_reduce_sum([float(len(minibatch))])[0], self.dr_grpo_norm_tokens)
        else:
            if alg.loss_reduction == "token":
                count = float(sum(sum(s.loss_mask) for s in minibatch))
            else:
                count = float(sum(1 for s in minibatch if any(s.loss_mask)))
            normalizer = self._all_reduce_sum([count])[0]
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        self.model.train()
        for micro in self._micro_batches(minibatch, indices=True):
            packed = self._pack([minibatch[i] for i in micro])
            width = packed["loss_mask"].shape[1]
            # On-policy without an entropy term, the entropy metric comes from this forward (no grad).
            metric_entropy = old is None and alg.entropy_coef == 0
            sink: list[torch.Tensor] | None = [] if ppo is not None else None
            logp, entropy = self._token_logprobs(
                self.model, packed, entropy="metric" if metric_entropy else alg.entropy_coef > 0, values=sink
            )
            dev = logp.device
            if old is None:
                old_logp = logp.detach().float()
                if metric_entropy:
                    mask = packed["loss_mask"].to(dev)
                    ent = float(masked_mean(entropy, mask)) if micro else 0.0
                    _accumulate(sums, weights, {"entropy": ent}, float(mask.sum()) if micro else 0.0)
                    entropy = None
            else:
                old_logp = _pad_rows([old[i] for i in micro], width).to(dev)
            advantages = packed["advantages"] if ppo is None else _pad_rows([ppo[0][i] for i in micro], width)
            loss, m = policy_loss(
                logp,
                old_logp,
                advantages.to(dev),
                packed["loss_mask"].to(dev),
                clip_eps_low=alg.clip_eps_low,
                clip_eps_high=alg.clip_eps_high,
                reduction=reduction,
                ref_logprobs=_pad_rows([ref[i] for i in micro], width).to(dev) if ref is not None else None,
                kl_coef=alg.kl_coef,
                kl_estimator=alg.kl_estimator,
                entropy=entropy,
                entropy_coef=alg.entropy_coef,
                rollout_logprobs=packed["rollout_logprobs"].to(dev),
                tis_cap=alg.tis_cap,
                normalizer=normalizer,
            )
            if ppo is not None:
                v_loss, vm = value_loss(
                    sink[0],
                    _pad_rows([ppo[1][i] for i in micro], width).to(dev),
                    _pad_rows([ppo[2][i] for i in micro], width).to(dev),
                    packed["loss_mask"].to(dev),
                    clip=alg.value_clip,
                    reduction=reduction,
                    normalizer=normalizer,
                )
                loss = loss + alg.value_loss_coef * v_loss
                _accumulate(
                    sums, weights, {k: vm[k] for k in ("value_loss", "value_mean", "value_clip_frac")}, vm["tokens"]
                )
            self.backend.backward(loss)
            keys = ("policy_loss", "kl", "ratio_mean", "ratio_std", "clip_frac", "logprob_gap")
            _accumulate(sums, weights, {k: m[k] for k in keys if k in m}, m["tokens"])
            if "entropy" in m:
                _accumulate(sums, weights, {"entropy": m["entropy"]}, m["tokens"])
        norm = self.backend.step(self.optimizer, self._trainable, self.cfg.learner.optim.grad_clip)
        self.scheduler.step()
        return self._reduce_weighted(sums, weights), norm

    def _reduce_weighted(self, sums: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
        """Token-weighted means over all ranks, plus "tokens" (the total weight of policy_loss).

        Every rank has the same keys: policy_loss always reports them, on empty micro-batches too."""
        keys = sorted(sums)
        n = len(keys)
        reduced = self._all_reduce_sum([sums[k] for k in keys] + [weights[k] for k in keys])
        metrics = {k: reduced[i] / reduced[n + i] if reduced[n + i] else 0.0 for i, k in enumerate(keys)}
        metrics["tokens"] = reduced[n + keys.index("policy_loss")] if "policy_loss" in keys else 0.0
        return metrics


def _accumulate(sums: dict[str, float], weights: dict[str, float], values: dict[str, float], weight: float) -> None:
    for k, v in values.items():
        sums[k] = sums.get(k, 0.0) + v * weight
        weights[k] = weights.get(k, 0.0) + weight


def _pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-sample vectors right-padded with 0 to [len(rows), width] (like grpo.batch.pack); [1, width] if empty."""
    import torch

    out = torch.zeros((max(1, len(rows)), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out
