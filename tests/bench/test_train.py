"""The `train` benchmark suite at its `--quick` sizes (tiny-random): every figure is there and makes sense.

One run of the whole suite on the session's Ray (3 learners, 2 HF engines), through the suite's `run` as
`python -m bench` calls it; the CLI itself is the same for every suite (tests/bench/test_suites.py).
No timing is asserted."""

from __future__ import annotations

import math
import pickle

import pytest
from rich.console import Console

from actors.adapter_io import read_adapter
from actors.models import load_causal_lm
from actors.precision import compute_dtype
from bench.options import BenchOptions
from bench.train import FolderAdapter, make_batch, run
from configs.loader import ConfigError
from configs.schema import ModelConfig

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it


def positive(x: float) -> bool:
    return isinstance(x, float | int) and math.isfinite(x) and x > 0


def test_make_batch_has_the_asked_shape() -> None:
    batch = make_batch(16, prompt_tokens=900, gen_tokens=100, vocab=500, seed=3)
    assert len(batch) == 16
    for s in batch:
        assert 810 <= len(s["prompt_ids"]) <= 990 and 90 <= len(s["response_ids"]) <= 110
        assert all(0 <= t < 500 for t in s["prompt_ids"] + s["response_ids"])
        assert s["loss_mask"] == [1] * len(s["response_ids"])
        assert all(-3.0 <= lp <= 0.0 for lp in s["rollout_logprobs"])
    assert len({len(s["prompt_ids"]) for s in batch}) > 1  # lengths vary, as in a real batch
    assert make_batch(16, 900, 100, 500, seed=3) == batch  # seeded
    grouped = make_batch(16, 900, 100, 500, seed=3, group_size=4)  # GRPO groups: each run of 4 shares a prompt
    assert [len({tuple(s["prompt_ids"]) for s in grouped[k : k + 4]}) for k in range(0, 16, 4)] == [1] * 4
    assert len({tuple(s["prompt_ids"]) for s in grouped}) == 4
    assert len({tuple(s["response_ids"]) for s in grouped}) == 16


def test_options_reject_bad_values_by_name() -> None:
    with pytest.raises(ConfigError, match=r"train\.pushes: Input should be greater than or equal to 1 \(got 0\)"):
        BenchOptions.parse({"suite": "train"}, ["train.pushes=0"])
    with pytest.raises(ConfigError, match=r"train\.vllm: Input should be 'auto', 'on' or 'off'"):
        BenchOptions.parse({}, ["train.vllm=maybe"])
    with pytest.raises(ConfigError, match=r"train\.pushez: unknown key"):
        BenchOptions.parse({}, ["train.pushez=3"])
    opts = BenchOptions.parse({"suite": "train", "repeats": None}, ["train.pushes=7"])  # None: not given
    assert opts.train.pushes == 7 and opts.train.model == "smollm2-135m-instruct" and opts.repeats == 3


def test_folder_adapter_unpickles_as_the_folder_contents(tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {"base_model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.arange(6.0).reshape(2, 3)}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2}')
    loaded = pickle.loads(pickle.dumps(FolderAdapter(tmp_path)))
    expected = read_adapter(tmp_path)
    assert loaded["config"] == expected["config"] == {"peft_type": "LORA", "r": 2}
    assert torch.equal(loaded["state_dict"][next(iter(tensors))], tensors[next(iter(tensors))])


@pytest.mark.bench
def test_train_suite_reports_every_figure(ray_cluster) -> None:
    result = run(BenchOptions(suite="train", quick=True), Console())
    report = result.report

    assert report["machine"]["cores"] >= 1 and report["machine"]["cpu"]
    assert (
        report["model"] == "tiny-random" and report["lora"]["r"] == 16 and report["dtype"] == compute_dtype("bfloat16")
    )

    ln = report["learner"]
    assert ln["samples"] == 4 and ln["steps"] == 1 and ln["warmup_steps"] == 1 and len(ln["step_s"]) == 1
    assert 4 * (22 + 7) <= ln["tokens_per_step"] <= 4 * (26 + 9)  # ±10 % around 24 + 8
    assert ln["generated_tokens_per_step"] < ln["tokens_per_step"]
    assert positive(ln["tokens_per_s"]) and positive(ln["generated_tokens_per_s"])
    assert ln["tokens_per_s"] == pytest.approx(ln["tokens_per_step"] / ln["step_s_median"])
    assert ln["generated_tokens_per_s"] == pytest.approx(ln["generated_tokens_per_step"] / ln["step_s_median"])
    assert math.isfinite(ln["policy_loss"]) and math.isfinite(ln["grad_norm"])
    old = report["learner_all_logits"]  # the same batch on the old path (LM head at every position)
    assert old["tokens_per_step"] == ln["tokens_per_step"] and len(old["step_s"]) == 1
    assert report["learner_selective_speedup"] == pytest.approx(old["step_s_median"] / ln["step_s_median"])
    whole = report["learner_unshared"]  # the same batch, each episode whole (--quick: one group of 4)
    assert whole["tokens_per_step"] == ln["tokens_per_step"] and len(whole["step_s"]) == 1
    assert report["learner_shared_speedup"] == pytest.approx(whole["step_s_median"] / ln["step_s_median"])
    masked = report["learner_pad_mask"]  # each episode whole, the padding mask passed to attention
    assert masked["tokens_per_step"] == ln["tokens_per_step"] and len(masked["step_s"]) == 1
    assert report["learner_causal_speedup"] == pytest.approx(masked["step_s_median"] / whole["step_s_median"])
    long, always = report["learner_long"], report["learner_long_always"]  # ~8 + ~60 tokens: not shared
    assert long["tokens_per_step"] == always["tokens_per_step"] > ln["tokens_per_step"]
    assert report["learner_long_speedup"] == pytest.approx(always["step_s_median"] / long["step_s_median"])

    model = load_causal_lm(ModelConfig(name="tiny-random"))
    hf = report["hf"]
    assert hf["backend"] == "hf" and positive(hf["start_s"])
    lora = hf["lora"]
    assert lora["engines"] == 2 and lora["pushes"] == 2
    # r=16 on q,k,v,o: r·(in + out) float32 numbers per module, plus the safetensors header.
    adapter_bytes = sum(
        16 * (m.in_features + m.out_features) * 4
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")
    )
    assert 0 <= lora["adapter_mb"] * 2**20 - adapter_bytes < 64 << 10
    a, b = lora["object_store"], lora["disk"]
    for key in ("export_ms", "push_ms", "total_ms", "rpc_ms", "load_ms"):
        assert positive(a[key]), key
    assert a["fetch_ms"] >= 0
    for key in ("save_ms", "push_ms", "total_ms", "load_ms", "read_rpc_ms"):
        assert positive(b[key]) or (key == "read_rpc_ms" and b[key] >= 0), key
    for side in (a, b):
        assert len(side["per_engine_ms"]) == 2 and all(positive(x) for x in side["per_engine_ms"])
        assert len(side["total_all_ms"]) == 2
        assert max(side["per_engine_ms"]) <= side["push_ms"] * 1.0001  # the push waits for every engine
    assert a["total_ms"] >= a["push_ms"] and b["total_ms"] >= b["push_ms"]
    # each path's load is its own measurement (the engines' timing), within that path's push
    assert a["load_ms"] <= a["push_ms"] * 1.0001 and b["load_ms"] <= b["push_ms"] * 1.0001
    assert lora["ratio"] == pytest.approx(b["total_ms"] / a["total_ms"])
    assert lora["engine_side_ratio"] == pytest.approx(b["push_ms"] / a["push_ms"])
    assert lora["goal_ratio_met"] == (lora["ratio"] >= 2.0)
    assert lora["goal_30ms_met"] == (a["push_ms"] < 30.0)

    w = hf["weights"]
    assert w["engines"] == 2 and w["pushes"] == 1 and w["chunks"] >= 1 and len(w["total_all_s"]) == 1
    weight_bytes = sum(p.numel() * 2 for p in model.parameters())  # bf16, tied embeddings once
    assert w["mb"] * 2**20 == weight_bytes
    assert positive(w["export_s"]) and positive(w["push_s"])
    assert w["total_s"] == pytest.approx(w["export_s"] + w["push_s"])

    assert report["vllm"] == {"skipped": "train.vllm=off"}
    assert positive(report["wall_s"]) and positive(report["learner_setup_s"])

    # the table: the learner beside its old path, the two push paths, the weight sync; medians of the runs
    figures = {r.figure.split(" (")[0].split(" to ")[0]: r for r in result.rows}
    assert set(figures) == {
        "learner tokens/s",
        "learner tokens/s, a group's prompt once",
        "learner tokens/s, episodes whole without the padding mask",
        "learner tokens/s, long responses",
        "LoRA push",
        "full-weight sync",
    }
    assert figures["learner tokens/s"].ours.values == [ln["tokens_per_step"] / s for s in ln["step_s"]]
    once = figures["learner tokens/s, a group's prompt once"]
    assert once.ours.values == figures["learner tokens/s"].ours.values
    assert once.baseline.values == [whole["tokens_per_step"] / s for s in whole["step_s"]]
    causal = figures["learner tokens/s, episodes whole without the padding mask"]
    assert causal.ours.values == once.baseline.values
    assert causal.baseline.values == [masked["tokens_per_step"] / s for s in masked["step_s"]]
    assert figures["learner tokens/s, long responses"].baseline.values == [
        always["tokens_per_step"] / s for s in always["step_s"]
    ]
    push = figures["LoRA push"]
    assert push.ours.values == a["total_all_ms"] and push.baseline.values == b["total_all_ms"]
    assert push.better == "lower" and push.ratio == pytest.approx(lora["ratio"])
    assert figures["full-weight sync"].baseline is None and figures["full-weight sync"].ours.values == w["total_all_s"]
