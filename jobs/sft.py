"""Supervised warm start: a LoRA adapter trained on expert trajectories of the tasks, before GRPO.

    python -m jobs.sft --config FILE [--set k=v ...] [--tasks FILE] [--out DIR]

Tasks: `--tasks`, else `data.train`. The adapter (PEFT format) goes to `--out`, else
`<train.storage>/<run_name>/sft` (a folder or a storage URI); GRPO continues from it with
`finetune.init_adapter=<that folder>`.

What it does (`run_sft`):
1. Expert trajectories (`actors.expert`): each row's `tool_sequence` played by the EpisodeRunner with
   the scripted expert engine, through MCPToolEnv against the tool client registered in this
   process, or else an in-process `LocalToolPool` of the configured servers with every built-in one
   on its offline backend (no paid API is called for a warm start).
   Rows whose expert play fails are skipped and counted.
2. `sft_warmup.steps` steps of `sft_warmup.batch_size` trajectories, drawn from the trajectories in a
   seeded (`train.seed`) shuffled order, reshuffled after every pass. Each step is one
   `Learner.sft_step`: the mean negative log-likelihood of the loss-masked tokens (the expert's
   text and its end-of-turn; prompts and tool results are context only),
       L = -(1/|M|) Σ_{t∈M} log π(y_t | y_<t)
   at learning rate `sft_warmup.lr`, constant, no warmup (the rest of `learner.optim` as configured).
3. `Learner.save_adapter(out_dir)`, and `sft_summary.json` beside it.

Exit status: 0 trained; 2 bad input (config, missing task file, rows without tool_sequence, no row
playable, finetune.mode neither lora nor qlora).
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

from cluster import storage
from configs.schema import Config
from jobs.cli import base_parser, setup, usage_error
from tasks.io import FORMATS, TaskFileError, read_rows

log = logging.getLogger(__name__)

SUMMARY_FILE = "sft_summary.json"


class SftInputError(ValueError):
    """The warm start cannot run on this input (the message says what to fix)."""


def sft_config(cfg: Config) -> Config:
    """A copy of `cfg` whose learner optimiser runs the warm start: lr = sft_warmup.lr, constant, no warmup."""
    out = cfg.model_copy(deep=True)
    out.learner.optim.lr = cfg.sft_warmup.lr
    out.learner.optim.warmup_steps = 0
    out.learner.optim.schedule = "constant"
    return out


def batch_order(n: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Indices into n items for each step: a seeded shuffle, reshuffled after each full pass."""
    if n < 1:
        raise ValueError("no items to draw batches from")
    rng = random.Random(seed)
    pool: list[int] = []
    out = []
    for _ in range(steps):
        batch = []
        while len(batch) < batch_size:
            if not pool:
                pool = list(range(n))
                rng.shuffle(pool)
            batch.append(pool.pop())
        out.append(batch)
    return out


def build_expert_trajectories(cfg: Config, rows: list[dict], tokenizer: Any) -> tuple[list[Any], dict[str, Any]]:
    """Expert trajectories and their stats, played against an offline LocalToolPool of the configured servers."""
    from actors.expert import expert_trajectories
    from envs.mcp_tool_env import run_sync
    from serve_apps.tool_pool import LocalToolPool

    stats: dict[str, Any] = {}
    pool = run_sync(LocalToolPool.create(cfg.tools.offline()))
    try:
        trajs = run_sync(expert_trajectories(cfg, rows, tokenizer, pool, stats=stats))
    finally:
        run_sync(pool.close())
    return trajs, stats


def warm_start_samples(cfg: Config, rows: list[dict]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The warm start's learner samples (`Trajectory.to_sample` of each playable row's expert trajectory,
    in row order) and the expert play's stats (see `actors.expert.expert_trajectories`). Used by `run_sft`
    and by the GRPO driver's warm start (jobs/train.py). Raises SftInputError for input it cannot train on."""
    from actors.expert import check_rows
    from actors.models import load_tokenizer

    if not cfg.finetune.trains_adapter:
        raise SftInputError(f"the warm start trains a LoRA adapter; finetune.mode is {cfg.finetune.mode!r}")
    try:
        check_rows(rows)
    except ValueError as e:
        raise SftInputError(str(e)) from e
    if not rows:
        raise SftInputError("no task rows to build expert trajectories from")
    tokenizer = load_tokenizer(cfg.model)
    trajs, stats = build_expert_trajectories(cfg, rows, tokenizer)
    if not trajs:
        reasons = "; ".join(f"{k}: {v}" for k, v in list(stats["skipped_tasks"].items())[:3])
        raise SftInputError(f"no expert trajectory could be played ({len(rows)} rows, all skipped): {reasons}")
    for t in trajs:
        t.check(cfg.rollout.max_total_tokens)
    return [t.to_sample() for t in trajs], stats


def run_sft(cfg: Config, rows: list[dict], out_dir: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Warm-start LoRA on the rows' expert trajectories; the adapter is saved to `out_dir` (PEFT format).

    Returns {"adapter": out_dir, "losses": [sft_loss per step], "steps", "trajectories" (played),
    "skipped" (rows whose expert play failed), "tokens_per_s" (prompt+response tokens through the
    learner per second of sft_step), plus "truncated" and "skipped_tasks" {task_id: reason}}.
    Raises SftInputError for input it cannot train on.
    """
    out_dir = Path(out_dir)
    samples, stats = warm_start_samples(cfg, rows)

    from actors.learner import Learner  # lazy: torch and the model only once the data is known to be good

    steps, batch_size = cfg.sft_warmup.steps, cfg.sft_warmup.batch_size
    learner = Learner(sft_config(cfg), rank=0, world_size=1)
    learner.setup()
    losses: list[float] = []
    tokens = 0
    train_s = 0.0
    bar = _progress(steps, progress)
    try:
        for batch in batch_order(len(samples), batch_size, steps, cfg.train.seed):
            chosen = [samples[i] for i in batch]
            t0 = time.perf_counter()
            out = learner.sft_step(chosen)
            train_s += time.perf_counter() - t0
            tokens += sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in chosen)
            losses.append(float(out["sft_loss"]))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / max(train_s, 1e-9):.0f}")
            bar.update(1)
    finally:
        bar.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    learner.save_adapter(str(out_dir))
    result = {
        "adapter": str(out_dir),
        "losses": losses,
        "steps": steps,
        "trajectories": len(samples),
        "skipped": stats["skipped"],
        "tokens_per_s": tokens / train_s if train_s else 0.0,
        "truncated": stats["truncated"],
        "skipped_tasks": stats["skipped_tasks"],
    }
    (out_dir / SUMMARY_FILE).write_text(json.dumps(result, indent=2) + "\n")
    line = (
        f"sft: {steps} steps × {batch_size} of {len(samples)} expert trajectories "
        f"({stats['skipped']} rows skipped, {stats['truncated']} cut at the token budget); "
        f"loss {losses[0]:.3f} → {losses[-1]:.3f}; {result['tokens_per_s']:.0f} tok/s; adapter → {out_dir}"
    )
    if progress:
        print(line)
    else:
        log.info(line)
    return result


def _progress(steps: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=steps, desc="sft", unit="step", disable=not enabled, file=sys.stderr, leave=False)


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tasks", metavar="FILE", help=f"task file ({', '.join(FORMATS)}); default data.train")
    parser.add_argument(
        "--out", metavar="DIR", help="adapter folder or storage URI; default <train.storage>/<run_name>/sft"
    )
    args = parser.parse_args(argv)
    cfg = setup(args)

    try:
        path = storage.node_path(args.tasks or cfg.data.train, "--tasks" if args.tasks else "data.train")
    except storage.StorageError as e:
        usage_error(str(e))
    if not path.is_file():
        what = "task file" if args.tasks else "task file (data.train; give --tasks FILE or --set data.train=FILE)"
        usage_error(f"{path}: no such {what}")
    try:
        rows = read_rows(path)
    except TaskFileError as e:
        usage_error(str(e))
    out = args.out or storage.join(storage.resolve(cfg.train.storage), cfg.run_name, "sft")
    try:
        with storage.staged(out) as local:
            run_sft(cfg, rows, local, progress=True)
    except SftInputError as e:
        usage_error(f"{path}: {e}")


if __name__ == "__main__":
    main()
