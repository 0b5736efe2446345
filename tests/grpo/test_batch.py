"""Samples, packing alignment, micro-batch splitting and rank sharding."""

from __future__ import annotations

import random

import pytest
import torch

from grpo.batch import (
    Sample,
    as_sample,
    attention_pair_cost,
    pack,
    pack_shared,
    shard,
    share_pays,
    shares,
    split_by_tokens,
    split_shared,
)


def sample(n_prompt: int, n_response: int, advantage: float = 0.0) -> Sample:
    return Sample(
        prompt_ids=list(range(1, n_prompt + 1)),
        response_ids=list(range(100, 100 + n_response)),
        loss_mask=[1] * n_response,
        rollout_logprobs=[-0.5] * n_response,
        advantage=advantage,
    )


# --------------------------------------------------------------------------- as_sample


def test_as_sample_accepts_dicts_and_ignores_extra_keys() -> None:
    s = as_sample(
        {"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1, 0], "rollout_logprobs": [-0.1, 0.0],
         "advantage": 0.5, "reward": 1.0, "task_id": "t"}
    )  # fmt: skip
    assert s == Sample([1], [2, 3], [1, 0], [-0.1, 0.0], 0.5)
    assert s.num_tokens == 3
    assert as_sample({"prompt_ids": [1], "response_ids": [], "loss_mask": [], "rollout_logprobs": []}).advantage == 0
    same = Sample([1], [2], [1], [-1.0])
    assert as_sample(same) is same
    ppo = {"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1, 0], "rollout_logprobs": [-0.1, 0.0]}
    assert as_sample(ppo | {"token_rewards": [1, 0.0]}).token_rewards == [1.0, 0.0]  # PPO's per-token rewards


def test_supervised_samples_may_leave_out_what_sft_does_not_read() -> None:
    demo = {"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1, 0]}
    assert as_sample(demo, supervised=True) == Sample([1], [2, 3], [1, 0], [0.0, 0.0], 0.0)
    with pytest.raises(ValueError, match="sample 4: missing field"):
        as_sample(demo, 4)  # RL needs the engine's logprobs


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_mask": [1]}, "sample 3: loss_mask has 1 entries but response_ids has 2"),
        ({"rollout_logprobs": [0.0]}, "sample 3: rollout_logprobs has 1 entries"),
        ({"loss_mask": [1, 2]}, r"sample 3: loss_mask\[1\] = 2"),
        ({"prompt_ids": []}, "sample 3: prompt_ids is empty"),
        ({"response_ids": [2, -1]}, r"sample 3: response_ids\[1\] = -1"),
        ({"prompt_ids": [1.5]}, r"sample 3: prompt_ids\[0\] = 1.5"),
        ({"rollout_logprobs": [0.0, float("nan")]}, r"sample 3: rollout_logprobs\[1\] = nan"),
        ({"advantage": float("inf")}, "sample 3: advantage = inf"),
        ({"response_ids": "ab"}, "sample 3: response_ids must be a list"),
        ({"token_rewards": [1.0]}, r"sample 3: token_rewards must be a list as long as response_ids \(2\), got 1"),
        ({"token_rewards": [0.0, float("nan")]}, r"sample 3: token_rewards\[1\] = nan"),
    ],
)
def test_as_sample_errors_name_index_and_field(change: dict, message: str) -> None:
    good = {"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1, 0], "rollout_logprobs": [-0.1, 0.0]}
    with pytest.raises(ValueError, match=message):
        as_sample(good | change, index=3)


def test_as_sample_missing_field_and_wrong_type() -> None:
    with pytest.raises(ValueError, match=r"sample 0: missing field.*rollout_logprobs"):
        as_sample({"prompt_ids": [1], "response_ids": [], "loss_mask": []}, index=0)
    with pytest.raises(TypeError, match="got list"):
        as_sample([1, 2])


# --------------------------------------------------------------------------- pack


def test_pack_alignment_with_a_one_token_prompt() -> None:
    a = Sample([5], [6, 7, 8], [1, 0, 1], [-0.1, -0.2, -0.3], advantage=1.5)
    b = Sample([1, 2, 3], [4], [1], [-0.5], advantage=-0.5)
    c = Sample([9], [10], [1], [-0.7])  # shorter: right-padded
    batch = pack([a, b, c], pad_id=0)
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [1, 2, 3, 4], [9, 10, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    # position t scores token t+1: a's tokens 6 (gen), 7 (not), 8 (gen); b's 2, 3 (prompt), 4 (gen)
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["loss_mask"].tolist() == [[1, 0, 1], [0, 0, 1], [1, 0, 0]]
    expected = torch.tensor([[-0.1, 0, -0.3], [0, 0, -0.5], [-0.7, 0, 0]])
    assert batch["rollout_logprobs"].dtype == torch.float32 and torch.equal(batch["rollout_logprobs"], expected)
    assert batch["advantages"].tolist() == [1.5, -0.5, 0.0]
    # the targets under the mask are exactly the generated tokens, in order
    targets = batch["input_ids"][:, 1:][batch["loss_mask"] > 0]
    assert targets.tolist() == [6, 8, 4, 10]


def test_pack_accepts_dicts_and_names_the_bad_sample() -> None:
    good = {"prompt_ids": [1], "response_ids": [2], "loss_mask": [1], "rollout_logprobs": [-1.0]}
    assert pack([good], pad_id=7)["input_ids"].tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="sample 1: loss_mask"):
        pack([good, good | {"loss_mask": []}], pad_id=0)
    with pytest.raises(ValueError, match="at least one sample"):
        pack([], pad_id=0)


# --------------------------------------------------------------------------- shared-prompt rows


def grouped(prompt: list[int], *responses: list[int]) -> list[Sample]:
    return [Sample(prompt, r, [1] * len(r), [-0.5] * len(r)) for r in responses]


def test_pack_shared_hand_case() -> None:
    """Two episodes of one prompt and one of another: the first row holds prompt [1, 2] once, then
    responses [10, 11] and [20]; the second row holds [5] then [30, 31] (padded with 0)."""
    batch = [*grouped([1, 2], [10, 11], [20]), *grouped([5], [30, 31])]
    p = pack_shared(batch, pad_id=0)
    assert p["input_ids"].tolist() == pack(batch, pad_id=0)["input_ids"].tolist()  # the plain tensors stay
    assert p["rows"].tolist() == [[1, 2, 10, 11, 20], [5, 30, 31, 0, 0]]
    assert p["row_positions"].tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 0, 0]]
    m = p["row_mask"][:, 0].int().tolist()
    assert m[0] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
    assert m[1] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]
    # sample position t predicts token t+1: which row position's hidden state does (flat b·5 + l)
    assert p["source"].tolist() == [[0, 1, 2], [0, 1, 0], [5, 6, 0]]
    # every trained target is the token the row holds right after the chosen position, or the response's
    # first token after the prompt's last
    keep = p["loss_mask"] > 0
    assert p["source"][keep].tolist() == [1, 2, 1, 5, 6]


def test_split_shared_keeps_groups_together_within_the_budget() -> None:
    rng = random.Random(0)
    batch: list[Sample] = []
    for g in range(6):
        batch += grouped([g + 1] * rng.randint(5, 30), *[[100] * rng.randint(1, 20) for _ in range(4)])
    rng.shuffle(batch)
    micro = split_shared(batch, 128)
    assert sorted(i for m in micro for i in m) == list(range(len(batch)))
    prompts = [{tuple(batch[i].prompt_ids) for i in m} for m in micro]
    for prompt in {tuple(s.prompt_ids) for s in batch}:  # no row exceeds 128, so no group is split
        assert sum(prompt in ps for ps in prompts) == 1
    for m in micro:
        rows = pack_shared([batch[i] for i in m], pad_id=0)["rows"]
        assert rows.numel() <= 128
    big = grouped([1] * 10, [2] * 8, [3] * 8)  # 10 + 8 + 8 > 20: the group is split into two rows
    assert split_shared(big, 20) == [[0], [1]]
    with pytest.raises(ValueError, match="token_budget"):
        split_shared(big, 0)


def test_share_pays_only_while_the_prompt_outweighs_the_row_attention() -> None:
    """grpo.batch.share_pays: the measured shapes (SmolLM2-135M's constant) decide as measured; one long
    response among short ones pads the row's attention past what sharing a short prompt saves; pair cost 0
    always shares; one episode is never worth a row of its own."""
    cost = attention_pair_cost(576)
    assert share_pays(900, [100] * 4, cost)  # one row 5.6 s, whole 10.8 s
    assert share_pays(400, [760, 700, 820, 780], cost)  # one row 14.9 s, whole 15.7 s
    assert not share_pays(20, [800, 100, 100, 100], cost)
    assert share_pays(20, [800, 100, 100, 100], 0.0)
    assert not share_pays(400, [300], cost)


def test_groups_not_worth_sharing_run_whole_in_micro_batches_of_their_own() -> None:
    """With a pair cost, a group of long responses is a row per episode, and those rows fill micro-batches
    apart from the shared ones (which `pack` then runs without a mask); pack_shared gives each its own row."""
    cheap = grouped([1] * 40, [2] * 4, [3] * 4)  # short responses after a long prompt: one row
    dear = grouped([5] * 4, [6] * 60, [7] * 50)  # long responses after a short prompt: whole episodes
    batch = [*cheap, *dear]
    cost = 1 / 64
    assert split_shared(batch, 4096, cost) == [[0, 1], [2, 3]]
    assert split_shared(batch, 4096) == [[2, 3, 0, 1]]  # without a pair cost every group shares, widest first
    assert shares(cheap, cost) and not shares(dear, cost) and shares(dear)
    rows = pack_shared(dear, pad_id=0, pair_cost=cost)["rows"]
    assert rows.tolist() == pack(dear, pad_id=0)["input_ids"].tolist()


# --------------------------------------------------------------------------- split_by_tokens


def test_split_by_tokens_hand_case() -> None:
    lengths = [5, 3, 8, 2, 2, 7]
    samples = [sample(1, n - 1) for n in lengths]
    # longest first: 8 (2), 7 (5) | 5 (0), 3 (1), 2 (3) | 2 (4)
    assert split_by_tokens(samples, 16) == [[2, 5], [0, 1, 3], [4]]


def test_split_by_tokens_respects_the_budget_and_covers_every_index() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(2, 60) for _ in range(40)]
    samples = [sample(1, n - 1) for n in lengths]
    batches = split_by_tokens(samples, 128)
    assert sorted(i for b in batches for i in b) == list(range(40))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 128
    assert split_by_tokens(samples, 128) == batches  # deterministic


def test_split_by_tokens_oversized_sample_goes_alone() -> None:
    assert split_by_tokens([sample(10, 10), sample(1, 2), sample(1, 2)], 10) == [[0], [1, 2]]
    assert split_by_tokens([], 10) == []
    with pytest.raises(ValueError, match="token_budget"):
        split_by_tokens([sample(1, 1)], 0)


# --------------------------------------------------------------------------- shard


def test_shard_hand_case() -> None:
    lengths = [10, 9, 8, 1, 1, 1]
    # longest first to the least loaded: 10->r0, 9->r1, 8->r1 (9<10), then the 1s to r0 (10 < 17)
    assert shard([sample(1, n - 1) for n in lengths], 2) == [[0, 3, 4, 5], [1, 2]]


def test_shard_balance_and_coverage() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(2, 200) for _ in range(37)]
    ranks = shard([sample(1, n - 1) for n in lengths], 4)
    assert len(ranks) == 4 and sorted(i for r in ranks for i in r) == list(range(37))
    loads = [sum(lengths[i] for i in r) for r in ranks]
    # greedy longest-first: the spread is at most one sample's length
    assert max(loads) - min(loads) <= max(lengths)
    assert shard([sample(1, n - 1) for n in lengths], 4) == ranks


def test_shard_more_ranks_than_samples() -> None:
    assert shard([sample(2, 2), sample(1, 1)], 4) == [[0], [1], [], []]
    assert shard([], 2) == [[], []]
    with pytest.raises(ValueError, match="world_size"):
        shard([sample(1, 1)], 0)
