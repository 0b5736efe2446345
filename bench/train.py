"""Benchmark suite `train`: the learner's speed and the cost of getting its policy into the engines.

    python -m bench --suite train [--set train.model=smollm2-135m-instruct] [--set train.pushes=5]
                                  [--set train.vllm=auto|on|off]    (every size: bench/options.py TrainOptions)

Measured side by side in one run, on an embedded Ray (or the Ray already running in this process):

1. Learner tokens/s: one LearnerGroup worker (LoRA r=16 on q,k,v,o, bf16, gradient checkpointing) runs
   `train_step` on a GRPO-sized batch (16 samples: ~900 prompt tokens, ~100 generated tokens, random
   token ids, logprobs and advantages). `train.train_warmup` steps on 2 of the samples come first, left out;
       tokens/s = (prompt + response tokens) / median step time,   generated tokens/s = response tokens / same.
   The samples come in GRPO groups of `train.group_size` that share a prompt. Beside it, stepping in turn
   with it, two learners on old paths: `learner.selective_logits` false (the LM head at every position,
   each episode whole): `learner_selective_speedup` = its median step time / ours; and
   `learner.shared_prompt` false (each episode whole, the LM head at trained positions):
   `learner_shared_speedup` = its median step time / ours; and the same with `learner.pad_mask` true
   (the padding mask passed to attention, which keeps SDPA off its causal kernel):
   `learner_causal_speedup` = its median step time / the unshared one's.
   Then a long-response batch (the same count, ~`train.long_prompt_tokens` + ~`train.long_gen_tokens`, as
   when each episode holds a big tool result), ours against `learner.shared_prompt_when: always` (each
   group in one row, the old path), their steps interleaved: `learner_long_speedup` = its median / ours.
   Ours runs those groups as whole episodes (grpo.batch.share_pays).
2. LoRA push to every engine of a RolloutGroup (2 HF engines; then 1 vLLM engine if it fits the time
   budget), the same engines and the same learner, the two paths alternating (order flipped each round):
   (a) object store:  export_adapter_ref() (learner → one object)  →  push_adapter(v, ref) (each engine
       fetches it and loads it; the call returns once every engine reports version v);
   (b) disk:          save_adapter(folder) (learner writes PEFT files)  →  each engine reads the folder
       itself (actors.adapter_io.read_adapter runs inside the engine actor, where the `FolderAdapter`
       argument is unpickled) and loads it with the same `load_adapter`; then every engine's version
       is read back.
   Figures are medians over `train.pushes` rounds after one warm-up round. The split of (a): export; RPC
   (a `version()` round trip); fetch (an engine resolving the ref, minus the RPC); load (the engine's own
   timing of `load_adapter`, as push_adapter reports it). (b): save; read + RPC (per-engine time − load);
   load (the engine's own timing, from the same call).
   Goals: (a) at least 2x faster than (b) end to end; push_adapter under 30 ms with every engine.
3. Full-weight sync: a second learner with finetune.mode=full, export_weights_refs() (one object per
   chunk of whole layers) → push_weights(v, refs) to the same engines; median seconds.

Numbers depend on the machine and its load: compare the rows of one run, not runs of different days.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from actors.precision import compute_dtype
from bench.options import BenchOptions, TrainOptions
from bench.results import Row, SuiteResult, machine, machine_line, spread
from configs.schema import Config

# --quick: tiny-random, tiny batch, 2 HF engines, no vLLM (the tests' smoke run)
QUICK = {
    "model": "tiny-random", "samples": 4, "prompt_tokens": 24, "gen_tokens": 8, "long_prompt_tokens": 8,
    "long_gen_tokens": 60, "train_warmup": 1,
    "train_steps": 1, "pushes": 2, "weight_pushes": 1, "engines": 2, "vllm": "off",
}  # fmt: skip

GOAL_RATIO = 2.0  # object store at least this much faster than the disk path
GOAL_PUSH_MS = 30.0  # push_adapter, every engine confirming, under this
VLLM_RESERVE_S = 200.0  # what the vLLM part may take (start 30-100 s, pushes, shutdown): skipped without it
WARMUP_SAMPLES = 2  # warm-up train_steps run on this many samples of the batch
LENGTH_SPREAD = 0.1  # sample lengths vary uniformly by ±10 % around the asked sizes


def bench_config(opts: TrainOptions, mode: str, backend: str = "hf", engines: int = 1) -> Config:
    """One config per role. Fractional CPUs so that both learners and the engines fit a 2-core Ray; the
    threads are set by the actors themselves (learner: all cores; HF engines: a share each)."""
    return Config.model_validate(
        {
            "run_name": f"bench-train-{mode}",  # placement groups are named after it: one per learner
            "model": {"name": opts.model, "dtype": "bfloat16"},
            "finetune": {"mode": mode, "lora": {"r": 16, "alpha": 32}},
            "learner": {
                "workers": 1,
                "worker_resources": {"num_cpus": 0.3},  # five learners at once: ours, full, three old paths
                "dtype": "bfloat16",
                "gradient_checkpointing": True,
                "micro_batch_tokens": 4096,  # fp32 logits of a 49k vocabulary: ~0.9 GB per micro-batch
                "optim": {"lr": 5e-5},
            },
            "rollout": {
                "backend": backend,
                "engines": engines,
                "runners": 1,
                "engine_resources": {"num_cpus": 0.25},
                "runner_resources": {"num_cpus": 0.05},
                "max_model_len": 1024,
                "vllm_kv_cache_gb": 1,
                "weight_push": "adapter",  # this suite measures the adapter's path (merged: benchmark --suite rollout)
            },
            "train": {"seed": opts.seed},
        }
    )


def make_batch(
    n: int, prompt_tokens: int, gen_tokens: int, vocab: int, seed: int = 0, group_size: int = 1
) -> list[dict[str, Any]]:
    """`n` GRPO samples: lengths uniform within ±10 % of the asked sizes, random ids below `vocab`, every
    response token generated (loss_mask 1), rollout logprobs in [-3, 0), advantages ~ N(0, 1). Each run of
    `group_size` samples shares its prompt, as a GRPO group's episodes do."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        spread = max(0, round(mean * LENGTH_SPREAD))
        return max(1, mean + rng.randint(-spread, spread))

    if group_size < 1:
        raise ValueError(f"make_batch: group_size must be >= 1, got {group_size}")
    batch: list[dict[str, Any]] = []
    prompt: list[int] = []
    for k in range(n):
        if k % group_size == 0:
            p, r = length(prompt_tokens), length(gen_tokens)
            prompt = [rng.randrange(vocab) for _ in range(p)]
        else:
            r = length(gen_tokens)
        batch.append(
            {
                "prompt_ids": prompt,
                "response_ids": [rng.randrange(vocab) for _ in range(r)],
                "loss_mask": [1] * r,
                "rollout_logprobs": [-3.0 * rng.random() for _ in range(r)],
                "advantage": rng.gauss(0.0, 1.0),
            }
        )
    return batch


class FolderAdapter:
    """A PEFT adapter folder that turns into the adapter dict wherever it is unpickled.

    Passed as a task argument (a few bytes, inlined in the task), it makes the receiving engine actor
    read the folder itself with `actors.adapter_io.read_adapter`, before `load_adapter` runs: the disk path
    of a sync, through the engine's ordinary `load_adapter`."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = str(folder)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        from actors.adapter_io import read_adapter

        return read_adapter, (self.folder,)


def _touch_adapter(host: Any, adapter: dict[str, Any]) -> int:
    """Run in an engine actor via `__ray_call__`: the adapter arrived (fetched, deserialized); its size.
    A {"config", "safetensors"} adapter is one blob (bytes); a {"config", "state_dict"} one: each tensor."""
    if "safetensors" in adapter:
        return len(adapter["safetensors"])
    return sum(int(t.numel()) for t in adapter["state_dict"].values())


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _vocab_size(cfg: Config) -> int:
    from transformers import AutoConfig

    from actors.models import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(cfg.model.name, cfg.model.cache_dir), local_files_only=True)
    return int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)


# --------------------------------------------------------------------------- 1. learner tokens/s


async def bench_learner(learner: Any, batch: list[dict[str, Any]], warmup: int, steps: int) -> dict[str, Any]:
    """`warmup` train_steps on the batch's first WARMUP_SAMPLES samples (one-time costs: lazy set-up, the
    optimizer's state, thread pools; a few samples pay them as well as the whole batch, at a fraction of
    its time), then `steps` timed train_steps on the whole batch (the learner's clock and the driver's)."""
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in batch)
    generated = sum(len(s["response_ids"]) for s in batch)
    for _ in range(warmup):
        await learner.train_step(batch[:WARMUP_SAMPLES])
    step_s, wall_s, last = [], [], {}
    for _ in range(steps):
        t = time.perf_counter()
        last = await learner.train_step(batch)
        wall_s.append(time.perf_counter() - t)
        step_s.append(float(last["step_time_s"]))
        if not all(math.isfinite(float(last[k])) for k in ("policy_loss", "grad_norm")):
            raise RuntimeError(f"bench train: train_step gave non-finite metrics: {last}")
    step = statistics.median(step_s)
    return {
        "samples": len(batch),
        "tokens_per_step": tokens,
        "generated_tokens_per_step": generated,
        "warmup_steps": warmup,
        "steps": steps,
        "step_s": step_s,
        "step_s_median": step,
        "wall_s_median": statistics.median(wall_s),
        "tokens_per_s": tokens / step,
        "generated_tokens_per_s": generated / step,
        "policy_loss": float(last["policy_loss"]),
        "grad_norm": float(last["grad_norm"]),
    }


async def bench_learners(
    learners: dict[str, Any], batch: list[dict[str, Any]], warmup: int, steps: int
) -> dict[str, dict[str, Any]]:
    """`bench_learner` for each learner, their timed steps interleaved (one step each per round, the order
    flipped every round), so that the machine's load falls on all of them alike."""
    for learner in learners.values():
        for _ in range(warmup):
            await learner.train_step(batch[:WARMUP_SAMPLES])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in learners}
    for k in range(steps):
        for name in list(learners)[:: 1 if k % 2 == 0 else -1]:
            runs[name].append(await bench_learner(learners[name], batch, 0, 1))
    return {name: _merge_runs(rs, warmup) for name, rs in runs.items()}


def _merge_runs(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One-step `bench_learner` results as one: the steps listed, the medians over them."""
    out = dict(runs[-1], warmup_steps=warmup)
    out["step_s"] = [s for r in runs for s in r["step_s"]]
    out["steps"] = len(out["step_s"])
    out["step_s_median"] = statistics.median(out["step_s"])
    out["wall_s_median"] = statistics.median(r["wall_s_median"] for r in runs)
    out["tokens_per_s"] = out["tokens_per_step"] / out["step_s_median"]
    out["generated_tokens_per_s"] = out["generated_tokens_per_step"] / out["step_s_median"]
    return out


# --------------------------------------------------------------------------- 2. LoRA push, a vs b


async def _confirm(rollout: Any, version: int) -> None:
    versions = await asyncio.gather(*(h.version.remote() for h in rollout.engines))
    wrong = {i: v for i, v in enumerate(versions) if v != version}
    if wrong:
        raise RuntimeError(f"bench train: after pushing v{version}, engines report {wrong}")


async def push_object_store(learner: Any, rollout: Any, version: int) -> dict[str, Any]:
    """Path (a): export_adapter_ref → push_adapter; returns seconds and the ref (for the fetch probe)."""
    t0 = time.perf_counter()
    ref = await learner.export_adapter_ref()
    t1 = time.perf_counter()
    result = await rollout.push_adapter(version, ref)
    t2 = time.perf_counter()
    if len(result["engines"]) != len(rollout.engines):
        raise RuntimeError(f"bench train: push_adapter v{version} reached engines {result['engines']} only")
    return {
        "export_s": t1 - t0,
        "push_s": t2 - t1,
        "per_engine_s": result["per_engine_s"],
        "load_s": result["load_s"],  # each engine's own timing of load_adapter
        "ref": ref,
    }


async def push_disk(learner: Any, rollout: Any, version: int, folder: Path) -> dict[str, Any]:
    """Path (b): save_adapter(folder) → every engine reads the folder and loads it → versions read back."""
    t0 = time.perf_counter()
    await learner.save_adapter(str(folder))
    t1 = time.perf_counter()

    async def one(handle: Any) -> tuple[float, float]:
        t = time.perf_counter()
        load_s = await handle.load_adapter.remote(version, FolderAdapter(folder))  # the engine's own timing
        return time.perf_counter() - t, float(load_s)

    per_engine = await asyncio.gather(*(one(h) for h in rollout.engines))
    await _confirm(rollout, version)
    t2 = time.perf_counter()
    return {
        "save_s": t1 - t0,
        "push_s": t2 - t1,
        "per_engine_s": [w for w, _ in per_engine],
        "load_s": [load for _, load in per_engine],
    }


async def fetch_probe(rollout: Any, ref: Any) -> dict[str, float]:
    """Seconds, slowest engine: a bare RPC (version()), and an RPC whose argument is the adapter ref."""

    async def timed(call: Any) -> float:
        t = time.perf_counter()
        await call
        return time.perf_counter() - t

    rpc = await asyncio.gather(*(timed(h.version.remote()) for h in rollout.engines))
    # A top-level ref argument is resolved (fetched, deserialized) in the engine before the function runs.
    fetch = await asyncio.gather(*(timed(h.__ray_call__.remote(_touch_adapter, ref)) for h in rollout.engines))
    return {"rpc_s": max(rpc), "rpc_fetch_s": max(fetch)}


async def bench_lora_push(
    learner: Any, rollout: Any, pushes: int, root: Path, first_version: int = 1
) -> tuple[dict[str, Any], int]:
    """One warm-up round, then `pushes` rounds of (a) and (b), order flipped each round. Returns the
    figures and the next free version number."""
    version = first_version
    a_runs: list[dict[str, Any]] = []
    b_runs: list[dict[str, Any]] = []
    probes: list[dict[str, float]] = []
    adapter_bytes = 0
    for round_ in range(pushes + 1):
        order = ("a", "b") if round_ % 2 == 0 else ("b", "a")
        for path in order:
            if path == "a":
                run = await push_object_store(learner, rollout, version)
                ref = run.pop("ref")
                if round_ > 0:
                    a_runs.append(run)
                    probes.append(await fetch_probe(rollout, ref))
                del ref
            else:
                folder = root / f"adapter-v{version}"
                run = await push_disk(learner, rollout, version, folder)
                adapter_bytes = (folder / "adapter_model.safetensors").stat().st_size
                shutil.rmtree(folder, ignore_errors=True)
                if round_ > 0:
                    b_runs.append(run)
            version += 1
    engines = len(rollout.engines)
    a_total = [r["export_s"] + r["push_s"] for r in a_runs]
    b_total = [r["save_s"] + r["push_s"] for r in b_runs]
    a = {
        "export_ms": median_ms([r["export_s"] for r in a_runs]),
        "push_ms": median_ms([r["push_s"] for r in a_runs]),
        "per_engine_ms": [median_ms([r["per_engine_s"][i] for r in a_runs]) for i in range(engines)],
        "total_ms": median_ms(a_total),
        "total_all_ms": [t * 1e3 for t in a_total],
        "rpc_ms": median_ms([p["rpc_s"] for p in probes]),
        "fetch_ms": median_ms([max(0.0, p["rpc_fetch_s"] - p["rpc_s"]) for p in probes]),
        "load_ms": median_ms([max(r["load_s"]) for r in a_runs]),  # the slowest engine's own load
    }
    b = {
        "save_ms": median_ms([r["save_s"] for r in b_runs]),
        "push_ms": median_ms([r["push_s"] for r in b_runs]),
        "per_engine_ms": [median_ms([r["per_engine_s"][i] for r in b_runs]) for i in range(engines)],
        "total_ms": median_ms(b_total),
        "total_all_ms": [t * 1e3 for t in b_total],
        "load_ms": median_ms([max(r["load_s"]) for r in b_runs]),
        # read the folder (in the engine, while unpickling the argument) + the RPC: per-engine time − load
        "read_rpc_ms": median_ms(
            [max(w - ld for w, ld in zip(r["per_engine_s"], r["load_s"], strict=True)) for r in b_runs]
        ),
    }
    report = {
        "engines": engines,
        "pushes": pushes,
        "adapter_mb": adapter_bytes / 2**20,
        "object_store": a,
        "disk": b,
        "ratio": b["total_ms"] / a["total_ms"],  # end to end: learner side included
        "engine_side_ratio": b["push_ms"] / a["push_ms"],
        "goal_ratio_met": b["total_ms"] / a["total_ms"] >= GOAL_RATIO,
        "goal_30ms_met": a["push_ms"] < GOAL_PUSH_MS,
    }
    return report, version


# --------------------------------------------------------------------------- 3. full-weight sync


async def bench_weight_sync(learner: Any, rollout: Any, pushes: int, first_version: int) -> tuple[dict[str, Any], int]:
    """One warm-up sync, then `pushes` timed: export_weights_refs → push_weights (every engine confirms)."""
    version = first_version
    export_s, push_s, chunks, nbytes = [], [], 0, 0
    for i in range(pushes + 1):
        t0 = time.perf_counter()
        refs = await learner.export_weights_refs()
        t1 = time.perf_counter()
        result = await rollout.push_weights(version, refs)
        t2 = time.perf_counter()
        if len(result["engines"]) != len(rollout.engines):
            raise RuntimeError(f"bench train: push_weights v{version} reached engines {result['engines']} only")
        if i == 0:
            chunks = len(refs)
            nbytes = sum(t.numel() * t.element_size() for c in await asyncio.gather(*refs) for t in c.values())
        else:
            export_s.append(t1 - t0)
            push_s.append(t2 - t1)
        del refs
        version += 1
    total = [e + p for e, p in zip(export_s, push_s, strict=True)]
    return {
        "engines": len(rollout.engines),
        "pushes": pushes,
        "chunks": chunks,
        "mb": nbytes / 2**20,
        "export_s": statistics.median(export_s),
        "push_s": statistics.median(push_s),
        "total_s": statistics.median(total),
        "total_all_s": total,
    }, version


# --------------------------------------------------------------------------- the suite


async def bench_engines(
    cfg: Config, lora_learner: Any, full_learner: Any, opts: TrainOptions, root: Path
) -> dict[str, Any]:
    """Start a rollout group (no tool pool: nothing here plays episodes), measure LoRA pushes and weight syncs."""
    from orchestration.rollout_group import RolloutGroup

    rollout = RolloutGroup(cfg, None)
    t = time.perf_counter()
    await rollout.start()
    out: dict[str, Any] = {"start_s": time.perf_counter() - t, "backend": cfg.rollout.backend}
    try:
        out["lora"], version = await bench_lora_push(lora_learner, rollout, opts.pushes, root)
        out["weights"], _ = await bench_weight_sync(full_learner, rollout, opts.weight_pushes, version)
    finally:
        await rollout.shutdown()
    return out


def run_train_suite(opts: TrainOptions, console: Any) -> dict[str, Any]:
    """Run the suite (see the module doc), print its tables, return every figure as a dict.

    Keys: machine, model, lora, dtype, learner_setup_s, learner (tokens/s...), hf (start_s, lora, weights),
    vllm (the same, or {"skipped": why}), wall_s. Uses the Ray this process already runs, else an embedded one."""
    import ray

    from cluster.ray_env import ray_session
    from orchestration.learner_group import LearnerGroup

    t_start = time.perf_counter()
    lora_cfg = bench_config(opts, "lora", "hf", opts.engines)
    report: dict[str, Any] = {
        "machine": machine(),
        "model": opts.model,
        "lora": {"r": lora_cfg.finetune.lora.r, "target_modules": list(lora_cfg.finetune.lora.target_modules)},
        "dtype": compute_dtype(lora_cfg.learner.dtype),  # what the learner computes in on this CPU
    }
    vocab = _vocab_size(lora_cfg)
    batch = make_batch(opts.samples, opts.prompt_tokens, opts.gen_tokens, vocab, opts.seed, opts.group_size)
    root = Path(tempfile.mkdtemp(prefix="mcprl-bench-train-"))
    # Reuse a Ray this process already runs (a test session's): ray_session would shut it down after.
    session = contextlib.nullcontext() if ray.is_initialized() else ray_session(lora_cfg.cluster)
    lora_learner = LearnerGroup(lora_cfg)
    full_learner = LearnerGroup(bench_config(opts, "full", "hf", opts.engines))

    # The old paths for the side-by-side figures: the LM head at every position, not only the trained ones
    # (each episode whole, as that path is); and the trained positions with each episode whole.
    def variant(name: str, **learner: bool) -> Any:
        return LearnerGroup(lora_cfg.model_copy(update={
            "run_name": f"{lora_cfg.run_name}-{name}",  # its own placement group and actor names
            "learner": lora_cfg.learner.model_copy(update=learner),
        }))  # fmt: skip

    all_logits_learner = variant("all-logits", selective_logits=False)
    unshared_learner = variant("unshared", shared_prompt=False)
    pad_mask_learner = variant("pad-mask", shared_prompt=False, pad_mask=True)
    always_learner = variant("always-shared", shared_prompt_when="always")

    async def parts() -> None:
        try:
            await _run_parts(
                report,
                opts,
                batch,
                console,
                lora_learner,
                full_learner,
                (all_logits_learner, unshared_learner, pad_mask_learner, always_learner),
                root,
                t_start,
            )
        finally:
            olds = (all_logits_learner, unshared_learner, pad_mask_learner, always_learner)
            for group in (lora_learner, full_learner, *olds):
                await group.shutdown()

    try:
        with session:
            asyncio.run(parts())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - t_start
    print_train(report, console)
    return report


async def _run_parts(
    report: dict[str, Any], opts: TrainOptions, batch: list[dict[str, Any]], console: Any,
    lora_learner: Any, full_learner: Any, old_learners: tuple[Any, ...], root: Path, t_start: float,
) -> None:  # fmt: skip
    from actors.engine_api import vllm_available

    with console.status("train: starting the learners (LoRA and full)"):
        report["learner_setup_s"] = (await lora_learner.start())["setup_s"]
        await full_learner.start()
    steps = opts.train_warmup + opts.train_steps
    with console.status(f"train: {steps} train_step(s) of {opts.samples} samples, today's path and the old ones"):
        all_logits, unshared, pad_mask, always = old_learners
        await asyncio.gather(all_logits.start(), unshared.start(), pad_mask.start())
        learners = {
            "learner": lora_learner,
            "learner_all_logits": all_logits,
            "learner_unshared": unshared,
            "learner_pad_mask": pad_mask,
        }
        report.update(await bench_learners(learners, batch, opts.train_warmup, opts.train_steps))
        await asyncio.gather(all_logits.shutdown(), unshared.shutdown(), pad_mask.shutdown())
        step = report["learner"]["step_s_median"]
        report["learner_selective_speedup"] = report["learner_all_logits"]["step_s_median"] / step
        report["learner_shared_speedup"] = report["learner_unshared"]["step_s_median"] / step
        report["learner_causal_speedup"] = (
            report["learner_pad_mask"]["step_s_median"] / report["learner_unshared"]["step_s_median"]
        )
    with console.status(f"train: {steps} train_step(s) of {opts.samples} long-response samples, shared or not"):
        await always.start()
        long = make_batch(
            len(batch), opts.long_prompt_tokens, opts.long_gen_tokens, _vocab_size(lora_learner.cfg), opts.seed,
            opts.group_size,
        )  # fmt: skip
        runs = await bench_learners({"ours": lora_learner, "always": always}, long, opts.train_warmup, opts.train_steps)
        await always.shutdown()
        report["learner_long"], report["learner_long_always"] = runs["ours"], runs["always"]
        report["learner_long_speedup"] = runs["always"]["step_s_median"] / runs["ours"]["step_s_median"]
    with console.status(f"train: {opts.engines} HF engine(s): LoRA pushes a/b, weight syncs"):
        report["hf"] = await bench_engines(lora_learner.cfg, lora_learner, full_learner, opts, root)
    elapsed = time.perf_counter() - t_start
    if opts.vllm == "off":
        report["vllm"] = {"skipped": "train.vllm=off"}
    elif not vllm_available():
        report["vllm"] = {"skipped": "vllm is not installed"}
    elif opts.vllm == "auto" and elapsed + VLLM_RESERVE_S > opts.budget_s:
        report["vllm"] = {
            "skipped": f"time budget: {elapsed:.0f} s spent, the vLLM part needs ~{VLLM_RESERVE_S:.0f} s "
            f"more of the {opts.budget_s:.0f} s budget"
        }
    else:
        vllm_cfg = bench_config(opts, "lora", "vllm", 1)
        with console.status("train: 1 vLLM engine: start, LoRA pushes a/b, weight syncs"):
            report["vllm"] = await bench_engines(vllm_cfg, lora_learner, full_learner, opts, root)


def print_train(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    m = report["machine"]
    console.print(f"machine: {machine_line(m)}, Python {m['python']}")
    ln = report["learner"]
    lora = report["lora"]
    table = Table(
        title=f"learner: {report['model']}, LoRA r={lora['r']} {','.join(lora['target_modules'])}, {report['dtype']}, "
        f"1 worker; {ln['samples']} samples, {ln['tokens_per_step']} tokens/step "
        f"({ln['generated_tokens_per_step']} generated); {ln['warmup_steps']} warm-up step(s) left out"
    )
    for col in ("LM head", "steps", "step s (median)", "tokens/s", "generated tokens/s", "steps s"):
        table.add_column(col, justify="right")
    paths = (
        ("trained positions, prompt once per group", "learner"),
        ("trained positions, each episode whole (old)", "learner_unshared"),
        ("the same, the padding mask passed to attention (old)", "learner_pad_mask"),
        ("every position (old)", "learner_all_logits"),
    )
    for label, key in paths:
        r = report[key]
        table.add_row(
            label, str(r["steps"]), f"{r['step_s_median']:.1f}", f"{r['tokens_per_s']:.0f}",
            f"{r['generated_tokens_per_s']:.0f}", " ".join(f"{s:.1f}" for s in r["step_s"]),
        )  # fmt: skip
    console.print(table)
    console.print(
        f"LM head only at trained positions and a group's prompt once: {report['learner_selective_speedup']:.2f}x "
        f"the LM head everywhere; the prompt once alone: {report['learner_shared_speedup']:.2f}x; episodes whole "
        f"without the padding mask: {report['learner_causal_speedup']:.2f}x with it"
    )
    long, always = report["learner_long"], report["learner_long_always"]
    console.print(
        f"long-response batch ({long['tokens_per_step']} tokens, {long['generated_tokens_per_step']} in responses): "
        f"{long['step_s_median']:.1f} s a step, each group shared only where it pays; "
        f"{always['step_s_median']:.1f} s with every group in one row: {report['learner_long_speedup']:.2f}x"
    )

    groups = [(name, report[name]) for name in ("hf", "vllm") if "lora" in report.get(name, {})]
    table = Table(title="LoRA push to every engine, medians (ms); a = object store, b = save to disk then load")
    cols = (
        "engines",
        "path",
        "learner side",
        "rpc",
        "fetch / read",
        "load",
        "push (all confirm)",
        "total",
        "per engine",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("engines", "path") else "right")
    for name, g in groups:
        a, b = g["lora"]["object_store"], g["lora"]["disk"]
        who = f"{g['lora']['engines']} {name}"
        table.add_row(
            who, "a object store", f"{a['export_ms']:.1f}", f"{a['rpc_ms']:.1f}",
            f"{a['fetch_ms']:.1f}", f"{a['load_ms']:.1f}", f"{a['push_ms']:.1f}", f"{a['total_ms']:.1f}",
            " ".join(f"{x:.1f}" for x in a["per_engine_ms"]),
        )  # fmt: skip
        table.add_row(
            who, "b disk", f"{b['save_ms']:.1f}", "-", f"{b['read_rpc_ms']:.1f}",
            f"{b['load_ms']:.1f}", f"{b['push_ms']:.1f}", f"{b['total_ms']:.1f}",
            " ".join(f"{x:.1f}" for x in b["per_engine_ms"]),
        )  # fmt: skip
    console.print(table)
    for name, g in groups:
        lo = g["lora"]
        console.print(
            f"{name}: adapter {lo['adapter_mb']:.1f} MB, {lo['pushes']} pushes per path; disk / object store: "
            f"{lo['ratio']:.2f}x end to end, {lo['engine_side_ratio']:.2f}x engine side "
            f"(goal >= {GOAL_RATIO:.0f}x: {'met' if lo['goal_ratio_met'] else 'NOT met'}); push_adapter "
            f"{lo['object_store']['push_ms']:.1f} ms (goal < {GOAL_PUSH_MS:.0f} ms to every engine: "
            f"{'met' if lo['goal_30ms_met'] else 'NOT met'})"
        )
    console.print(
        "a = export_adapter_ref -> push_adapter; b = save_adapter -> each engine reads the folder and loads it. "
        "learner side = export (a) or save (b); rpc = a version() round trip; fetch = an engine resolving the "
        "ref, minus the rpc; read = per-engine time minus load (the folder read and the rpc); load = the "
        "engine's own load_adapter time (slowest engine), as each path measured it"
    )

    table = Table(title="full-weight sync (finetune.mode=full): export_weights_refs -> push_weights, medians")
    for col in ("engines", "chunks", "MB", "export s", "push s", "total s", "all s"):
        table.add_column(col, justify="left" if col == "engines" else "right")
    for name, g in [(n, report[n]) for n in ("hf", "vllm") if "weights" in report.get(n, {})]:
        w = g["weights"]
        table.add_row(
            f"{w['engines']} {name}", str(w["chunks"]), f"{w['mb']:.0f}", f"{w['export_s']:.2f}", f"{w['push_s']:.2f}",
            f"{w['total_s']:.2f}", " ".join(f"{s:.2f}" for s in w["total_all_s"]),
        )  # fmt: skip
    console.print(table)
    if "skipped" in report.get("vllm", {}):
        console.print(f"vLLM: skipped ({report['vllm']['skipped']})")
    for name in ("hf", "vllm"):
        if "start_s" in report.get(name, {}):
            console.print(f"{name} rollout group start: {report[name]['start_s']:.1f} s")
    console.print(f"suite wall time: {report['wall_s']:.0f} s")


def tokens_per_s(learner: dict[str, Any]) -> Any:
    """A `bench_learner` result's tokens/s over its timed steps, as the results table takes it."""
    return spread([learner["tokens_per_step"] / s for s in learner["step_s"]])


def run(opts: BenchOptions, console: Any) -> SuiteResult:
    sizes = opts.train.model_copy(update=QUICK) if opts.quick else opts.train
    report = run_train_suite(sizes, console)
    ln, old, whole = report["learner"], report["learner_all_logits"], report["learner_unshared"]
    masked, long, always = report["learner_pad_mask"], report["learner_long"], report["learner_long_always"]
    size = f"{report['model']}, {ln['samples']} samples in groups of {sizes.group_size}, LoRA"
    rows = [
        Row(f"learner tokens/s ({size})", "tokens/s",
            tokens_per_s(ln), tokens_per_s(old),
            "LM head at every position, each episode whole (ours: trained positions, prompt once per group)"),
        Row(f"learner tokens/s, a group's prompt once ({size})", "tokens/s",
            tokens_per_s(ln), tokens_per_s(whole),
            "each episode whole (both: LM head at trained positions)"),
        Row(f"learner tokens/s, episodes whole without the padding mask ({size})", "tokens/s",
            tokens_per_s(whole), tokens_per_s(masked),
            "the padding mask passed to attention (both: each episode whole)"),
        Row(f"learner tokens/s, long responses ({size})", "tokens/s",
            tokens_per_s(long), tokens_per_s(always),
            "every group's prompt shared (ours: shared only where it pays)"),
    ]  # fmt: skip
    for name in ("hf", "vllm"):
        g = report.get(name, {})
        if "lora" in g:
            a, b = g["lora"]["object_store"], g["lora"]["disk"]
            rows.append(
                Row(f"LoRA push to {g['lora']['engines']} {name} engine(s), end to end", "ms",
                    spread(a["total_all_ms"]), spread(b["total_all_ms"]), "save to disk, engines read it "
                    "(ours: object store)", "lower", f">= {GOAL_RATIO:.0f}x; push_adapter < {GOAL_PUSH_MS:.0f} ms")
            )  # fmt: skip
        if "weights" in g:
            w = g["weights"]
            rows.append(
                Row(f"full-weight sync to {w['engines']} {name} engine(s), {w['mb']:.0f} MB", "s",
                    spread(w["total_all_s"]), better="lower")
            )  # fmt: skip
    return SuiteResult("train", report, rows)
