"""The warm start (jobs/sft.py) on tiny-random with the offline tools in-process: the loss falls, the
saved adapter is the trained one (it lowers the expert NLL when PEFT loads it) and the HF engine serves
it; the CLI refuses bad input with exit status 2."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from configs.schema import Config, SamplingConfig
from jobs.sft import SUMMARY_FILE, batch_order, main, run_sft, sft_config
from tasks.io import read_rows, write_rows

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tasks") / "rule.jsonl"
    cmd = [sys.executable, "-m", "jobs.generate_tasks", "--method", "rule", "--n", "4", "--seed", "0"]
    subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    return read_rows(out)


def tiny_cfg(steps: int = 4) -> Config:
    """A rate tiny-random feels; a short token budget keeps the steps quick (longer expert
    trajectories are cut, as rollouts would be)."""
    cfg = Config()
    cfg.rollout.max_total_tokens = 1200
    cfg.sft_warmup.steps = steps
    cfg.sft_warmup.lr = 5e-3
    cfg.learner.gradient_checkpointing = False
    return cfg


def masked_nll(model: Any, samples: list[dict]) -> float:
    """Mean -log p over the loss-masked response tokens (computed here, not by the learner)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            targets = ids[0, 1:]
            chosen = logp.gather(-1, targets[:, None])[:, 0]
            mask = torch.tensor([0] * (len(s["prompt_ids"]) - 1) + list(s["loss_mask"]), dtype=torch.bool)
            total += float(-chosen[mask].sum())
            count += int(mask.sum())
    return total / count


# --------------------------------------------------------------------------- helpers' contracts


def test_batch_order_cycles_through_a_seeded_shuffle():
    order = batch_order(5, 3, 4, seed=7)
    assert [len(b) for b in order] == [3, 3, 3, 3]
    flat = [i for b in order for i in b]
    assert sorted(flat[:5]) == sorted(flat[5:10]) == list(range(5))  # each pass holds every item once
    assert order == batch_order(5, 3, 4, seed=7) and order != batch_order(5, 3, 4, seed=8)


def test_sft_config_runs_the_warm_start_optimiser():
    cfg = Config()
    cfg.learner.optim.warmup_steps, cfg.learner.optim.schedule = 5, "cosine"
    s = sft_config(cfg)
    assert (s.learner.optim.lr, s.learner.optim.warmup_steps, s.learner.optim.schedule) == (
        cfg.sft_warmup.lr,
        0,
        "constant",
    )
    assert cfg.learner.optim.schedule == "cosine"  # the caller's config is untouched


# --------------------------------------------------------------------------- the warm start


def test_run_sft_learns_and_saves_an_adapter_the_engines_load(rows, tmp_path):
    from peft import PeftModel

    from actors.adapter_io import read_adapter
    from actors.hf_engine import HFEngine
    from actors.models import load_causal_lm, load_tokenizer
    from jobs.sft import build_expert_trajectories

    # The rows that fit the short budget, played once here: each step then trains on exactly them.
    cfg = tiny_cfg()
    trajs, stats = build_expert_trajectories(cfg, rows, load_tokenizer(cfg.model))
    playable = [rows[t.group_id] for t in trajs]
    assert len(playable) >= 2 and stats["skipped"] == len(rows) - len(playable)
    samples = [t.to_sample() for t in trajs]
    cfg.sft_warmup.batch_size = len(playable)

    out = tmp_path / "adapter"
    result = run_sft(cfg, playable, out, progress=False)

    assert result["adapter"] == str(out) and result["steps"] == 4 and len(result["losses"]) == 4
    assert result["trajectories"] == len(playable) and result["skipped"] == 0
    assert result["tokens_per_s"] > 0
    assert result["losses"][-1] < result["losses"][0], result["losses"]
    assert json.loads((out / SUMMARY_FILE).read_text())["losses"] == result["losses"]

    # PEFT loads the folder, and the adapter is the trained one: it lowers the expert tokens' NLL.
    model = PeftModel.from_pretrained(load_causal_lm(cfg.model), str(out)).eval()
    with model.disable_adapter():
        base_nll = masked_nll(model, samples)
    tuned_nll = masked_nll(model, samples)
    assert tuned_nll < base_nll

    # The HF engine serves it as version 1, and its outputs move off the base model's.
    async def engine_run() -> tuple[Any, Any]:
        engine = HFEngine(cfg)
        await engine.start()
        try:
            greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
            prompt = samples[0]["prompt_ids"]
            before = await engine.generate(prompt, greedy)
            await engine.load_adapter(1, read_adapter(out))
            assert engine.version() == 1
            return before, await engine.generate(prompt, greedy)
        finally:
            await engine.shutdown()

    before, after = asyncio.run(engine_run())
    assert before.version == 0 and after.version == 1
    assert (after.token_ids, after.logprobs) != (before.token_ids, before.logprobs)


# --------------------------------------------------------------------------- the CLI


def test_cli_missing_task_file_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["--tasks", str(missing), "--out", str(tmp_path / "a")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no such" in err


def test_cli_default_task_file_is_data_train(tmp_path, capsys):
    missing = tmp_path / "train.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["--set", f"data.train={missing}", "--out", str(tmp_path / "a")])
    assert e.value.code == 2
    assert str(missing) in capsys.readouterr().err


def test_cli_rows_without_tool_sequence_exit_2(rows, tmp_path, capsys):
    bad = copy.deepcopy(rows[:2])
    del bad[1]["reward_spec"]["ground_truth"]["tool_sequence"]
    path = tmp_path / "bad.jsonl"
    write_rows(bad, path)
    with pytest.raises(SystemExit) as e:
        main(["--tasks", str(path), "--out", str(tmp_path / "a")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err and "row 1" in err and "tool_sequence" in err
    assert not (tmp_path / "a").exists()
