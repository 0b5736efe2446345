"""The learner: one rank of the training group (a plain class; orchestration/learner_group.py makes it a Ray actor).

`Learner` is one class assembled from a mixin per idea, each in its own file here:
- model.py: the policy (LoRA, QLoRA or full), PPO's value head, the KL reference and its updates, the
  optimizer and lr schedule;
- steps.py: the GRPO/PPO iteration (`train_step`, whose contract steps.py's docstring spells out) and the
  supervised step (`sft_step`);
- forward.py: micro-batches, packing, the forward to token logprobs, and the scoring pass (`score`);
- state.py: the weights for the engines (`export_adapter`, `iter_weights`) and checkpoints;
- collectives.py: the device, the process group, all-reduces and barriers.
This file holds the constructor and `setup`, which builds what the others use.

Precision: what trains is kept in float32 (full mode: the whole model; LoRA: the adapter, over a frozen
base in `learner.dtype`); the forward computes in `learner.dtype` (see actors/sharding/).
QLoRA (`finetune.mode: qlora`, one rank) is LoRA over a base loaded in 4 bit (actors/qlora.py): the
reference, pushes and checkpoints are LoRA's; a merged push dequantizes the base.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from actors.learner.collectives import Collectives
from actors.learner.forward import ForwardPasses
from actors.learner.model import VALUE_HEAD, PolicyModels
from actors.learner.state import CheckpointError, StateIO
from actors.learner.steps import TrainingSteps
from configs.schema import Config

if TYPE_CHECKING:
    import torch

    from actors.sharding import ShardingBackend

log = logging.getLogger(__name__)


class Learner(TrainingSteps, ForwardPasses, PolicyModels, StateIO, Collectives):
    """One rank of the learner group. The module docstring says which file holds which part."""

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
        from actors.precision import for_device
        from actors.sharding import make_backend

        t0 = time.monotonic()
        self.device = self._pick_device()
        self.cfg = for_device(self.cfg, self.device)  # float32 on a CPU without bf16 kernels (actors/precision.py)
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
            self.value_head = self.model.get_submodule(VALUE_HEAD)
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
            "dtype": self.cfg.learner.dtype,
            "world_size": self.world_size,
            "backend": self.backend.name,
            "reference": self.ref_kind,
            "setup_s": time.monotonic() - t0,
        }

    def _require_setup(self) -> None:
        if self.model is None:
            raise RuntimeError("Learner: call setup() first")


__all__ = ["CheckpointError", "Learner"]
