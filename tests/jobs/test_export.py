"""`python -m jobs.export` as a user runs it (a fresh process) on run folders that a real Learner wrote
(config.json, checkpoints/step_N, final_adapter/: what jobs/train.py leaves), read back with transformers
and PEFT: the exported model's logits are the trained policy's."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actors.learner import Learner
from configs.schema import Config
from jobs.export import EXPORT_INFO, ExportError, export

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def tiny_config(name: str, mode: str) -> Config:
    """A tiny-random run's config, float32 throughout (so an export can be compared exactly)."""
    cfg = Config()
    cfg.run_name = name
    cfg.model.dtype = "float32"
    cfg.learner.dtype = "float32"
    cfg.finetune.mode = mode
    cfg.finetune.lora.r = 4
    cfg.data.train = ""  # no task file: the export adds no default system message (a test names one)
    return cfg


def save_run(folder: Path, learner: Learner, steps: int) -> None:
    """What jobs/train.py leaves in a run folder: config.json, checkpoints/step_N, final_adapter/ (LoRA)."""
    cfg = learner.cfg
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
    learner.save_checkpoint(str(folder / "checkpoints" / f"step_{steps}"), {"step": steps, "version": steps})
    if cfg.finetune.trains_adapter:
        learner.save_adapter(str(folder / "final_adapter"))


def make_run(folder: Path, mode: str) -> Learner:
    """A run folder as the driver leaves it, after STEPS real GRPO steps of a tiny-random learner."""
    cfg = tiny_config(folder.name, mode)
    cfg.learner.optim.lr = 1e-3 if mode == "full" else 1e-2
    learner = Learner(cfg)
    learner.setup()
    g = torch.Generator().manual_seed(0)
    batch = [
        {
            "prompt_ids": torch.randint(100, 40_000, (8,), generator=g).tolist(),
            "response_ids": [1500, 2500, 3500, 4500],
            "loss_mask": [1, 1, 0, 1],
            "rollout_logprobs": [-10.8, -10.8, 0.0, -10.8],
            "advantage": 1.0,
        }
        for _ in range(4)
    ]
    for _ in range(STEPS):
        learner.train_step(batch)
    save_run(folder, learner, STEPS)
    return learner


def policy_logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 2000, 3000, 4000, 5000, 6000, 7000]])
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def run_export(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.export", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """A LoRA, a QLoRA and a full fine-tune run, with the trained policies' logits."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for mode in ("lora", "qlora", "full"):
        learner = make_run(root / f"run-{mode}", mode)
        learner.model.eval()
        out[mode] = (root / f"run-{mode}", policy_logits(learner.model))
        del learner
    return out


def test_lora_run_exports_a_peft_folder_and_merged_weights(runs: dict, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, trained = runs["lora"]
    # By name under --storage, as a user names a run.
    proc = run_export("--run", run.name, "--storage", str(run.parent))
    assert "export: lora_adapter from" in proc.stdout and "export: done" in proc.stdout
    adapter = run / "export"
    config = json.loads((adapter / "adapter_config.json").read_text())
    # tiny-random is built locally, not on the Hub: the export carries its base and names it.
    assert config["base_model_name_or_path"] == str(adapter / "base")
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "base" / "config.json").is_file()
    info = json.loads((adapter / "mcprl_export.json").read_text())
    assert info["kind"] == "lora_adapter" and info["source"] == "final_adapter" and "base/" in info["base"]

    tokenizer = AutoTokenizer.from_pretrained(adapter)
    assert "mcprl_params" in tokenizer.chat_template  # ours: renders tools= as training showed them
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    peft_logits = policy_logits(PeftModel.from_pretrained(base, adapter).eval())
    torch.testing.assert_close(peft_logits, trained, rtol=0, atol=1e-5)
    untrained = policy_logits(AutoModelForCausalLM.from_pretrained(adapter / "base", dtype=torch.float32))
    assert (untrained - trained).abs().max() > 1e-3  # the adapter is not the identity: the test can fail

    merged_dir = tmp_path / "merged"
    proc = run_export("--run", str(run), "--merge", "--out", str(merged_dir))
    assert "merging the adapter" in proc.stdout
    assert not (merged_dir / "adapter_config.json").exists() and (merged_dir / "model.safetensors").is_file()
    modes = {p.name: p.stat().st_mode & 0o777 for p in [merged_dir, *merged_dir.rglob("*")]}
    assert modes.pop("merged") == 0o755 and set(modes.values()) == {0o644}, modes  # readable by all, like a copy
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert merged.dtype == torch.float32  # model.dtype of the run
    torch.testing.assert_close(policy_logits(merged), peft_logits, rtol=0, atol=1e-4)


def test_openai_tools_render_as_training_rendered_the_task(runs: dict, tmp_path: Path) -> None:
    """A request as an OpenAI client sends it (a user message and tools=, no system message) reaches the
    exported model as training rendered the task (envs/prompting.py): the tasks' system message, then the
    tool block. A request with a system message of its own keeps it, with the tool block after it."""
    from transformers import AutoTokenizer

    from actors.models import load_tokenizer
    from envs.prompting import _as_function, render_prompt, tool_block
    from serve_apps.tool_pool import LocalToolPool
    from tasks.generators.rule import SYSTEM_PROMPT
    from tasks.inventory import inventory_tools_for_prompt
    from tasks.io import write_rows

    question = {"role": "user", "content": "What was Apple's previous close?"}
    tasks = tmp_path / "train.jsonl"  # the run's training tasks: all but one open with the rule system prompt
    rows = [{"prompt": [{"role": "system", "content": text}, question]} for text in [SYSTEM_PROMPT] * 3 + ["Other."]]
    write_rows(rows, tasks)
    run = tmp_path / "run-tasks"
    shutil.copytree(runs["lora"][0], run, ignore=shutil.ignore_patterns("export*"))
    cfg = Config.model_validate(json.loads((run / "config.json").read_text()))
    cfg.data.train = str(tasks)
    (run / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    run_export("--run", str(run))
    info = json.loads((run / "export" / EXPORT_INFO).read_text())
    assert info["system_prompt"] == SYSTEM_PROMPT

    async def listing() -> dict:
        pool = await LocalToolPool.create(cfg.tools)
        try:
            return await pool.list_tools()
        finally:
            await pool.close()

    tools = inventory_tools_for_prompt(asyncio.run(listing()), {"polygon", "fmp"})
    served = AutoTokenizer.from_pretrained(run / "export")
    trained = load_tokenizer(cfg.model)
    task_system, own = {"role": "system", "content": SYSTEM_PROMPT}, {"role": "system", "content": "Be brief."}
    for request, task in (([question], [task_system, question]), ([own, question], [own, question])):
        shown = served.apply_chat_template(
            request, tools=[_as_function(t) for t in tools], add_generation_prompt=True, tokenize=False
        )
        assert tool_block(tools, cfg.env.final_answer, cfg.env.tool_format) in shown
        assert shown == render_prompt(trained, task, tools, cfg.env.final_answer, cfg.env.tool_format)


def test_qlora_run_merges_into_its_4bit_base(runs: dict, tmp_path: Path) -> None:
    """The policy a QLoRA run trained is the adapter over the NF4 base: --merge writes that, not the adapter
    over the full-precision base; the adapter export says how to load the base in 4 bit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, trained = runs["qlora"]
    proc = run_export("--run", str(run), "--out", str(tmp_path / "adapter"))
    assert "load_in_4bit=True" in proc.stdout
    assert "nf4" in json.loads((tmp_path / "adapter" / "mcprl_export.json").read_text())["quantization"]
    proc = run_export("--run", str(run), "--merge", "--out", str(tmp_path / "merged"))
    assert "quantized to NF4, dequantized" in proc.stdout
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(policy_logits(merged), trained, rtol=0, atol=1e-3)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter" / "base", dtype=torch.float32)
    over_full_precision = policy_logits(PeftModel.from_pretrained(base, tmp_path / "adapter").eval())
    assert (over_full_precision - trained).abs().max() > 1e-2  # NF4 matters here: the test can fail


def test_full_run_exports_its_trained_weights(runs: dict) -> None:
    from transformers import AutoModelForCausalLM

    run, trained = runs["full"]
    out = run / "model"
    proc = run_export("--run", str(run), "--out", str(out), "--checkpoint", f"step_{STEPS}")
    assert "export: full from" in proc.stdout and f"checkpoints/step_{STEPS}" in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(policy_logits(model), trained, rtol=0, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(out.parent / "model", dtype=torch.float32)  # loads unchanged
    assert base.config.model_type == "llama"


def test_clear_errors(runs: dict, tmp_path: Path) -> None:
    lora, _ = runs["lora"]
    full, _ = runs["full"]
    with pytest.raises(ExportError, match="no such run: 'nope'"):
        export("nope", storage_root=str(tmp_path))
    with pytest.raises(ExportError, match=r"--merge: run .* is a full fine-tune"):
        export(str(full), str(tmp_path / "x"), merge=True)
    with pytest.raises(ExportError, match=r"no complete checkpoint 'step_9' .*checkpoints: step_2"):
        export(str(lora), str(tmp_path / "x"), checkpoint="step_9")
    empty = tmp_path / "empty-run"
    empty.mkdir()
    (empty / "config.json").write_text((full / "config.json").read_text())
    with pytest.raises(ExportError, match="has no checkpoint to export"):
        export(str(empty), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()  # nothing was written by a refused export

    # An existing --out is refused as the user sees it: exit 2, the folder named, nothing replaced.
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    proc = run_export("--run", str(lora), "--out", str(taken), check=False)
    assert proc.returncode == 2
    assert f"--out '{taken}' already exists" in proc.stderr and "--force" in proc.stderr
    assert (taken / "keep.txt").read_text() == "mine"
