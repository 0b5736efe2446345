"""Every key a training run writes to metrics.jsonl (and W&B), with its meaning: the one list of them.

`METRIC_NAMES` maps a key, or a pattern whose `<name>` part stands for a value known only at run time (a task
template, a held-out set), to a one-line meaning. scripts/gen_docs.py renders it as docs/reference/metrics.md;
tests/test_metric_names.py checks it against what the code logs (no key missing, none stale). Nothing at run
time reads it: a new key goes here in the same change that logs it.
"""

from __future__ import annotations

_ROLLOUT = {
    "rollout/episodes": "Episodes played in the step's rollout (tasks_per_step × group_size, infra faults included).",
    "rollout/generated_tokens": "Tokens the engines generated in the step (loss_mask 1), all episodes.",
    "rollout/infra_faults": "Episodes with an infrastructure fault (tool pool or engine), not the policy's doing.",
    "rollout/restarts": "Episode restarts after an engine failure, summed over the step's episodes.",
    "rollout/finish/done": "Share of the step's episodes that ended with a final answer.",
    "rollout/finish/max_turns": "Share of the step's episodes cut at generation.max_turns.",
    "rollout/finish/token_budget": "Share of the step's episodes cut at the token budget.",
    "rollout/finish/engine_failed": "Share of the step's episodes whose engine failed (infra fault).",
    "rollout/episode_reward": "Mean total reward of the step's scored episodes (infra faults left out).",
    "rollout/episode_reward_std": "Standard deviation of those episodes' rewards.",
    "rollout/episode_len": "Mean turns per scored episode.",
    "rollout/episode_tokens": "Mean prompt + response tokens per scored episode.",
    "rollout/success_rate": "Share of scored episodes whose final answer was right (task_complete): the outcome.",
    "rollout/calls_right_rate": "Share of scored episodes in which every expected tool call ran (not the success).",
    "rollout/tool_success_rate": "Tool calls that returned ok / all tool calls, pooled over the step.",
    "rollout/tool_timeout_rate": "Tool calls that timed out / all tool calls, pooled over the step.",
    "rollout/parse_failure_rate": "Turns whose tool call could not be parsed / all turns.",
    "rollout/tokens_per_s": "Tokens generated per second of the rollout, from the runners' stats.",
    "rollout/episodes_per_s": "Episodes finished per second of the rollout, from the runners' stats.",
    "rollout/prefix_cache_hit_rate": "vLLM: share of prompt tokens found in the prefix cache during the step.",
    "rollout/dropped_infra": "Episodes dropped before training for infrastructure faults.",
    "rollout/groups_kept": "filter_groups outcome: share of groups with both outcomes, kept for the learner.",
    "rollout/refill_rounds": "algorithm.refill_rounds: rounds of new tasks played this step to find groups with both "
    "outcomes.",
}

_GROUPS = {
    "groups/groups": "filter_groups outcome: groups (tasks) in the step.",
    "groups/groups_kept": "Groups with both a right and a wrong answer: kept.",
    "groups/groups_kept_frac": "groups_kept / groups (the same figure as rollout/groups_kept).",
    "groups/groups_all_right": "Groups whose episodes all answered right: dropped.",
    "groups/groups_all_wrong": "Groups whose episodes all answered wrong: dropped.",
    "groups/episodes_kept": "Episodes in the kept groups: the learner's batch size.",
}

_ADVANTAGES = {
    "adv/groups": "Groups the advantages were computed over.",
    "adv/zero_variance_groups": "Groups whose scores were all equal: advantage 0, no learning signal.",
    "adv/zero_variance_frac": "zero_variance_groups / groups.",
    "adv/reward_mean": "Mean of the scores ranked (the reward, or outcome-first scores).",
    "adv/reward_std": "Standard deviation of those scores over the batch.",
    "adv/advantage_std": "Standard deviation of the episodes' advantages.",
    "adv/advantage_abs_max": "Largest |advantage| in the batch.",
}

_TRAIN = {
    "train/policy_loss": "Clipped policy-gradient loss of the update, mean over trained tokens.",
    "train/kl": "KL(policy ‖ reference) per trained token (algorithm.kl_estimator); 0 without a reference.",
    "train/ratio_mean": "Mean importance ratio exp(logp − old logp) over trained tokens.",
    "train/ratio_std": "Its standard deviation.",
    "train/ratio_std_after_first": "Ratio std over the optimizer steps after the first (several minibatches/epochs).",
    "train/clip_frac": "Share of trained tokens whose ratio was clipped.",
    "train/logprob_gap": "Mean |learner's old logprob − engine's rollout logprob|: sampler/trainer mismatch.",
    "train/entropy": "Mean entropy of the policy over trained tokens.",
    "train/grad_norm": "Gradient norm before clipping, mean over the step's optimizer steps.",
    "train/lr": "Learning rate at the step's last optimizer step.",
    "train/tokens": "Trained tokens (loss_mask 1) in the batch, all ranks.",
    "train/samples": "Samples (episodes) in the batch, all ranks.",
    "train/step_time_s": "Seconds of the learner's train_step.",
    "train/tokens_per_s": "Prompt + response tokens of the batch per second of train_step.",
    "train/value_loss": "PPO: value-head loss per trained token.",
    "train/value_mean": "PPO: mean value prediction over trained tokens.",
    "train/value_clip_frac": "PPO: share of trained tokens whose value was clipped.",
    "train/returns_mean": "PPO: mean GAE return over trained tokens.",
    "train/explained_variance": "PPO: share of the returns' variance the old values explain.",
    "train/advantage_mean": "PPO: mean GAE advantage before whitening.",
    "train/advantage_std": "PPO: its standard deviation.",
}

_OTHER = {
    "pass_rate/<template>": "Share of the step's episodes of tasks from that generator template answered right.",
    "curriculum/tasks_in_band": "Curriculum: tasks whose smoothed pass rate lies inside (low, high).",
    "sync/latency_s": "Seconds until the slowest engine confirmed the new policy version (adapter or weights).",
    "timing/step_s": "Wall time of the whole step (rollout to push), seconds.",
    "timing/rollout_s": "Wall time of the step's rollout phase (its wait, when rollout.overlap ran it ahead).",
    "timing/reward_s": "Wall time of computing the group advantages.",
    "timing/train_s": "Wall time of the learner's update.",
    "timing/sync_s": "Wall time of pushing the policy to the engines.",
    "timing/eval_s": "Wall time of held-out evaluation since the last record.",
    "timing/sft_s": "Wall time of the supervised warm start (logged at step 0).",
    "sft/step": "Warm start: the SFT step number (logged at step 0, one record per SFT step).",
    "sft/loss": "Warm start: masked NLL of the step's expert trajectories.",
    "sft/grad_norm": "Warm start: gradient norm before clipping.",
    "sft/final_loss": "Warm start: the last SFT step's loss.",
    "sft/tokens_per_s": "Warm start: prompt + response tokens per second of SFT steps.",
}

_EVAL = {
    "eval/<set>/tasks": "Held-out set (validation or transfer): tasks played (greedy, one episode each).",
    "eval/<set>/episodes": "Episodes played.",
    "eval/<set>/success_rate": "Share of the set's tasks answered right: the run's headline figure.",
    "eval/<set>/calls_right_rate": "Share of the set's tasks in which every expected call ran.",
    "eval/<set>/mean_reward": "Mean episode reward.",
    "eval/<set>/turns": "Mean turns per episode.",
    "eval/<set>/tool_success_rate": "Tool calls that returned ok / all tool calls.",
    "eval/<set>/parse_failure_rate": "Turns whose tool call could not be parsed / all turns.",
    "eval/<set>/infra_faults": "Episodes with an infrastructure fault.",
}

METRIC_NAMES: dict[str, str] = {**_ROLLOUT, **_GROUPS, **_ADVANTAGES, **_TRAIN, **_OTHER, **_EVAL}

__all__ = ["METRIC_NAMES"]
