"""What every entry point shares: `--config` and `--set` parsing, `.env`, logging, clean errors."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
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


def run_and_leave(main: Callable[[], None]) -> NoReturn:
    """A job's `__main__`: run `main`, then leave without the interpreter's finalization.

    That finalization's last full collection walks every object torch, transformers and Ray made (1.7-2.7 s on a
    2-core CPU) to free memory the exit frees anyway, and its module teardown makes nanobind extensions (triton's,
    imported by transformers) print a leak report of dozens of lines. Leaving by `os._exit` skips both; what a
    normal exit does first still runs here: non-daemon threads are joined, atexit handlers run, stdio is
    flushed. An exception other than SystemExit leaves the normal way, with its traceback."""
    try:
        main()
        code: int = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): printed, status 1, as the interpreter does
            print(e.code, file=sys.stderr)
            code = 1
    current = threading.current_thread()
    for t in threading.enumerate():
        if t is not current and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(code)


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
