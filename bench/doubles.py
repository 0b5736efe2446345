"""Stand-ins the benchmarks share with the tests: tool clients with set latencies, engines that answer
with a task's expert actions (actors.expert.ExpertEngine, the tests' ScriptedEngine's base), and the
rule tasks they play."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any


class InstantResult:
    """A canned ok result, the size of a real previous_close answer."""

    ok = True
    text = '{"ticker":"NVDA","status":"OK","results":[{"T":"NVDA","o":183.1,"c":186.52,"v":171234567}]}'
    structured = None
    error_kind = None
    error = None
    latency_ms = 0.0
    infra_fault = False


class InstantClient:
    """A ToolClient that answers at once: what is left of a step is the env's own work."""

    result = InstantResult()

    async def call_tool(
        self, server: str, tool: str, arguments: dict[str, Any] | None = None, *, episode_id: str | None = None
    ) -> InstantResult:
        return self.result

    async def end_episode(self, episode_id: str) -> None:
        return None

    async def list_tools(self) -> dict[str, list[dict[str, Any]]]:
        schema = {"type": "object", "properties": {"ticker": {"type": "string"}}, "required": ["ticker"]}
        return {"polygon": [{"name": "previous_close", "description": "Previous day bar.", "inputSchema": schema}]}


class LatentClient:
    """A ToolClient that delays each call by a seeded uniform latency, then asks the real pool."""

    def __init__(self, pool: Any, low_s: float, high_s: float, seed: int = 0) -> None:
        import random

        self.pool, self.low_s, self.high_s = pool, low_s, high_s
        self.rng = random.Random(seed)

    async def call_tool(
        self, server: str, tool: str, arguments: dict[str, Any] | None = None, *, episode_id: str | None = None
    ) -> Any:
        await asyncio.sleep(self.rng.uniform(self.low_s, self.high_s))
        return await self.pool.call_tool(server, tool, arguments, episode_id=episode_id)

    async def end_episode(self, episode_id: str) -> None:
        await self.pool.end_episode(episode_id)

    async def list_tools(self) -> dict[str, list[dict[str, Any]]]:
        return await self.pool.list_tools()


def expert_engine(tokenizer: Any, rows: list[dict[str, Any]], gen_s: float) -> Any:
    """A RolloutEngine stand-in: turn k of a task's episode gets the task's k-th expert action, as a
    sampling engine with the stop strings returns it, after `gen_s` seconds."""
    from actors.expert import ExpertEngine

    return ExpertEngine(tokenizer, rows, closes_turns=False, delay_s=gen_s, logprob=-1.0)


class RealCostExpertEngine:
    """Real generation cost, expert answers: each turn first runs a real engine on the real conversation
    for a variable number of new tokens (uniform in `lengths`, seeded by the prompt, so both modes ask
    the same), then answers with the expert action as `expert_engine` does. The episodes (and so the
    tool calls) are the scripted ones; what the engine costs, its batching included, is real."""

    def __init__(self, engine: Any, tokenizer: Any, rows: list[dict[str, Any]], lengths: tuple[int, int]) -> None:
        self.expert = expert_engine(tokenizer, rows, 0.0)
        self.engine, self.lengths = engine, lengths
        self.real_tokens = 0

    async def generate(self, prompt_token_ids: list[int], sampling: Any) -> Any:
        import zlib

        key = zlib.crc32(bytes(str(prompt_token_ids), "ascii"))
        lo, hi = self.lengths
        n = min(lo + key % (hi - lo + 1), sampling.max_new_tokens)
        knobs = {"max_new_tokens": n, "stop": [], "temperature": 1.0, "seed": key}
        real = await self.engine.generate(prompt_token_ids, sampling.model_copy(update=knobs))
        self.real_tokens += len(real.token_ids)
        return await self.expert.generate(prompt_token_ids, sampling)

    def version(self) -> int:
        return self.expert.version()

    def stats(self) -> dict[str, Any]:
        return {}


def rule_rows(n: int) -> list[dict[str, Any]]:
    import subprocess
    import sys
    import tempfile

    from tasks.io import read_rows

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rule.jsonl"
        cmd = [sys.executable, "-m", "jobs.generate_tasks", "--method", "rule", "--n", str(n), "--seed", "0"]
        subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True, timeout=600)
        return read_rows(out)
