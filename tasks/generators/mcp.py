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

from tasks.generators.llm import ModelGenerator

# The focus tool takes the tools of `opts.servers` in turn, so every tool of a server gets tasks.
MCP = ModelGenerator("mcp", lambda opts: opts.servers, "round_robin")
generate_with_report = MCP.generate_with_report
generate = MCP.generate
