"""bench.gpu_train's reading of a run's metrics.jsonl (the run itself: tests/cluster/test_wheelhouse_install.py)."""

from __future__ import annotations

import json

from bench.gpu_train import FIGURES, mfu_line, step_rows, summary


def test_step_figures_and_their_medians_after_the_first_step(tmp_path):
    keys = list(FIGURES)  # step s, learner tok/s, rollout tok/s, push s
    rows = [
        {"step": 0, "sft/loss": 1.0},  # not a GRPO step
        {"step": 1, **dict(zip(keys, [9.0, 100.0, 5.0, 2.0], strict=True))},
        {"step": 2, **dict(zip(keys, [4.0, 300.0, 7.0, 0.5], strict=True))},
        {"step": 3, **dict(zip(keys, [6.0, 200.0, 9.0, 0.1], strict=True))},
        {"step": 2, **dict(zip(keys, [2.0, 400.0, 8.0, 0.3], strict=True))},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = step_rows(path)
    assert [r["step"] for r in steps] == [1, 2, 3] and steps[1]["timing/step_s"] == 2.0  # a redone step: its last row
    lines = summary(steps)
    assert all(name in lines[0] for name in FIGURES.values())
    med = lines[-2].split()
    assert med[0] == "med" and [float(x) for x in med[1:5]] == [4.0, 300.0, 8.5, 0.2]  # steps 2 and 3 only
    assert "steps 2-3" in lines[-2] and lines[-1].startswith("MFU: not computed")


def test_mfu_counts_4n_flops_per_token_for_lora_and_6n_for_full_weights():
    # 1e9 parameters at 98.94k tokens/s: 4e9 * 98940 / 989e12 = 40.0%; full weights 60.0%
    assert mfu_line("NVIDIA H200", 10**9, lora=True)(98_940.0).startswith("MFU 40.02% on NVIDIA H200")
    assert mfu_line("NVIDIA H100 80GB HBM3", 10**9, lora=False)(98_940.0).startswith("MFU 60.02%")
    assert "no known bf16 peak" in mfu_line("Tesla T4", 10**9, lora=True)(1.0)
    rows = [{"step": 1, "train/tokens_per_s": 98_940.0}]
    assert summary(rows, mfu_line("H200", 10**9, True))[-1].startswith("MFU 40")
