"""Deploy the MCP tool pool on Ray Serve, print its URLs and tools, and stay up until interrupted.

python -m jobs.serve_tools [--config configs/tools.yaml] [--set tools.http.port=8001]
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading

from rich.console import Console

from cluster.metrics import metrics_run
from cluster.ray_env import ray_session
from jobs.cli import INTERRUPTED_EXIT, base_parser, interruptible, setup, usage_error
from serve_apps.tool_pool import ServeToolPool, deploy_pool, server_specs, undeploy_apps, undeploy_pool


def print_pool(console: Console, pool: ServeToolPool, tools: dict[str, list[dict]]) -> None:
    """One line per server, never cut, so URLs can be copied whatever the terminal's width."""
    console.print("[bold]MCP tool pool[/] (streamable HTTP; handles: serve_apps.tool_pool.ServeToolPool)")
    for server, items in tools.items():
        console.print(f"  [cyan]{server}[/]  {pool.url(server)}  (or {pool.suffixed_url(server)})", soft_wrap=True)
        console.print(f"      {', '.join(t['name'] for t in items)}", soft_wrap=True)


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="deploy, print, and exit (a smoke check)")
    args = parser.parse_args(argv)
    cfg = setup(args)
    console = Console()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    interruptible()
    with ray_session(cfg.cluster):
        try:
            pool = deploy_pool(cfg.tools, metrics_run(cfg))
        except ValueError as e:
            usage_error(str(e))
        except KeyboardInterrupt:  # Ctrl-C while Serve is still bringing replicas up
            console.print("interrupted while deploying")
            undeploy_apps(s.name for s in server_specs(cfg.tools))
            sys.exit(INTERRUPTED_EXIT)
        try:
            print_pool(console, pool, asyncio.run(pool.list_tools()))
            if cfg.tools.http.bearer_token_env:
                console.print(f"HTTP clients must send 'Authorization: Bearer ${cfg.tools.http.bearer_token_env}'.")
            if not args.once:
                console.print("Serving; press Ctrl-C to stop.")
                while not stop.wait(1.0):
                    pass
        except KeyboardInterrupt:
            pass
        finally:
            undeploy_pool(pool)
    console.print("stopped")


if __name__ == "__main__":
    main()
