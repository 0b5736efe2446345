"""What every entry point shares: `--config` and `--set` parsing, `.env`, logging, clean errors."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from typing import Any, NoReturn

from cluster.console import quiet_third_party
from cluster.ray_env import RayAddressError, configure_ray_env
from configs.loader import ConfigError, load_config, load_dotenv_file
from configs.schema import Config

INTERRUPTED_EXIT = 130  # Ctrl-C: the shell's own convention (128 + SIGINT)


def interruptible() -> None:
    """SIGINT raises KeyboardInterrupt even in a process started with it ignored, as a script's background job
    (and whatever that job starts) is: Python then leaves SIGINT ignored, and asyncio.run does not take it, so
    Ctrl-C, or `kill -INT`, would do nothing."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def skip_final_gc() -> None:
    """Call at a job's end, just before the interpreter exits: its last full collection walks every object that
    torch, transformers and Ray made (1.7-2.7 s on a 2-core CPU), to free memory that the exit frees anyway.
    Frozen objects are left out of it; atexit handlers and the flush of stdout still run. Never in a process that
    goes on (a test's): its collector would skip them for good."""
    gc.freeze()


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", help="YAML config file (default: built-in defaults)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set tools.http.port=8001 (repeatable)",
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging, and every library's output (Ray, vLLM, W&B)"
    )
    return p


def counted(n: int, noun: str) -> str:
    """`1 template`, `2 templates`: a count with its noun in the right number (regular plurals only)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def usage_error(message: str) -> NoReturn:
    """A bad invocation (options, config, input file): the message on stderr and exit status 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _clean_errors(kind: type, value: BaseException, tb: Any) -> None:
    """An error the user fixes outside the code (a bad Ray address) ends in its message, not a traceback."""
    if issubclass(kind, RayAddressError):
        print(f"error: {value}", file=sys.stderr)
    else:
        sys.__excepthook__(kind, value, tb)


def setup(args: argparse.Namespace) -> Config:
    """Ray's loopback-only environment (before anything imports ray), logging (the libraries' routine
    output quieted unless -v: cluster.console), `.env`, then the validated config; a bad config is a usage error."""
    configure_ray_env()
    quiet_third_party(args.verbose)
    sys.excepthook = _clean_errors
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    load_dotenv_file()
    overrides = [*(["logging.engine_log_level=INFO"] if args.verbose else []), *args.overrides]
    try:
        return load_config(args.config, overrides)
    except ConfigError as e:
        usage_error(str(e))
