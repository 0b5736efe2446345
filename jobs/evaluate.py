"""Play tasks greedily with the base model or a trained adapter, and score them.

    python -m jobs.evaluate --config configs/X.yaml --tasks FILE [--adapter DIR] [--limit N] [--out FILE.json]

Shows a progress bar over the tasks (on a terminal), then prints the success rate, the mean reward, the
mean number of turns, each tool's error rate, a table per template (answer right and calls right: solved /
scored), and the worst failures (lowest reward first; `--failures N`, default 3), each with the expected
calls and answer beside the calls the model made and its last message. It writes them as JSON, with one
entry per task (`per_task`: task id, template and complexity of its row, reward, turns, success,
calls_right, infra_fault, the expected calls and answer, the calls made and the conversation after the
prompt) that jobs/stats.py pairs across stages, `per_template`, and `worst_failures` (worst first: the
expected calls and answer, the calls made, the last message); a training run's own evaluations keep the
figures only. The engines, runners and tool pool are the training run's own (`orchestration.rollout_group`),
so an evaluation plays exactly what training rollouts play. An adapter reaches the engines as a training run's
policy does (`rollout.weight_push`): on a vLLM engine on CPU merged into the base weights by a learner
(`start_and_push_merged`), elsewhere as a LoRA adapter.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from actors.adapter_io import read_adapter
from cluster import storage
from configs.schema import Config, SamplingConfig
from jobs.cli import INTERRUPTED_EXIT, base_parser, counted, interruptible, run_and_leave, setup, usage_error
from jobs.report import template_table
from jobs.stats import group_success
from jobs.train_services import Services, ToolsStart


def greedy(cfg: Config) -> SamplingConfig:
    """The rollout sampling made deterministic: what every evaluation plays."""
    return cfg.rollout.sampling.model_copy(update={"temperature": 0.0, "top_p": 1.0, "seed": None})


def tool_calls(trajs: list[Any]) -> dict[str, dict[str, float]]:
    """Per tool name: calls and the fraction that failed (any error kind)."""
    calls: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for t in trajs:
        for meta in t.env_metadata:
            for call in meta.get("calls", []):
                calls[call["name"]] += 1
                errors[call["name"]] += not call["ok"]
    return {name: {"calls": n, "error_rate": errors[name] / n} for name, n in sorted(calls.items())}


async def evaluate_rows(
    rollout: Any, rows: list[dict[str, Any]], sampling: SamplingConfig, detail: bool = False
) -> dict[str, Any]:
    """One greedy episode per task on the rollout group's engines; the figures the reports show. With
    `detail`, each task's entry also holds where a failure is: its calls as the env saw them, and the
    conversation after the prompt (kept out of a training run's checkpoints, which carry its evaluations)."""
    from actors.rollout_metrics import rollout_metrics

    trajs = await rollout.run(rows, 1, sampling=sampling)
    m = rollout_metrics(trajs)
    per_task = [
        {
            "task_id": t.task_id,
            "template": _template(row := _row(rows, t.group_id)),
            "complexity": _complexity(row),
            "reward": t.reward,
            "turns": t.turns,
            "success": bool(t.tool_stats.get("task_complete")),  # the final answer is right
            "calls_right": bool(t.tool_stats.get("calls_right")),  # every expected call ran
            "infra_fault": bool(t.infra_fault),
            **(_detail(t, row) if detail else {}),
        }
        for t in trajs
    ]
    return {
        "tasks": len(rows),
        "success_rate": float(m.get("success_rate", 0.0)),
        "calls_right_rate": float(m.get("calls_right_rate", 0.0)),
        "mean_reward": float(m.get("episode_reward", 0.0)),
        "turns": float(m.get("episode_len", 0.0)),
        "tool_success_rate": float(m.get("tool_success_rate", 0.0)),
        "parse_failure_rate": float(m.get("parse_failure_rate", 0.0)),
        "infra_faults": int(m.get("infra_faults", 0)),
        "episodes": len(trajs),
        "tool_calls": (calls := tool_calls(trajs)),
        "tool_error_rates": {name: c["error_rate"] for name, c in calls.items()},
        "per_task": per_task,
    }


def _detail(t: Any, row: dict[str, Any]) -> dict[str, Any]:
    calls = [c for meta in t.env_metadata for c in meta.get("calls", [])]
    gt = (row.get("reward_spec") or {}).get("ground_truth") or {}
    return {
        # What the task expects beside what the model did, so a failure is read without the task file.
        "expected_calls": [f"{s['server']}.{s['tool']}" for s in gt.get("tool_sequence", [])],
        "expected_answer": (gt.get("final_answer") or {}).get("value"),
        "calls": [{k: c.get(k) for k in ("name", "arguments", "ok", "error_kind")} for c in calls],
        "conversation": t.messages[len(row.get("prompt") or []) :],
    }


def _row(rows: list[dict[str, Any]], index: int) -> dict[str, Any]:
    return rows[index] if 0 <= index < len(rows) else {}


def _template(row: dict[str, Any]) -> str | None:
    """The rule generator's template of a task row (`extra_info.template`), or None."""
    extra = row.get("extra_info")
    return str(extra["template"]) if isinstance(extra, dict) and extra.get("template") else None


def _complexity(row: dict[str, Any]) -> str | None:
    gt = (row.get("reward_spec") or {}).get("ground_truth")
    return str(gt["complexity"]) if isinstance(gt, dict) and gt.get("complexity") else None


def per_template(per_task: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """`per_task` as the columns of the per-template table: the answer right (`success`), and every expected
    call made (`calls_right`, put in `success`, the outcome jobs/stats.group_success counts)."""
    return {
        "answer right": per_task,
        "calls right": [{**e, "success": e.get("calls_right")} for e in per_task],
    }


def worst_failures(per_task: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The `n` failed tasks (answer wrong, not spoiled by the infrastructure) with the lowest reward."""
    failed = [e for e in per_task if not e.get("success") and not e.get("infra_fault")]
    return sorted(failed, key=lambda e: (e.get("reward", 0.0), e.get("calls_right", False)))[:n]


def failure(entry: dict[str, Any]) -> dict[str, Any]:
    """A failed task's `per_task` entry as `worst_failures` holds it: what the task expected beside what the
    model did (its calls, and its last message, where a final answer would be)."""
    said = next((m.get("content") for m in reversed(entry.get("conversation", [])) if m.get("role") == "assistant"), "")
    return {
        **{k: entry.get(k) for k in ("task_id", "template", "reward", "turns", "calls_right")},
        "expected_calls": entry.get("expected_calls", []),
        "expected_answer": entry.get("expected_answer"),
        "calls": [{k: c.get(k) for k in ("name", "ok", "error_kind")} for c in entry.get("calls", [])],
        "last_message": " ".join(str(said or "").split()),
    }


def failure_lines(f: dict[str, Any]) -> list[str]:
    """A `failure` for the console: expected beside done, one line each."""
    calls = ", ".join(f"{c['name']} {'ok' if c['ok'] else c['error_kind'] or 'error'}" for c in f["calls"])
    said = f["last_message"]
    return [
        f"  {f['task_id']} [{f['template'] or '-'}]: reward {f['reward']:.3f}, {f['turns']} turn(s)",
        f"    expected: {', '.join(f['expected_calls']) or '(no calls)'}; answer {f['expected_answer']!r}",
        f"    model:    {calls or '(no calls)'}; last message {said[:160]!r}{'...' if len(said) > 160 else ''}",
    ]


async def _with_progress(rollout: Any, playing: Any, total: int) -> Any:
    """Await `playing` with a progress bar of finished episodes on stderr when it is a terminal."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="evaluate", unit="task", file=sys.stderr, disable=not sys.stderr.isatty())
    task = asyncio.ensure_future(playing)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=1.0)
            if not bar.disable and not task.done():
                bar.update((await rollout.stats())["done"] - bar.n)
        bar.update(total - bar.n)
        return task.result()
    finally:
        task.cancel()  # interrupted (Ctrl-C): the play ends with us, its failure unreported
        bar.close()


async def start_and_push_merged(cfg: Config, rollout: Any, starting: ToolsStart) -> None:
    """The CPU engine's fast path: the adapter (`finetune.init_adapter`) merged into the base weights by a
    learner, as a training run pushes its policy (`rollout.weight_push` merged), so the engine generates through
    plain weights, ~9x faster on CPU than through LoRA, and plays what the run's own evaluations played. The
    learner starts beside the rollout group once Serve holds its port (`ToolsStart`), and lives until its weights
    are on the engines (it owns them)."""
    import time

    from orchestration.learner_group import LearnerGroup
    from orchestration.startup import start_groups

    learner = LearnerGroup(cfg)

    async def start_learner() -> None:
        await asyncio.shield(starting.serving)
        await learner.start()

    try:
        await start_groups(cfg, lambda: rollout.start(starting.tools()), start_learner)
        t0 = time.perf_counter()
        await rollout.push_weights(1, await learner.export_weights_refs())
    finally:
        await learner.shutdown()
    print(f"adapter merged into the base weights on the engines ({time.perf_counter() - t0:.1f} s)", flush=True)


async def run(cfg: Any, rows: list[dict[str, Any]], adapter: str | None) -> dict[str, Any]:
    """Start the tool pool and the rollout group as a training run does (the engines beside the pool's
    deployment, `ToolsStart`), put the adapter on the engines, play `rows`, and stop everything."""
    import ray

    from actors.engine_api import weight_push
    from orchestration.rollout_group import RolloutGroup

    up = Services()
    try:
        starting = ToolsStart(cfg, up, judge=False)  # the runners build the config's judge themselves
        up.rollout = rollout = RolloutGroup(cfg, None)
        if adapter and weight_push(cfg) == "merged":
            await start_and_push_merged(cfg, rollout, starting)
        else:
            await rollout.start(starting.tools())
            if adapter:
                await rollout.push_adapter(1, ray.put(read_adapter(adapter)))
        return await _with_progress(rollout, evaluate_rows(rollout, rows, greedy(cfg), detail=True), len(rows))
    finally:
        await up.close()


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tasks", required=True, help="task file (.jsonl, .json, .parquet)")
    p.add_argument(
        "--adapter", help="a LoRA adapter (PEFT format): a folder or a storage URI, e.g. <run>/final_adapter"
    )
    p.add_argument("--limit", type=int, help="play only the first N tasks")
    p.add_argument("--out", help="write the results here as JSON (default: <tasks stem>.eval.json beside the tasks)")
    p.add_argument("--failures", type=int, default=3, metavar="N", help="show the N worst failures (default 3)")
    args = p.parse_args(argv)
    cfg = setup(args)
    if args.adapter:
        try:
            read_adapter(args.adapter)
        except FileNotFoundError as e:
            usage_error(str(e))
        cfg.finetune.mode = "lora"
        # rollout.weight_push as the config has it (auto: merged for vLLM on CPU, else the folder is loaded as
        # it is, as a LoRA adapter); the learner that merges it starts from the folder.
        cfg.finetune.init_adapter = args.adapter
    from tasks.dataset import DataError, load_tasks
    from tasks.inventory import load_inventory

    try:
        args.tasks = str(storage.node_path(args.tasks, "--tasks"))
        out = storage.node_path(args.out, "--out") if args.out else Path(args.tasks).with_suffix(".eval.json")
        rows = load_tasks(args.tasks, asyncio.run(load_inventory(cfg.tools)), "--tasks")
    except (DataError, storage.StorageError) as e:
        usage_error(str(e))
    rows = rows[: args.limit] if args.limit else rows
    from cluster.ray_env import ray_session

    interruptible()
    with ray_session(cfg.cluster):
        try:
            result = asyncio.run(run(cfg, rows, args.adapter))
        except KeyboardInterrupt:
            print("interrupted: nothing was written", file=sys.stderr)
            sys.exit(INTERRUPTED_EXIT)
    print(
        f"{counted(len(rows), 'task')}, {'adapter ' + args.adapter if args.adapter else 'base model ' + cfg.model.name}"
    )
    print(f"  success rate  {result['success_rate']:.1%}  (final answer right)")
    print(f"  calls right   {result['calls_right_rate']:.1%}  (every expected call ran)")
    print(f"  mean reward   {result['mean_reward']:.3f}")
    print(f"  mean turns    {result['turns']:.2f}")
    print(f"  parse failures per turn {result['parse_failure_rate']:.2f}; infra faults {result['infra_faults']}")
    for name, s in result["tool_calls"].items():
        print(f"  {name:40s} {s['calls']:4d} calls, {s['error_rate']:.0%} errors")
    columns = per_template(result["per_task"])
    print("per template (solved / scored):", *template_table(columns), sep="\n")
    result["per_template"] = [
        {
            "template": r.group,
            "complexity": r.complexity,
            "tasks": r.tasks,
            "scored": r.scored.get("answer right", 0),
            "success": r.successes.get("answer right", 0),
            "calls_right": r.successes.get("calls right", 0),
        }
        for r in group_success(columns)
    ]
    worst = worst_failures(result["per_task"], args.failures)
    result["worst_failures"] = [failure(e) for e in worst]
    failed = sum(not e["success"] and not e["infra_fault"] for e in result["per_task"])
    if worst:
        print(f"worst failures ({len(worst)} of {counted(failed, 'failed task')}, lowest reward first):")
        for f in result["worst_failures"]:
            print(*failure_lines(f), sep="\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"results: {out}")
    sys.exit(0)


if __name__ == "__main__":
    run_and_leave(main)
