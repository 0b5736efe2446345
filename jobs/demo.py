"""The demo: serve the MCP tool pool on an embedded Ray, play one scripted multi-tool episode
against it through the MCP protocol (streamable HTTP, as any MCP client would), print every call
and result, and stop cleanly.

    python -m jobs.demo [--config configs/tools.yaml] [--set ...]

The tool pool alone, no model (`make demo-tools`): the "agent" is a script; each step uses what earlier steps
returned. The training demo is `make demo` (`python -m jobs.train --config configs/demo-cpu.yaml --run`).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from rich.console import Console
from rich.panel import Panel

from cluster.ray_env import ray_session
from jobs.cli import base_parser, setup
from jobs.serve_tools import print_pool

TICKER = "NVDA"


class Episode:
    """Calls tools over MCP/HTTP, one client session per server, and prints each turn."""

    def __init__(self, pool: Any, console: Console) -> None:
        self.pool = pool
        self.console = console
        self.clients: dict[str, Any] = {}
        self.turn = 0

    async def call(self, server: str, tool: str, args: dict[str, Any]) -> Any:
        from fastmcp import Client

        if server not in self.clients:
            self.clients[server] = await Client(self.pool.url(server)).__aenter__()
        self.turn += 1
        self.console.print(f"[bold cyan]turn {self.turn}[/] → {server}.{tool}({json.dumps(args)})")
        t = time.perf_counter()
        result = await self.clients[server].call_tool(tool, args, raise_on_error=False)
        ms = (time.perf_counter() - t) * 1e3
        text = result.content[0].text if result.content else ""
        style = "red" if result.is_error else "green"
        shown = text if len(text) < 600 else text[:600] + f" … ({len(text)} chars)"
        self.console.print(Panel(shown, title=f"{'error' if result.is_error else 'ok'} · {ms:.0f} ms", style=style))
        if result.is_error:
            raise RuntimeError(f"{server}.{tool} failed: {text}")
        return result.structured_content

    async def close(self) -> None:
        for client in self.clients.values():
            await client.__aexit__(None, None, None)


async def play(pool: Any, console: Console) -> None:
    console.rule(f"Task: brief #markets on {TICKER}: last close, valuation, the news, and the 5-day move")
    ep = Episode(pool, console)
    try:
        close = (await ep.call("polygon", "previous_close", {"ticker": TICKER}))["results"][0]
        profile = await ep.call("fmp", "company_profile", {"symbol": TICKER})
        ratios = (await ep.call("fmp", "key_ratios", {"symbol": TICKER, "limit": 1}))["ratios"][0]
        news = await ep.call("tavily", "search", {"query": f"{TICKER} earnings outlook", "max_results": 3})
        bars = await ep.call(
            "polygon", "daily_aggregates", {"ticker": TICKER, "from_date": "2026-11-13", "to_date": "2026-11-20"}
        )
        closes = [b["c"] for b in bars["results"]]
        program = (
            f"closes = {closes}\n"
            "change = (closes[-1] - closes[0]) / closes[0] * 100\n"
            "print(f'{change:+.2f}% over {len(closes)} sessions')\n"
        )
        move = (await ep.call("python", "run_python", {"code": program}))["stdout"].strip()
        headline = news["results"][0]["title"] if news["results"] else "no news"
        text = (
            f"{profile['companyName']} ({TICKER}) closed at {close['c']:.2f} on {close['date']}; "
            f"P/E {ratios['priceToEarningsRatio']:.1f}; {move}. Reading: {headline}"
        )
        await ep.call("slack", "post_message", {"channel": "markets", "text": text})
        history = await ep.call("slack", "read_history", {"channel": "markets", "limit": 1})
        assert history["messages"][0]["text"] == text, "the posted brief should be the newest message"
        console.print(f"[bold green]Episode done[/]: {ep.turn} tool calls over MCP; #markets now reads:\n  {text}")
    finally:
        await ep.close()


def main(argv: list[str] | None = None) -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args(argv)
    cfg = setup(args)
    console = Console()
    from serve_apps.tool_pool import deploy_pool, undeploy_pool

    with ray_session(cfg.cluster):
        with console.status("deploying the MCP tool pool on Ray Serve"):
            pool = deploy_pool(cfg.tools)
        try:
            print_pool(console, pool, asyncio.run(pool.list_tools()))
            asyncio.run(play(pool, console))
        finally:
            undeploy_pool(pool)
    console.print("pool stopped, Ray shut down")


if __name__ == "__main__":
    main()
