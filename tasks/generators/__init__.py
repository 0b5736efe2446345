"""Task generators: each turns the config and the resolved options into candidate task rows.

Every generator has one signature, `async def generate(cfg, opts, pool) -> list[dict]`: candidate rows
(TaskRow dicts) before admission; `python -m jobs.generate_tasks` sends them through the gate.

- rule: templates over the built-in tools; answers computed by running the calls offline.
- dependent: converts multi-turn conversation specs (OpenAI chat format) into rows.
- llm: an OpenAI-compatible model writes tasks for the tool inventory.
- mcp: tasks for any MCP server, from its listed tools.

Modules are imported only when their method is asked for, so a missing optional one (or its
dependencies) fails that method alone, with a clear message.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import Any

from configs.schema import Config
from tasks.generators.options import GenerateOptions

Generate = Callable[[Config, GenerateOptions, Any], Awaitable[list[dict[str, Any]]]]

METHODS = ("rule", "dependent", "llm", "mcp")


class GeneratorUnavailable(RuntimeError):
    """A method whose module cannot be imported."""


def _lazy(method: str) -> Generate:
    async def generate(cfg: Config, opts: GenerateOptions, pool: Any) -> list[dict[str, Any]]:
        return await get_generator(method)(cfg, opts, pool)

    generate.__name__ = f"generate_{method}"
    generate.__doc__ = f"The `{method}` generator (tasks/generators/{method}.py), imported on first use."
    return generate


# The registry: method name -> generate function (each resolves its module on first call).
GENERATORS: dict[str, Generate] = {m: _lazy(m) for m in METHODS}


def get_generator(method: str) -> Generate:
    """The real `generate` of a method; raises GeneratorUnavailable when it cannot be imported."""
    if method not in METHODS:
        raise GeneratorUnavailable(f"unknown method {method!r}; methods: {', '.join(METHODS)}")
    try:
        module = importlib.import_module(f"tasks.generators.{method}")
    except ImportError as e:
        raise GeneratorUnavailable(f"method {method} is not available: {e}") from e
    fn = getattr(module, "generate", None)
    if fn is None:
        raise GeneratorUnavailable(f"method {method} is not available: tasks.generators.{method} has no generate()")
    return fn


__all__ = ["GENERATORS", "METHODS", "GenerateOptions", "GeneratorUnavailable", "get_generator"]
