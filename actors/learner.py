"""The learner: one rank of the training group (a plain class; orchestration/learner_group.py makes it a Ray actor).

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

Collectives: every rank runs the same number of forwards and backwards (the largest micro-batch count
of any rank; the others run empty micro-batches with a zero mask), or the sharded model's gathers hang.

The reference: LoRA → the same model with the adapter disabled (no memory), or, when it must move,
start from `finetune.init_adapter` or become the warm-started policy (`sft_warmup.enabled`: the driver
calls `reset_reference` after the warm start), a second frozen adapter "reference" (adapter-sized); full
fine-tune → a frozen copy of the model (sharded like the policy, or whole on the CPU with
`reference_cpu_offload`). Checkpoints hold the reference adapter with the policy's (both are `lora_`).

Precision: what trains is kept in float32 (full mode: the whole model; LoRA: the adapter, over a frozen
base in `learner.dtype`); the forward computes in `learner.dtype` (see actors/sharding.py).
QLoRA (`finetune.mode: qlora`, one rank) is LoRA over a base loaded in 4 bit (actors/qlora.py): the
reference, pushes and checkpoints are LoRA's; a merged push dequantizes the base.

Checkpoints are folders: `state/` (torch.distributed.checkpoint: trained parameters + optimizer, any world
size), `rng-<rank>.pt`, `trainer.pt` (scheduler, counters), `meta.json` (mode, counters, the caller's
`extra`), and for LoRA `adapter/` (PEFT format). On a path they are written to a temporary folder and
renamed; at a storage URI (cluster/storage.py) every rank uploads its files, and meta.json goes last.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.adapter_io import pack_adapter, write_adapter
from configs.schema import Config

if TYPE_CHECKING:
    import torch
    from torch import nn

    from actors.sharding import ShardingBackend
    from grpo.batch import Sample

log = logging.getLogger(__name__)

_ADAPTER = "default"  # PEFT's name of the trained adapter
_REF_ADAPTER = "reference"  # the frozen copy used as KL reference when it must move
_VALUE_HEAD = "value_head"  # PPO: Linear(hidden, 1) on the policy's last hidden state
_CKPT_FORMAT = 1


class CheckpointError(ValueError):
    """A folder that is not a (compatible) learner checkpoint."""


class Learner:
    """One rank of the learner group. See the module docstring for the contract."""

    def __init__(
        self, cfg: Config, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1", master_port: int = 0
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Learner: rank {rank} is not in a group of world_size {world_size}")
        if world_size > 1 and not master_addr.startswith("file://") and not 0 < master_port < 65536:
            raise ValueError(f"Learner: world_size {world_size} needs a master_port (got {master_port})")
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.lora = cfg.finetune.trains_adapter  # lora or qlora
        self.qlora = cfg.finetune.mode == "qlora"
        if self.qlora and world_size != 1:
            raise ValueError(f"Learner: finetune.mode qlora runs on one rank (learner.workers 1), not {world_size}")
        self.model: Any = None
        self.reference: Any = None  # full mode: the frozen copy
        self.ref_kind = "none"  # none | disabled_adapter | adapter | model | offloaded_model
        self.backend: ShardingBackend | None = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self._sft_optimizer: Any = None
        self.device: torch.device | None = None
        self.pad_id = 0
        self.hidden_size = 0  # the model's, for the shared-prompt cost rule (grpo.batch.attention_pair_cost)
        self.step = 0  # optimizer steps of RL training
        self.iteration = 0  # train_step calls
        self._trainable: list[torch.Tensor] = []
        # Strictly on-policy steps take old_t from the training forward (see the module doc); False forces
        # the scoring pass (tests compare the two).
        self.reuse_forward_logprobs = True
        self._export_keys: dict[str, str] | None = None  # export_adapter: parameter name -> PEFT key
        self.ppo = cfg.algorithm.name == "ppo"
        self.value_head: Any = None  # PPO: a submodule of the policy, trained, checkpointed, never pushed

    # ------------------------------------------------------------------ setup

    def setup(self) -> dict[str, Any]:
        """Join the process group, load and shard the model, build optimizer and schedule."""
        import torch

        from actors.models import load_tokenizer
        from actors.sharding import make_backend

        t0 = time.monotonic()
        self.device = self._pick_device()
        if self.device.type == "cpu":
            # Ray sets OMP_NUM_THREADS=1 for actors with fractional CPUs, which makes CPU training crawl:
            # share the machine's cores among the ranks instead.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
        if self.world_size > 1:
            self._init_process_group()
        dtype = getattr(torch, self.cfg.learner.dtype)
        self.backend = make_backend(
            self.cfg.learner.backend,
            world_size=self.world_size,
            rank=self.rank,
            device=self.device,
            dtype=dtype,
            deepspeed=self.cfg.learner.deepspeed,
            grad_clip=self.cfg.learner.optim.grad_clip,
        )
        tokenizer = load_tokenizer(self.cfg.model)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad or 0)

        torch.manual_seed(self.cfg.train.seed)  # the same adapter init on every rank, before sharding
        model = self._build_policy()
        if self.ppo:
            self._add_value_head(model)
        self.model = self.backend.wrap(model)
        if self.ppo:
            self.value_head = self.model.get_submodule(_VALUE_HEAD)
        if self.cfg.algorithm.kl_coef > 0 and not self.lora:
            self._build_reference_model()
        torch.manual_seed(self.cfg.train.seed + 1000 * self.rank)  # dropout etc. differ per rank

        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not self._trainable:
            raise ValueError("Learner: the model has no trainable parameters (check finetune.lora.target_modules)")
        self.optimizer = self.backend.prepare(self.model, self._adamw(self.cfg.learner.optim.lr))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        n_params = sum(self._numel(p) for p in self.model.parameters())
        n_train = sum(self._numel(p) for p in self._trainable)
        log.info(
            "learner %d/%d: %s (%s) on %s, %d params (%d trainable), reference %s, %.1f s",
            self.rank,
            self.world_size,
            self.cfg.model.name,
            self.cfg.finetune.mode,
            self.device,
            n_params,
            n_train,
            self.ref_kind,
            time.monotonic() - t0,
        )
        return {
            "params": n_params,
            "trainable": n_train,
            "device": str(self.device),
            "world_size": self.world_size,
            "backend": self.backend.name,
            "reference": self.ref_kind,
            "setup_s": time.monotonic() - t0,
        }

    def close(self) -> None:
        """Leave the process group (the actor may stay alive)."""
        import torch.distributed as dist

        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def _pick_device(self) -> torch.device:
        import torch

        if not torch.cuda.is_available():
            return torch.device("cpu")
        # Under Ray each worker sees only its assigned GPU (CUDA_VISIBLE_DEVICES): index 0.
        index = self.rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def _init_process_group(self) -> None:
        import datetime

        import torch.distributed as dist

        if self.master_addr.startswith("file://"):
            init_method = self.master_addr  # one node: a file store, nothing listens beyond loopback
        else:
            init_method = f"tcp://{self.master_addr}:{self.master_port}"
        if self.master_addr.startswith("file://") or self.master_addr in ("127.0.0.1", "localhost"):
            # Gloo/NCCL would otherwise pick the interface of the machine's hostname.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        backend = "nccl" if self.device is not None and self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(minutes=10),
        )

    def _build_policy(self) -> nn.Module:
        import torch

        from actors.models import load_causal_lm

        if self.qlora:
            from actors.qlora import load_4bit_causal_lm

            assert self.device is not None
            base = load_4bit_causal_lm(self.cfg.model, self.cfg.learner.dtype, self.device)
            base.requires_grad_(False)
        elif self.lora:
            base = load_causal_lm(self.cfg.model.model_copy(update={"dtype": self.cfg.learner.dtype}))
            base.requires_grad_(False)
        else:
            base = load_causal_lm(self.cfg.model.model_copy(update={"dtype": "float32"}))  # fp32 master weights
            base.requires_grad_(True)
        base.config.use_cache = False
        self.hidden_size = int(getattr(base.config, "hidden_size", 0) or 0)
        if self.cfg.learner.gradient_checkpointing:
            # Non-reentrant: works with frozen inputs (LoRA) and with FSDP2's hooks.
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not self.lora:
            return base
        model = self._attach_adapter(base)
        needs_ref = self.cfg.algorithm.kl_coef > 0
        # A frozen copy unless the reference is the base itself: it moves, starts from an adapter, or is
        # set to the warm-started policy (sft_warmup: `reset_reference` after the warm start).
        copy = self.cfg.learner.reference != "fixed" or self.cfg.finetune.init_adapter or self.cfg.sft_warmup.enabled
        if needs_ref and copy:
            model.add_adapter(_REF_ADAPTER, model.peft_config[_ADAPTER])
            with torch.no_grad():
                params = dict(model.named_parameters())
                for name, p in params.items():
                    if f".{_REF_ADAPTER}." in name:
                        p.requires_grad_(False)
                        p.copy_(params[name.replace(f".{_REF_ADAPTER}.", f".{_ADAPTER}.")])
            self.ref_kind = "adapter"
        elif needs_ref:
            self.ref_kind = "disabled_adapter"
        return model

    def _add_value_head(self, model: nn.Module) -> None:
        """PPO's value head, Linear(hidden, 1) in float32 (trained like the adapter), as a submodule of the
        policy: the sharding backend shards it, the optimizer trains it and checkpoints hold it with the
        rest. Zero-initialised: V = 0 at first, the same on every rank whatever the seed."""
        import torch

        hidden = model.get_output_embeddings().in_features
        head = torch.nn.Linear(hidden, 1, dtype=torch.float32)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        model.add_module(_VALUE_HEAD, head)

    def _attach_adapter(self, base: nn.Module) -> nn.Module:
        from peft import LoraConfig, PeftModel, get_peft_model

        from cluster import storage

        where = self.cfg.finetune.init_adapter
        if where:
            if not storage.exists(storage.join(where, "adapter_config.json")):
                raise FileNotFoundError(
                    f"finetune.init_adapter: {where!r} is not a PEFT adapter folder (no adapter_config.json)"
                )
            folder = storage.fetch(where)  # a URI: downloaded once per node
            return PeftModel.from_pretrained(base, str(folder), adapter_name=_ADAPTER, is_trainable=True)
        lc = self.cfg.finetune.lora
        config = LoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,
            lora_dropout=lc.dropout,
            target_modules=list(lc.target_modules),
            task_type="CAUSAL_LM",
        )
        try:
            return get_peft_model(base, config, adapter_name=_ADAPTER)
        except ValueError as e:
            raise ValueError(f"finetune.lora.target_modules {lc.target_modules} do not fit the model: {e}") from e

    def _build_reference_model(self) -> None:
        from actors.models import load_causal_lm

        assert self.backend is not None
        ln = self.cfg.learner
        # ema accumulates small steps: float32; otherwise the compute dtype is enough.
        dtype = "float32" if ln.reference == "ema" else ln.dtype
        ref = load_causal_lm(self.cfg.model.model_copy(update={"dtype": dtype}))
        if ln.reference_cpu_offload:
            self.ref_kind = "offloaded_model"  # whole, on the CPU; every rank scores its own samples with it
        else:
            ref = self.backend.wrap(ref)
            self.ref_kind = "model"
        ref.requires_grad_(False)
        ref.config.use_cache = False
        self.reference = ref

    def _adamw(self, lr: float) -> torch.optim.Optimizer:
        import torch

        o = self.cfg.learner.optim
        return torch.optim.AdamW(self._trainable, lr=lr, betas=tuple(o.betas), weight_decay=o.weight_decay)

    def _lr_factor(self, step: int) -> float:
        """lr multiplier: linear warmup over warmup_steps, then constant / linear / cosine down to min_lr_ratio."""
        o = self.cfg.learner.optim
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        total = self.cfg.train.steps * self.cfg.train.epochs * self.cfg.train.minibatches
        progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
        if o.schedule == "linear":
            return 1.0 - (1.0 - o.min_lr_ratio) * progress
        return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    @property
    def dr_grpo_norm_tokens(self) -> int:
        """Dr. GRPO's L_max: `algorithm.dr_grpo_norm_tokens`, else the episode's generation budget
        (max_new_tokens per turn × the turn budget)."""
        alg = self.cfg.algorithm
        if alg.dr_grpo_norm_tokens is not None:
            return alg.dr_grpo_norm_tokens
        return self.cfg.rollout.sampling.max_new_tokens * self.cfg.generation.max_turns

    @staticmethod
    def _numel(p: torch.Tensor) -> int:
        if getattr(p, "quant_state", None) is not None:  # qlora: a packed 4-bit weight
            from actors.qlora import numel

            return numel(p)
        # A DTensor's shape is the whole tensor's; a ZeRO-3 parameter keeps its whole shape in ds_shape.
        shape = getattr(p, "ds_shape", None) or getattr(p, "shape", None)
        return int(math.prod(shape)) if shape is not None else p.numel()

    # ------------------------------------------------------------------ training

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
        from grpo.losses import sft_loss

        self._require_setup()
        t0 = time.monotonic()
        batch = [as_sft_sample(s, i) for i, s in enumerate(samples)]
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
            logp, _ = self._token_logprobs(self.model, packed, selective=selective, adapter=_REF_ADAPTER)
        elif self.ref_kind == "model":
            logp, _ = self._token_logprobs(self.reference, packed, selective=selective)
        else:  # offloaded_model: whole, on the CPU
            with _cpu_autocast(self.reference, self.cfg.learner.dtype):
                logp, _ = self._token_logprobs(self.reference, packed, selective=selective, device="cpu")
        return logp.float()

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

    def _refresh_reference(self) -> None:
        """Every `reference_every` iterations (the config insists on >= 1): periodic: ref ← policy; ema:
        ref ← a·ref + (1−a)·policy."""
        ln = self.cfg.learner
        if self.ref_kind not in ("adapter", "model", "offloaded_model") or ln.reference == "fixed":
            return
        if self.iteration % ln.reference_every:
            return
        self._blend_reference(1.0 if ln.reference == "periodic" else 1.0 - ln.reference_ema)

    def reset_reference(self) -> str:
        """The KL reference becomes the policy as it is now (the end of a supervised warm start), whatever
        `learner.reference` says it does later. A collective: every rank must call it. Returns the
        reference kind; with none (kl_coef 0) it does nothing. ValueError when the reference is the
        base model under a disabled adapter: set up with `sft_warmup.enabled` there is a copy to set."""
        self._require_setup()
        if self.ref_kind == "disabled_adapter":
            raise ValueError("reset_reference: the reference is the base model (the adapter disabled); it cannot move")
        if self.ref_kind != "none":
            self._blend_reference(1.0)
        return self.ref_kind

    def _blend_reference(self, weight: float) -> None:
        """ref ← (1 − weight)·ref + weight·policy, on every kind of reference copy."""
        import torch

        assert self.backend is not None
        with torch.no_grad():
            if self.ref_kind == "adapter":
                params = dict(self.model.named_parameters())
                pairs = [
                    (params[n], params[n.replace(f".{_REF_ADAPTER}.", f".{_ADAPTER}.")])
                    for n in params
                    if f".{_REF_ADAPTER}." in n
                ]
                for ref_p, pol_p in pairs:
                    _blend(self.backend.local(ref_p), self.backend.local(pol_p), weight)
            elif self.ref_kind == "model":
                policy = [p for n, p in self.model.named_parameters() if not _is_value_head(n)]
                for ref_p, pol_p in zip(self.reference.parameters(), policy, strict=True):
                    _blend(self.backend.local(ref_p), self.backend.local(pol_p), weight)
            else:  # the CPU copy is whole: gather the policy (every rank needs it)
                ref_params = dict(self.reference.named_parameters())
                policy = self.backend.named_full_tensors(self.model, lambda n: not _is_value_head(n), all_ranks=True)
                for name, full in policy:
                    _blend(ref_params[name], full, weight)

    # ------------------------------------------------------------------ export

    def export_adapter(self) -> dict[str, Any] | None:
        """The trained LoRA adapter, whole, in the wire format: {"config": PEFT config dict (JSON-able),
        "safetensors": bytes of adapter_model.safetensors} (see actors/adapter_io.py).

        One blob rather than a dict of tensors: Ray pickles each tensor on its own (torch.save), which for
        a 240-tensor adapter costs more than the whole transfer. A collective: every rank must call it;
        rank 0 returns the adapter, the others None."""
        from peft import get_peft_model_state_dict

        self._require_setup()
        if not self.lora:
            raise ValueError("export_adapter: finetune.mode is 'full'; use export_weights")
        gathered = dict(self.backend.named_full_tensors(self.model, _is_trained_adapter))
        if self.rank != 0:
            return None
        if self._export_keys is None or self._export_keys.keys() != gathered.keys():
            # PEFT's key mapping (~10 ms for 240 tensors) is the same every time: learn it once. It returns
            # the given tensors themselves, so identity maps each parameter to its PEFT key.
            state = get_peft_model_state_dict(self.model, state_dict=gathered, adapter_name=_ADAPTER)
            by_id = {id(t): k for k, t in state.items()}
            keys = {name: by_id.get(id(t)) for name, t in gathered.items()}
            self._export_keys = keys if None not in keys.values() and len(keys) == len(state) else None
        else:
            state = {self._export_keys[name]: t for name, t in gathered.items()}
        return pack_adapter(self.model.peft_config[_ADAPTER].to_dict(), state)

    def iter_weights(self, max_chunk_bytes: int = 256 << 20) -> Iterator[dict[str, torch.Tensor]]:
        """The model's weights under the base model's names, on CPU in `model.dtype`, in chunks of whole
        layers (a chunk exceeds `max_chunk_bytes` only when one layer does). Full mode: the trained weights.
        LoRA: the merged weights, W + scaling * B @ A for every LoRA-wrapped linear (computed in float32 on
        the side: the trained parameters stay as they are), and every other base weight as it is; the
        adapters themselves are not sent. A collective: every rank must drain it; only rank 0 yields chunks."""
        import torch

        self._require_setup()
        if max_chunk_bytes < 1:
            raise ValueError(f"export_weights: max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
        dtype = getattr(torch, self.cfg.model.dtype)
        # LoRA merges in float32 first; full weights are cast on the learner's device
        named = (
            self._named_merged()
            if self.lora
            else self.backend.named_full_tensors(self.model, lambda n: not _is_value_head(n), dtype=dtype)
        )
        chunk: dict[str, torch.Tensor] = {}
        size = 0
        group: dict[str, torch.Tensor] = {}
        group_key = None
        for name, full in named:
            if full is None:
                continue
            key = _layer_of(name)
            if key != group_key and group:
                group_bytes = sum(t.numel() * t.element_size() for t in group.values())
                if chunk and size + group_bytes > max_chunk_bytes:
                    yield chunk
                    chunk, size = {}, 0
                chunk.update(group)
                size += group_bytes
                group = {}
            group_key = key
            group[name] = full.to(dtype)
        if group:
            group_bytes = sum(t.numel() * t.element_size() for t in group.values())
            if chunk and size + group_bytes > max_chunk_bytes:
                yield chunk
                chunk = {}
            chunk.update(group)
        if chunk:
            yield chunk

    def _named_merged(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """LoRA: (base model name, tensor) of the model with the trained adapter merged in; (name, None)
        on ranks other than 0. PEFT names map to the base's by dropping `base_model.model.` and
        `.base_layer`; a wrapped linear's weight is yielded once its lora_A and lora_B have arrived."""

        def keep(name: str) -> bool:  # the reference adapter, dropouts and a value head are not the policy
            return ("lora_" not in name or _is_trained_adapter(name)) and not _is_value_head(name)

        parts: dict[str, dict[str, torch.Tensor | None]] = {}  # wrapped module -> {"W", "A", "B"}
        named = self.backend.named_full_tensors(self.model, keep)
        if self.qlora:  # the 4-bit base weights, dequantized: the engines get the policy the learner trains
            from actors.qlora import dequantized

            named = dequantized(self.model, named)
        for name, full in named:
            if ".base_layer.weight" in name or "lora_" in name:
                module = name.split(".base_layer.")[0] if ".base_layer." in name else name.split(".lora_")[0]
                role = "W" if ".base_layer." in name else name.split(".lora_")[1][0]  # lora_A... -> "A"
                got = parts.setdefault(module, {})
                got[role] = full
                if len(got) < 3:
                    continue
                del parts[module]
                merged = None
                if self.rank == 0:
                    lora = self.model.get_submodule(module)
                    delta = got["B"].float() @ got["A"].float()
                    if getattr(lora, "fan_in_fan_out", False):
                        delta = delta.T
                    merged = got["W"].float() + lora.scaling[_ADAPTER] * delta
                yield _base_name(f"{module}.weight"), merged
            else:
                yield _base_name(name), full
        if parts:
            raise RuntimeError(f"export_weights: LoRA modules without all of base, lora_A, lora_B: {sorted(parts)[:3]}")

    def export_weights(self, max_chunk_bytes: int = 256 << 20) -> list[dict[str, torch.Tensor]] | None:
        """`iter_weights` as a list on rank 0 (None elsewhere). A collective."""
        chunks = list(self.iter_weights(max_chunk_bytes))
        return chunks if self.rank == 0 else None

    def save_adapter(self, folder: str) -> None:
        """The adapter in PEFT format (adapter_config.json + adapter_model.safetensors) at `folder`, a
        path or a storage URI; rank 0 writes."""
        from cluster import storage

        adapter = self.export_adapter()
        if adapter is not None:
            with storage.staged(folder) as local:
                write_adapter(local, adapter)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, folder: str, extra: dict[str, Any]) -> None:
        """Everything `load_checkpoint` needs to continue bit for bit, at `folder` (a path or a storage
        URI). Complete or absent: a path gets a tmp folder renamed into place; a URI gets every rank's
        files uploaded from a node-local folder, then meta.json, which `latest_checkpoint` looks for."""
        import torch

        from cluster import storage

        self._require_setup()
        try:
            extra_json = json.dumps(extra)
        except TypeError as e:
            raise ValueError(f"save_checkpoint: extra must be JSON-serialisable: {e}") from e
        remote = storage.is_uri(folder)
        if remote:
            final = None
            tmp = Path(tempfile.gettempdir()) / f"mcprl-ckpt-{os.getpid()}-{self.rank}-{self.step}"
        else:
            final = Path(folder).absolute()
            tmp = final.parent / f".{final.name}.tmp-{self.step}"
        if self.rank == 0 or remote:  # remote: every rank has its own node-local folder
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
            tmp.mkdir(parents=True)
        self._barrier()
        self.backend.save(str(tmp / "state"), self.model, self.optimizer, self._state_keep)
        if self.ref_kind in ("model", "offloaded_model") and self.cfg.learner.reference != "fixed":
            self.backend.save(str(tmp / "reference"), self.reference, None, lambda k: True)
        torch.save(_rng_state(), tmp / f"rng-{self.rank}.pt")
        adapter = self.export_adapter() if self.lora else None
        if self.rank == 0:
            if adapter is not None:
                write_adapter(tmp / "adapter", adapter)
            torch.save({"scheduler": self.scheduler.state_dict()}, tmp / "trainer.pt")
            meta = {
                "format": _CKPT_FORMAT,
                "mode": self.cfg.finetune.mode,
                "model": self.cfg.model.name,
                "world_size": self.world_size,
                "step": self.step,
                "iteration": self.iteration,
                "reference": self.ref_kind,
                "extra": json.loads(extra_json),
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        self._barrier()
        if remote:
            try:
                storage.upload(tmp, folder, skip=("meta.json",))
                self._barrier()  # every rank's shards are up before meta.json says the checkpoint is whole
                if self.rank == 0:
                    storage.upload(tmp / "meta.json", storage.join(folder, "meta.json"))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            self._barrier()
            return
        if self.rank == 0:
            old = None
            if final.exists():  # rename cannot replace a folder: move the old one aside first
                old = final.rename(final.parent / f".{final.name}.old-{self.step}")
            tmp.rename(final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        self._barrier()

    def load_checkpoint(self, folder: str) -> dict[str, Any]:
        """Restore model, optimizer, schedule, counters and RNG from `save_checkpoint` (a path or a
        storage URI); returns its `extra`."""
        from cluster import storage

        self._require_setup()
        if storage.is_uri(folder):  # each rank reads its own node-local copy
            with tempfile.TemporaryDirectory(prefix="mcprl-ckpt-") as tmp:
                if not storage.exists(storage.join(folder, "meta.json")):
                    raise CheckpointError(f"checkpoint {folder!r} has no meta.json: absent or incomplete")
                return self._load_checkpoint(storage.download(folder, Path(tmp) / "ckpt"), label=folder)
        return self._load_checkpoint(Path(folder), label=folder)

    def _load_checkpoint(self, path: Path, label: str) -> dict[str, Any]:
        import torch

        meta_file = path / "meta.json"
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {label!r} does not exist (or is not a folder)")
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {label!r} has no readable meta.json: not a learner checkpoint") from e
        if meta.get("format") != _CKPT_FORMAT:
            raise CheckpointError(f"checkpoint {label!r}: format {meta.get('format')!r}, expected {_CKPT_FORMAT}")
        if meta.get("mode") != self.cfg.finetune.mode:
            raise CheckpointError(
                f"checkpoint {label!r} holds a {meta.get('mode')!r} model, but finetune.mode is "
                f"{self.cfg.finetune.mode!r}"
            )
        for needed in ("state", "trainer.pt"):
            if not (path / needed).exists():
                raise CheckpointError(f"checkpoint {label!r} is incomplete: {needed} is missing")
        try:
            self.backend.load(str(path / "state"), self.model, self.optimizer, self._state_keep)
            if (path / "reference").exists() and self.ref_kind in ("model", "offloaded_model"):
                self.backend.load(str(path / "reference"), self.reference, None, lambda k: True)
        except Exception as e:  # DCP's errors name tensors, not the cause
            raise CheckpointError(f"checkpoint {label!r} does not fit this model/config: {e}") from e
        trainer = torch.load(path / "trainer.pt", weights_only=False)
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.step = int(meta["step"])
        self.iteration = int(meta["iteration"])
        rng = path / f"rng-{self.rank}.pt"
        if rng.exists():
            _set_rng_state(torch.load(rng, weights_only=False))
        else:
            log.warning("checkpoint %s: no RNG state for rank %d (world size %s)", label, self.rank, meta["world_size"])
        return meta["extra"]

    def _state_keep(self, key: str) -> bool:
        """Checkpointed model entries: LoRA → the adapters (and PPO's value head) only (the base is the
        model's own files)."""
        return "lora_" in key or _is_value_head(key) if self.lora else True

    # ------------------------------------------------------------------ collectives

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, "sum")

    def _all_reduce_max(self, value: float) -> float:
        return self._all_reduce([value], "max")[0]

    def _all_reduce(self, values: list[float], op: str) -> list[float]:
        if self.world_size == 1:
            return [float(v) for v in values]
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return [float(v) for v in t.cpu()]

    def _barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def _require_setup(self) -> None:
        if self.model is None:
            raise RuntimeError("Learner: call setup() first")


# --------------------------------------------------------------------------- helpers


def as_sft_sample(x: Any, index: int | None = None) -> Sample:
    """grpo.batch.as_sample for supervised data: rollout_logprobs and advantage may be left out (unused)."""
    from grpo.batch import as_sample

    if isinstance(x, dict) and "rollout_logprobs" not in x and isinstance(x.get("response_ids"), list | tuple):
        x = {**x, "rollout_logprobs": [0.0] * len(x["response_ids"])}
    return as_sample(x, index)


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


def _blend(ref: torch.Tensor, policy: torch.Tensor, weight: float) -> None:
    """ref ← (1−w)·ref + w·policy, in place (w = 1: a copy)."""
    if weight >= 1.0:
        ref.copy_(policy)
    else:
        ref.lerp_(policy.to(ref.dtype), weight)


def _is_value_head(name: str) -> bool:
    """`value_head.weight`, under whatever prefix a wrapper adds."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == _VALUE_HEAD


def _is_trained_adapter(name: str) -> bool:
    return "lora_" in name and f".{_ADAPTER}." in name


def _base_name(name: str) -> str:
    """PEFT's parameter name -> the base model's: `base_model.model.model.layers.0.q_proj.base_layer.weight`
    -> `model.layers.0.q_proj.weight`."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _layer_of(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` → `model.layers.3`; names outside a layer are their own group."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return name


def _rng_state() -> dict[str, Any]:
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
