"""Run benchmark suites and write their results.

    python -m bench --suite tools|env|prompt|rollout|train|job|e2e|quality|scale|cplane|gpu|learning|chaos|all
                    [--repeats 3] [--out bench_results] [--config configs/demo-cpu.yaml] [--quick]
                    [--set SECTION.KEY=VALUE ...]

Each suite is a module of this package with `run(opts, console) -> SuiteResult`; its sizes are the
section of the same name in `bench/options.py` (e.g. `--set e2e.steps=8`). `all` runs them in turn.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time

from rich.console import Console

from bench.options import NOT_IN_ALL, SUITES, BenchOptions
from bench.results import write
from cluster.console import quiet_third_party
from cluster.ray_env import configure_ray_env
from configs.loader import ConfigError, load_dotenv_file
from jobs.cli import usage_error


def parse(argv: list[str] | None = None) -> BenchOptions:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--suite", help=f"one of {', '.join(SUITES)}, or all")
    p.add_argument("--repeats", type=int, help="repeats of each side-by-side comparison (default 3)")
    p.add_argument("--out", help="folder for the results (default bench_results)")
    p.add_argument("--config", help="mcprl config the suites take tools and tasks from (default: built-in)")
    p.add_argument("--quick", action="store_true", default=None, help="smoke sizes (what the tests run)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    quiet_third_party(args.verbose)  # before the suites import FastMCP, Ray, vLLM
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    fields = {k: getattr(args, k) for k in ("suite", "repeats", "out", "config", "quick")}
    try:
        opts = BenchOptions.parse(fields, args.overrides)
        opts.mcprl_config()  # a bad --config fails here, before any suite starts
    except ConfigError as e:
        usage_error(str(e))
    return opts


def run_suite(name: str, opts: BenchOptions, console: Console) -> None:
    module = importlib.import_module(f"bench.{name}")
    console.rule(f"suite {name}")
    start = time.monotonic()
    result = module.run(opts, console)
    result.report.setdefault("wall_s", round(time.monotonic() - start, 1))
    for path in write(result, opts.out):
        console.print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    configure_ray_env()  # before any suite imports ray: loopback-only listeners
    opts = parse(argv)
    load_dotenv_file()
    console = Console(width=None if sys.stdout.isatty() else 150)  # a log file gets whole tables
    for name in [s for s in SUITES if s not in NOT_IN_ALL] if opts.suite == "all" else (opts.suite,):
        run_suite(name, opts, console)


if __name__ == "__main__":
    main()
