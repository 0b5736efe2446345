"""Benchmark suite `gpu`: the learner and the HF engine on one accelerator, in this process, without Ray.

    python -m bench --suite gpu [--set gpu.shapes=135m,1.7b] [--set gpu.batch=32]   (all: bench/options.py)

Made for a GPU box that has torch, transformers and peft but neither Ray nor vLLM: it drives the plain
classes (`actors.learner.Learner`, `actors.hf_engine.HFEngine`) that the Ray actors wrap. On a machine
without CUDA it runs the same code on the CPU (what `--quick` and the tests do).

The models are random weights in real shapes (`SHAPES`), with SmolLM2's tokenizer taken from the
`tiny-random` build: speed does not depend on the weights' values, and no model can be downloaded onto
such a box. For each shape, side by side in one run:

1. Learner tokens/s, LoRA r=16 on q,k,v,o, bf16, gradient checkpointing, on suite train's synthetic GRPO
   batch (`gpu.samples` × ~`gpu.prompt_tokens` + ~`gpu.gen_tokens`, in groups of `gpu.group_size` sharing a
   prompt): today's path (the LM head only where the loss mask is 1, a group's prompt computed once)
   against each episode whole (with and without the padding mask), and against the LM head at every
   position too (`PATHS`), steps interleaved.
2. HF engine generated tokens/s: `gpu.batch` concurrent requests of `gpu.prompt_tokens` random ids, each
   generating `gpu.new_tokens` at temperature 1 (stop strings off, so every request runs to the end).
3. Weight sync inside one process: `export_adapter` → `HFEngine.load_adapter` (LoRA), and with a full
   fine-tune learner `export_weights` → `HFEngine.update_weights` (every weight). Medians of `gpu.pushes`.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.options import BenchOptions, GpuOptions, TrainOptions
from bench.results import Row, SuiteResult, machine, spread
from bench.train import LENGTH_SPREAD, bench_config, bench_learners, make_batch, tokens_per_s
from configs.schema import SamplingConfig

# Llama-shaped sizes of SmolLM2's family (their configs); `tiny` is tiny-random's, for --quick.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32},
    "135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "head_dim": 64},
    "1.7b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
             "num_key_value_heads": 32, "head_dim": 64},
}  # fmt: skip

# The learner's paths, measured in turn on one batch: today's default, and the old ones.
PATHS: dict[str, dict[str, bool]] = {
    "ours": {},  # the LM head at trained positions, a group's prompt once
    "unshared": {"shared_prompt": False},  # each episode whole
    "pad_mask": {"shared_prompt": False, "pad_mask": True},  # each episode whole, the padding mask to attention
    "full_logits": {"selective_logits": False},  # the LM head at every position, each episode whole
}

QUICK = {"shapes": ["tiny"], "samples": 4, "group_size": 2, "prompt_tokens": 24, "gen_tokens": 8, "batch": 4,
         "new_tokens": 8, "train_warmup": 1, "train_steps": 1, "pushes": 1}  # fmt: skip


class _Awaitable:
    """A plain Learner behind the `await learner.train_step(...)` that bench.train's timers expect."""

    def __init__(self, learner: Any) -> None:
        self.learner = learner

    async def train_step(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return self.learner.train_step(samples)


def accelerator() -> dict[str, Any]:
    """The device the figures come from: the GPU's name and memory, or the CPU."""
    import peft
    import torch
    import transformers

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device="cuda", gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
        info["cuda"] = torch.version.cuda
    else:
        info["device"] = "cpu"
    return info


def build_shape(shape: str, root: Path) -> Path:
    """A model folder: random bf16 weights in `SHAPES[shape]`, SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from actors.models import llama_config, resolve_model

    tokenizer_dir = resolve_model("tiny-random")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    config = llama_config(tokenizer, max_position_embeddings=8192, rope_theta=100000.0, **SHAPES[shape])
    out = root / shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # initialising 1.7B parameters on a CPU takes minutes, on a GPU a second
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for name in ("chat_template.jinja",):
        if (tokenizer_dir / name).is_file() and not (out / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    del model
    return out


def _config(opts: GpuOptions, folder: Path, mode: str) -> Any:
    cfg = bench_config(TrainOptions(model=str(folder), seed=opts.seed), mode)
    cfg.learner.micro_batch_tokens = opts.micro_batch_tokens
    cfg.algorithm.kl_coef = 0.0  # no reference model: the step is the policy's forward and backward
    longest = math.ceil(opts.prompt_tokens * (1 + LENGTH_SPREAD)) + opts.new_tokens  # make_batch spreads lengths
    cfg.rollout.max_model_len = max(256, longest + 64)
    cfg.rollout.hf_max_batch_size = opts.batch
    cfg.rollout.hf_batch_wait_ms = 50.0  # the whole batch arrives together
    return cfg


def _peak_gib() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


async def timed_syncs(export: Any, load: Any, pushes: int, first_version: int) -> dict[str, list[float]]:
    """Seconds of `export()` and of `await load(version, exported)` (the GPU synchronised), for `pushes`
    syncs after a warm-up one; versions count up from `first_version`."""
    export_s, load_s = [], []
    for k in range(pushes + 1):
        t0 = time.perf_counter()
        payload = export()
        t1 = time.perf_counter()
        await load(first_version + k, payload)
        _sync()
        if k:
            export_s.append(t1 - t0)
            load_s.append(time.perf_counter() - t1)
    return {"export_s": export_s, "load_s": load_s}


async def bench_shape(opts: GpuOptions, shape: str, folder: Path, repeats: int) -> dict[str, Any]:
    """One shape's learner, engine and sync figures (the module docstring's 1-3)."""
    from actors.hf_engine import HFEngine
    from actors.learner import Learner

    out: dict[str, Any] = {"shape": shape, **SHAPES[shape]}
    cfg = _config(opts, folder, "lora")
    learners = {}
    for name, path in PATHS.items():
        c = cfg.model_copy(deep=True)
        c.learner = c.learner.model_copy(update=path)
        learner = Learner(c)
        out.setdefault("params", learner.setup()["params"])
        learners[name] = learner
    vocab = learners["ours"].model.get_input_embeddings().num_embeddings
    batch = make_batch(opts.samples, opts.prompt_tokens, opts.gen_tokens, vocab, opts.seed, opts.group_size)
    _reset_peak()
    out["learner"] = await bench_learners(
        {k: _Awaitable(v) for k, v in learners.items()}, batch, opts.train_warmup, opts.train_steps * repeats
    )
    out["learner_peak_gib"] = _peak_gib()

    engine = HFEngine(cfg)
    await engine.start()
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=opts.new_tokens, stop=[], seed=None)
    prompts = [[int(t) for t in s["prompt_ids"]] for s in make_batch(opts.batch, opts.prompt_tokens, 1, vocab, 1)]
    gen_runs = []
    for k in range(repeats + 1):  # the first round is a warm-up (kernels, allocator)
        t = time.perf_counter()
        gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
        _sync()
        wall = time.perf_counter() - t
        tokens = sum(len(g.token_ids) for g in gens)
        if k:
            gen_runs.append({"wall_s": wall, "generated": tokens, "tokens_per_s": tokens / wall})
    out["engine"] = {"requests": opts.batch, "prompt_tokens": opts.prompt_tokens, "runs": gen_runs}

    lora = learners["ours"]
    adapter_bytes = len(lora.export_adapter()["safetensors"])
    out["adapter_sync"] = {
        **await timed_syncs(lora.export_adapter, engine.load_adapter, opts.pushes, 1),
        "bytes": adapter_bytes,
    }
    for learner in learners.values():
        learner.close()
    del learners, lora
    _reset_peak()

    full = Learner(_config(opts, folder, "full"))
    full.setup()
    full.train_step(batch[:2])  # the weights move, so the copy is not of the engine's own values
    first = opts.pushes + 2  # after the adapter versions
    out["weight_sync"] = {
        **await timed_syncs(full.export_weights, engine.update_weights, opts.pushes, first),
        "full_peak_gib": _peak_gib(),
    }
    full.close()
    await engine.shutdown()
    return out


def run(opts: BenchOptions, console: Any) -> SuiteResult:
    o = opts.gpu.model_copy(update=QUICK) if opts.quick else opts.gpu
    acc = accelerator()
    where = acc.get("gpu", "CPU")
    console.print(f"suite gpu on {where}: torch {acc['torch']}, transformers {acc['transformers']}, peft {acc['peft']}")
    root = Path(tempfile.mkdtemp(prefix="mcprl-bench-gpu-"))
    shapes = []
    try:
        for shape in o.shapes:
            t = time.perf_counter()
            folder = build_shape(shape, root)
            console.print(f"  {shape}: built in {time.perf_counter() - t:.1f} s; measuring")
            shapes.append(asyncio.run(bench_shape(o, shape, folder, opts.repeats)))
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows, notes = [], []
    for s in shapes:
        name, lr = s["shape"], s["learner"]
        sel = lr["ours"]
        rows.append(Row(f"{name}: learner tokens/s, LoRA", "tokens/s", tokens_per_s(sel),
                        tokens_per_s(lr["full_logits"]), "LM head at every position, each episode whole"))  # fmt: skip
        rows.append(Row(f"{name}: learner tokens/s, a group's prompt once", "tokens/s", tokens_per_s(sel),
                        tokens_per_s(lr["unshared"]), "each episode whole"))  # fmt: skip
        rows.append(Row(f"{name}: learner tokens/s, episodes whole without the padding mask", "tokens/s",
                        tokens_per_s(lr["unshared"]), tokens_per_s(lr["pad_mask"]),
                        "the padding mask passed to attention"))  # fmt: skip
        rows.append(
            Row(
                f"{name}: HF engine generated tokens/s",
                "tokens/s",
                spread([r["tokens_per_s"] for r in s["engine"]["runs"]]),
            )
        )
        a, w = s["adapter_sync"], s["weight_sync"]
        for label, sync in (("LoRA", a), ("full weights", w)):
            total_ms = [(x + y) * 1e3 for x, y in zip(sync["export_s"], sync["load_s"], strict=True)]
            rows.append(Row(f"{name}: {label} export + load", "ms", spread(total_ms), better="lower"))
        notes.append(
            f"{name} ({s['params'] / 1e6:.0f}M parameters): learner {sel['tokens_per_step']} tokens per step of "
            f"{sel['samples']} samples in groups of {o.group_size}, peak {s['learner_peak_gib']:.1f} GiB for the LoRA "
            f"learners; engine "
            f"{o.batch} requests × {o.prompt_tokens} prompt + {o.new_tokens} new tokens; LoRA export "
            f"{statistics.median(a['export_s']) * 1e3:.1f} ms + load {statistics.median(a['load_s']) * 1e3:.1f} ms "
            f"({a['bytes'] / 2**20:.1f} MiB); full weights export {statistics.median(w['export_s']) * 1e3:.0f} ms + "
            f"load {statistics.median(w['load_s']) * 1e3:.0f} ms."
        )
    notes.append("Random weights in the named shapes, SmolLM2's tokenizer; one process, no Ray, no vLLM.")
    report = {
        "machine": {**machine(), "gpu": acc.get("gpu", "")},
        "accelerator": acc,
        "options": o.model_dump(),
        "shapes": shapes,
    }
    for row in rows:
        console.print(
            f"  {row.figure}: {row.ours.text()} {row.unit}"
            + (f" (×{row.ratio:.2f} vs {row.baseline_name})" if row.ratio else "")
        )
    return SuiteResult("gpu", report, rows, notes=notes)
