"""A quiet console: what the libraries under mcprl print routinely is kept off it, in every process of a run.

`quiet_third_party()` is the one place that sets this up: the entry points call it (jobs.cli.setup,
serve_model, export) and so do the Ray actors that load models or Serve handles, for their own process.
Only routine lines go: INFO chatter (Ray's start, Serve's app lifecycle, W&B's banner), progress bars
of local loads, and named warnings that say nothing to a user of mcprl (Ray's token-auth notice, vLLM's
notes on settings mcprl chose on purpose). Errors, and every other warning, still show.

What a library prints without logging (vLLM's Triton check on import, torch's NUMA note) is dropped where
it passes through our code: a child's stderr we relay (`printed_notice`) and the lines Ray forwards from its
workers to the driver (`quiet_worker_lines`, which `cluster.ray_env.start_ray` installs).

`-v` (MCPRL_VERBOSE=1, which the embedded Ray's workers inherit) leaves everything as the libraries have it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

VERBOSE_ENV = "MCPRL_VERBOSE"

# Levels libraries read from the environment when imported (this process's and, inherited, its workers'),
# as (variable, logger, level); the logger's level is set too, for a library imported already. FastMCP warns
# about every call with invalid arguments, for us an expected, reported outcome.
_QUIET_ENV = (("FASTMCP_LOG_LEVEL", "fastmcp", "ERROR"),)

# Loggers whose INFO lines are routine; their warnings and errors still show.
_WARNINGS_ONLY = ("httpx", "httpx2", "mcp", "ray._private.worker", "ray.serve")

# Warnings that are notices, not problems, as (logger, message prefixes).
_NOTICES: dict[str, tuple[str, ...]] = {
    # On by default in a new local Ray; its opposite (auth disabled) still warns.
    "ray._private.authentication.authentication_token_setup": ("Token authentication is enabled",),
    # cluster/ray_env.py start_ray_early starts Ray on a thread, and sets this handler on the main thread itself.
    "ray._private.worker": ("SIGTERM handler is not set because current thread is not the main thread",),
    # vLLM on CPU, about settings actors/vllm_engine.py chooses on purpose (eager mode, no chunked
    # prefill) and kernels a CPU build does without.
    "vllm.triton_utils.importing": (
        "Triton is installed, but doesn't include CPU backend",
        "Triton is installed but 0 active driver(s)",
        "Triton not installed or not compatible",
    ),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type"),
    # A CPU without oneDNN's kernel for the dtype (bf16 without AVX-512): vLLM uses torch's linear instead.
    "vllm.model_executor.layers.utils": ("Failed to create oneDNN linear",),
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled", "Model Runner V2 requires Triton"),
    "vllm.engine.arg_utils": (
        "This model does not officially support disabling chunked prefill",
        # With the model in the engine core (actors/vllm_engine.py), vLLM seeds the engine core's random state,
        # not this process's: AsyncLLM always runs its core in a process of its own.
        "The global random seed is set to",
    ),
    # vLLM's CPU worker, on every engine start, about preloading tcmalloc and Intel OpenMP for speed: a
    # tuning of the host that mcprl does not make and a user rarely can (CPU engines are CI-sized here).
    "vllm.v1.worker.cpu_worker": ("libtcmalloc is not found in LD_PRELOAD", "libiomp is not found in LD_PRELOAD"),
    # ... and about the OpenMP threads it derives from the cores the engine is bound to (orchestration/cpu_pinning.py).
    "vllm.utils.torch_utils": ("OMP_NUM_THREADS=",),
    # DeepSpeed (imported by the training libraries) on a machine without a GPU: CPU is what that machine has.
    "DeepSpeed": ("Setting accelerator to CPU",),
    # Serve's router, when a replica does not report its queue length within 0.1 s: on a loaded machine it
    # happens in bursts, and the router then picks a replica without it, as it should.
    "ray.serve": ("Failed to get queue length from",),
    # vLLM's steps of a shutdown we asked for, when its engine core or workers outlive the grace vLLM gives
    # them (SIGTERM, then a kill): routine on a loaded machine.
    "vllm.v1.utils": ("[shutdown]",),
    "vllm.utils.system_utils": ("[shutdown]",),
    "vllm.v1.executor.multiproc_executor": ("[shutdown]",),
    # Addressed to mcprl's code (actors/vllm_engine.py passes token ids), not to its user.
    "vllm.v1.engine.input_processor": ("Passing raw prompts to InputProcessor is deprecated",),
}


# Lines libraries print straight to stderr, not through logging, as substrings: vLLM's Triton check when
# imported before any logging config applies (each process), and torch's note on binding a CPU engine's
# memory to its NUMA node. Only a filter on a child's stderr (`printed_notice`) can drop them.
_PRINTED_NOTICES = (
    "Triton is installed, but doesn't include CPU backend",
    "Warning: NUMA binding: Using MEMBIND policy",
)


def printed_notice(line: str) -> bool:
    """Whether a line a child process printed is one of the routine notices above (never under -v)."""
    return not verbose() and any(notice in line for notice in _PRINTED_NOTICES)


_WORKER_FILTER = "mcprl_printed_notices"  # its name among the dispatcher's handlers


def quiet_worker_lines() -> None:
    """Drop the printed notices from the lines Ray forwards from its workers to this driver's console (vLLM's
    engine core prints them in a Ray actor); the workers' log files keep them. Ray's dispatcher of those lines
    is not public API: where it is not as expected, nothing is dropped. Idempotent; never under -v."""
    if verbose():
        return
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        handlers, lock = dispatcher.handlers, dispatcher._lock
    except (ImportError, AttributeError):
        return

    def drop(batch: dict[str, Any]) -> None:  # runs before Ray's printer (first in the list), on the same batch
        batch["lines"] = [line for line in batch.get("lines", ()) if not printed_notice(line)]

    with lock:
        if not any(name == _WORKER_FILTER for name, _ in handlers):
            handlers.insert(0, (_WORKER_FILTER, drop))


# Python warnings of library against library, as PYTHONWARNINGS entries: vLLM's Triton shim asks torch for an
# attribute torch deprecated, in each process vLLM starts; multiprocessing's resource tracker counts the shared
# memory of a vLLM engine core killed at shutdown, which the system reclaims.
_PYTHON_WARNINGS = (
    "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning,ignore:resource_tracker:UserWarning"
)


class DropBelow(logging.Filter):
    """Drops a logger's records under `level`, or only those whose message starts with one of `prefixes`.

    A filter, not a level: libraries reset their loggers' levels when they configure them (Serve does
    on import), but leave filters be."""

    def __init__(self, level: int, prefixes: Iterable[str] = ()) -> None:
        super().__init__()
        self.level, self.prefixes = level, tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level:
            return True
        return bool(self.prefixes) and not record.getMessage().startswith(self.prefixes)


class Notices(logging.Filter):
    """The notices above, for a handler that sees every logger's records: the one in the logging config
    vLLM applies in the processes it starts (`vllm_logging_config`), where none of our code runs."""

    def filter(self, record: logging.LogRecord) -> bool:
        prefixes = _NOTICES.get(record.name)
        return record.levelno >= logging.ERROR or not prefixes or not record.getMessage().startswith(prefixes)


def vllm_logging_config(level: str, folder: Path) -> str | None:
    """A logging config for vLLM (its `pylogging_config_file`, a JSON dictConfig) written into `folder`:
    vLLM's own format and handler at `level`, with `Notices` on the handler. vLLM applies it in each
    process it starts (engine core, workers) before they log. None under -v: vLLM's own config."""
    if verbose():
        return None
    from copy import deepcopy

    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config: dict[str, Any] = deepcopy(DEFAULT_LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["log_level"] = level
    config["filters"] = {"notices": {"()": f"{__name__}.Notices"}}
    config["handlers"]["vllm"].update(level=level, filters=["notices"])
    config["loggers"]["vllm"]["level"] = level
    path = folder / "vllm_logging.json"
    path.write_text(json.dumps(config))
    return str(path)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_third_party(verbose_flag: bool | None = None) -> None:
    """Quiet the libraries' routine output in this process (idempotent). `verbose_flag` True: leave it
    all, and say so to the processes this one starts; None: as this process's environment says."""
    if verbose_flag:
        os.environ[VERBOSE_ENV] = "1"
    if verbose():
        return
    if _PYTHON_WARNINGS not in os.environ.get("PYTHONWARNINGS", ""):  # read by the processes vLLM spawns
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), _PYTHON_WARNINGS)))
    for key, name, level in _QUIET_ENV:
        if key not in os.environ:  # a level the user set stays
            os.environ[key] = level
            logging.getLogger(name).setLevel(level)
    for name in _WARNINGS_ONLY:
        _add_once(name, DropBelow(logging.WARNING))
    for name, prefixes in _NOTICES.items():
        _add_once(name, DropBelow(logging.ERROR, prefixes))


def _add_once(name: str, f: DropBelow) -> None:
    logger = logging.getLogger(name)
    same = (f.level, f.prefixes)
    if not any(isinstance(old, DropBelow) and (old.level, old.prefixes) == same for old in logger.filters):
        logger.addFilter(f)
