"""GRPO building blocks: advantages, losses, batch packing, training-health checks.

Pure torch + stdlib: nothing here imports the rest of mcprl (callers pass plain arguments).
"""

from grpo.advantages import ADVANTAGE_METHODS, group_advantages
from grpo.batch import Sample, as_sample, pack, shard, split_by_tokens
from grpo.health import HealthMonitor
from grpo.losses import (
    KL_ESTIMATORS,
    REDUCTIONS,
    entropy_from_logits,
    kl_divergence,
    masked_mean,
    policy_loss,
    sft_loss,
    token_logprobs,
)

__all__ = [
    "ADVANTAGE_METHODS",
    "KL_ESTIMATORS",
    "REDUCTIONS",
    "HealthMonitor",
    "Sample",
    "as_sample",
    "entropy_from_logits",
    "group_advantages",
    "kl_divergence",
    "masked_mean",
    "pack",
    "policy_loss",
    "sft_loss",
    "shard",
    "split_by_tokens",
    "token_logprobs",
]
