"""The learner's models: the policy (LoRA, QLoRA or full), PPO's value head, the KL reference and its
updates, and the optimizer with its lr schedule (a mixin of `Learner`, actors/learner/__init__.py).

The reference: LoRA → the same model with the adapter disabled (no memory), or, when it must move,
start from `finetune.init_adapter` or become the warm-started policy (`sft_warmup.enabled`: the driver
calls `reset_reference` after the warm start), a second frozen adapter "reference" (adapter-sized); full
fine-tune → a frozen copy of the model (sharded like the policy, or whole on the CPU with
`reference_cpu_offload`). Checkpoints hold the reference adapter with the policy's (both are `lora_`).
How it moves after each iteration: step 3 of actors/learner/steps.py's docstring.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

ADAPTER = "default"  # PEFT's name of the trained adapter
REF_ADAPTER = "reference"  # the frozen copy used as KL reference when it must move
VALUE_HEAD = "value_head"  # PPO: Linear(hidden, 1) on the policy's last hidden state


class PolicyModels:
    """Builds and updates the learner's models; uses the attributes `Learner.__init__` sets."""

    def _build_policy(self) -> nn.Module:
        import torch

        from actors.learner.row_attention import use_row_attention
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
        if self._shared:
            use_row_attention(base)
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
            model.add_adapter(REF_ADAPTER, model.peft_config[ADAPTER])
            with torch.no_grad():
                params = dict(model.named_parameters())
                for name, p in params.items():
                    if f".{REF_ADAPTER}." in name:
                        p.requires_grad_(False)
                        p.copy_(params[name.replace(f".{REF_ADAPTER}.", f".{ADAPTER}.")])
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
        model.add_module(VALUE_HEAD, head)

    def _attach_adapter(self, base: nn.Module) -> nn.Module:
        from peft import LoraConfig, PeftModel, get_peft_model

        from cluster import storage

        where = self.cfg.finetune.init_adapter
        if where:
            if not storage.exists(where):
                raise FileNotFoundError(f"finetune.init_adapter: {where!r}: no such folder")
            if not storage.exists(storage.join(where, "adapter_config.json")):
                raise FileNotFoundError(
                    f"finetune.init_adapter: {where!r} is not a PEFT adapter folder (no adapter_config.json)"
                )
            folder = storage.fetch(where)  # a URI: downloaded once per node
            return PeftModel.from_pretrained(base, str(folder), adapter_name=ADAPTER, is_trainable=True)
        lc = self.cfg.finetune.lora
        config = LoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,
            lora_dropout=lc.dropout,
            target_modules=list(lc.target_modules),
            task_type="CAUSAL_LM",
        )
        try:
            return get_peft_model(base, config, adapter_name=ADAPTER)
        except ValueError as e:
            raise ValueError(f"finetune.lora.target_modules {lc.target_modules} do not fit the model: {e}") from e

    def _build_reference_model(self) -> None:
        from actors.learner.row_attention import use_row_attention
        from actors.models import load_causal_lm

        assert self.backend is not None
        ln = self.cfg.learner
        # ema accumulates small steps: float32; otherwise the compute dtype is enough.
        dtype = "float32" if ln.reference == "ema" else ln.dtype
        ref = load_causal_lm(self.cfg.model.model_copy(update={"dtype": dtype}))
        if self._shared:
            use_row_attention(ref)
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

    @staticmethod
    def _numel(p: torch.Tensor) -> int:
        if getattr(p, "quant_state", None) is not None:  # qlora: a packed 4-bit weight
            from actors.qlora import numel

            return numel(p)
        # A DTensor's shape is the whole tensor's; a ZeRO-3 parameter keeps its whole shape in ds_shape.
        shape = getattr(p, "ds_shape", None) or getattr(p, "shape", None)
        return int(math.prod(shape)) if shape is not None else p.numel()

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
                    (params[n], params[n.replace(f".{REF_ADAPTER}.", f".{ADAPTER}.")])
                    for n in params
                    if f".{REF_ADAPTER}." in n
                ]
                for ref_p, pol_p in pairs:
                    _blend(self.backend.local(ref_p), self.backend.local(pol_p), weight)
            elif self.ref_kind == "model":
                policy = [p for n, p in self.model.named_parameters() if not is_value_head(n)]
                for ref_p, pol_p in zip(self.reference.parameters(), policy, strict=True):
                    _blend(self.backend.local(ref_p), self.backend.local(pol_p), weight)
            else:  # the CPU copy is whole: gather the policy (every rank needs it)
                ref_params = dict(self.reference.named_parameters())
                policy = self.backend.named_full_tensors(self.model, lambda n: not is_value_head(n), all_ranks=True)
                for name, full in policy:
                    _blend(ref_params[name], full, weight)


def _blend(ref: torch.Tensor, policy: torch.Tensor, weight: float) -> None:
    """ref ← (1−w)·ref + w·policy, in place (w = 1: a copy)."""
    if weight >= 1.0:
        ref.copy_(policy)
    else:
        ref.lerp_(policy.to(ref.dtype), weight)


def is_value_head(name: str) -> bool:
    """`value_head.weight`, under whatever prefix a wrapper adds."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == VALUE_HEAD


def is_trained_adapter(name: str) -> bool:
    return "lora_" in name and f".{ADAPTER}." in name
