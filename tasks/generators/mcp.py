"""The `mcp` generator: tasks for exactly the tools of chosen MCP servers, built-in or external.

It lists the tools of `opts.servers` (() = every server in the pool) through the in-process pool —
built from `cfg.tools` when the caller gives none, or one without a wanted server — so an external
server named under `tools.external` (stdio command or URL) is introspected like a built-in. External
tools are listed as `server.tool`; tasks name them as (server, tool), the way the pool calls them.

The model is then asked exactly as in the `llm` generator (one request per sample, same schema,
same checks, same report), with two differences: only these servers' tools are offered (the schema's
enums hold no other tool, and an answer naming another is skipped), and the focus tool that opens each
task takes the tools in turn, so every tool of a server gets tasks.
"""

from __future__ import annotations

from typing import Any

from configs.schema import Config
from tasks.generators.llm import GenerationReport, log_report, propose_tasks
from tasks.generators.options import GenerateOptions


async def generate_with_report(
    cfg: Config, opts: GenerateOptions, pool: Any
) -> tuple[list[dict[str, Any]], GenerationReport]:
    """`generate`, with the report of what was skipped and the tokens spent."""
    return await propose_tasks(cfg, opts, pool, method="mcp", servers=opts.servers, focus="round_robin")


async def generate(cfg: Config, opts: GenerateOptions, pool: Any) -> list[dict[str, Any]]:
    """Up to `opts.n` candidate rows for the tools of `opts.servers` (() = all servers in the pool)."""
    rows, report = await generate_with_report(cfg, opts, pool)
    log_report(report)
    return rows
