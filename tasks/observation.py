"""How a tool's result reads to the model: one rendering for the env that shows it and the rule
generator that checks its experts only read what the model would be shown (a value past the cut
teaches the model to make it up).
"""

from __future__ import annotations

from typing import Any


def result_text(name: str, result: Any) -> str:
    """A call's result as the model reads it; `name` is "server.tool", `result` a pool `ToolResult`."""
    if bool(getattr(result, "ok", False)):
        return f"{name} returned:\n{getattr(result, 'text', '')}"
    kind = getattr(result, "error_kind", None) or "error"
    error = getattr(result, "error", None) or getattr(result, "text", "") or "no details"
    return f"{name} failed ({kind}): {error}"


def cut(content: str, limit: int) -> str:
    """`content` cut to `limit` characters (env.max_observation_chars), with a note saying so."""
    if len(content) <= limit:
        return content
    return f"{content[:limit]}\n[output cut: {limit:,} of {len(content):,} characters shown]"
