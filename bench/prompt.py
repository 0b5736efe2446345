"""Suite `prompt`: first-prompt tokens of the config's tasks with its model's tokenizer, the system tool
block as JSON lines vs compact signatures (`env.tool_format`). The tasks are made in-process by the rule
generator from the config's `generation` section (its servers offline), no Ray; each task is shown the
tools of the servers it uses, as an episode is (`envs.prompting.count_prompt_tokens`). Token counts are
exact: one measurement, no repeats.

    python -m bench --suite prompt [--config configs/demo-cpu.yaml]   (the demo's config unless --config)
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.options import BenchOptions
from bench.results import Row, SuiteResult, spread
from configs.loader import CONFIG_DIR
from configs.schema import Config

DEMO_CONFIG = str(CONFIG_DIR / "demo-cpu.yaml")
TOOL_FORMATS = ("json", "compact")


async def prompt_tasks(cfg: Config) -> tuple[list[Any], dict[str, list[dict[str, Any]]]]:
    """The config's rule tasks (as TaskRows) and the tool listing of its servers, all offline."""
    from serve_apps.tool_pool import LocalToolPool
    from tasks.generators import get_generator
    from tasks.generators.options import GenerateOptions
    from tasks.schema import TaskRow

    pool = await LocalToolPool.create(cfg.tools.offline())
    try:
        listing = await pool.list_tools()
        rows = await get_generator("rule")(cfg, GenerateOptions.from_config(cfg, splits={}), pool)
    finally:
        await pool.close()
    return [TaskRow.model_validate(r) for r in rows], listing


def run(opts: BenchOptions, console: Console) -> SuiteResult:
    from actors.models import load_tokenizer
    from envs.prompting import count_prompt_tokens, tool_prompt_for

    cfg = opts.model_copy(update={"config": opts.config or DEMO_CONFIG}).mcprl_config()
    with console.status(f"prompt: {cfg.generation.n_samples} rule tasks, {cfg.model.name}'s tokenizer"):
        rows, listing = asyncio.run(prompt_tasks(cfg))
        tokenizer = load_tokenizer(cfg.model)
        tokens = {
            fmt: [count_prompt_tokens(tokenizer, row, listing, cfg.env.final_answer, fmt) for row in rows]
            for fmt in TOOL_FORMATS
        }
    report: dict[str, Any] = {"model": cfg.model.name, "tasks": len(rows), "tool_prompt": tool_prompt_for(tokenizer)}
    for fmt, n in tokens.items():
        report[fmt] = {"mean": statistics.mean(n), "max": max(n), "min": min(n)} if n else {}
    if rows:
        report["compact_vs_json_mean"] = report["compact"]["mean"] / report["json"]["mean"]
    show(report, console)
    table = []
    if rows:
        table.append(
            Row("first-prompt tokens, mean over tasks", "tokens", spread(report["compact"]["mean"]),
                spread(report["json"]["mean"]), "env.tool_format: json (ours: compact)", "lower")
        )  # fmt: skip
    return SuiteResult("prompt", report, table)


def show(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"first-prompt tokens, {report['tasks']} rule tasks, {report['model']}'s tokenizer")
    for col in ("env.tool_format", "mean", "max", "min"):
        table.add_column(col, justify="right" if col != "env.tool_format" else "left")
    for fmt in TOOL_FORMATS:
        if report[fmt]:
            r = report[fmt]
            table.add_row(fmt, f"{r['mean']:.1f}", str(r["max"]), str(r["min"]))
    console.print(table)
    if report["tool_prompt"] == "template":
        console.print("this model's chat template renders tools=: tool_format does not apply to its prompts")
    elif "compact_vs_json_mean" in report:
        console.print(f"compact / json, mean: {report['compact_vs_json_mean']:.2f}")
