"""cluster.console's logging config for vLLM's own processes: its handler's filter drops the named notices
and keeps every other warning and each error."""

from __future__ import annotations

import importlib.util
import json
import logging
import logging.config
from pathlib import Path

import pytest

from cluster.console import VERBOSE_ENV, vllm_logging_config


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_logging_config_drops_the_notices_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    path = vllm_logging_config("WARNING", tmp_path)
    assert path is not None
    config = json.loads(Path(path).read_text())
    assert config["loggers"]["vllm"]["level"] == "WARNING" and config["handlers"]["vllm"]["level"] == "WARNING"
    # The handler's filter, resolved by its dotted name as dictConfig does in vLLM's processes (not applied
    # here: dictConfig would close this test session's handlers).
    assert config["handlers"]["vllm"]["filters"] == ["notices"]
    notices = logging.config.BaseConfigurator({}).resolve(config["filters"]["notices"]["()"])()

    def shown(name: str, level: int, msg: str) -> bool:
        return bool(notices.filter(logging.LogRecord(name, level, __file__, 1, msg, (), None)))

    assert not shown("vllm.config.vllm", logging.WARNING, "Enforce eager set, disabling torch.compile")
    assert not shown("vllm.platforms.cpu", logging.WARNING, "Triton is not installed. triton-cpu is expected")
    assert not shown("vllm.v1.worker.cpu_worker", logging.WARNING, "libiomp is not found in LD_PRELOAD. For best")
    assert shown("vllm.v1.worker.cpu_worker", logging.ERROR, "libiomp is not found in LD_PRELOAD")  # errors stay
    assert not shown("vllm.v1.utils", logging.WARNING, "[shutdown] Process manager: force killing remaining processes")
    assert shown("vllm.config.vllm", logging.WARNING, "Some other warning")
    assert shown("vllm.engine.core", logging.WARNING, "Enforce eager set")  # another logger's: not a notice

    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert vllm_logging_config("INFO", tmp_path / "v") is None  # -v: vLLM's own config


def test_the_lines_ray_forwards_lose_the_printed_notices_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """quiet_worker_lines: a batch of worker lines, as Ray's log thread hands it to the driver's printer, reaches
    the printer without vLLM's Triton and torch's NUMA prints, and with every other line; -v keeps them all."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from cluster.console import quiet_worker_lines

    notices = [
        "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
        "[W1127 10:18:06.333252514 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation",
    ]
    others = ["Traceback (most recent call last):", "WARNING 11-27 10:18:08 [torch_utils.py:283] something else"]
    printed: list[list[str]] = []
    dispatcher.add_handler("test_printer", lambda batch: printed.append(list(batch["lines"])))
    try:
        monkeypatch.delenv(VERBOSE_ENV, raising=False)
        quiet_worker_lines()
        quiet_worker_lines()  # idempotent: one filter
        assert sum(name == "mcprl_printed_notices" for name, _ in dispatcher.handlers) == 1
        dispatcher.emit({"lines": [notices[0], others[0], notices[1], others[1]], "pid": 1, "is_err": True})
        assert printed == [others]
        monkeypatch.setenv(VERBOSE_ENV, "1")  # -v: the filter lets everything through
        dispatcher.emit({"lines": notices, "pid": 1, "is_err": True})
        assert printed[-1] == notices
    finally:
        dispatcher.remove_handler("test_printer")


def test_serves_routine_lines_go_and_its_other_warnings_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    """quiet_third_party on Serve's logger: INFO goes (warnings only), and so does the router's queue-length
    notice; any other warning passes (both filters apply, neither replaces the other)."""
    from cluster.console import DropBelow, quiet_third_party

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    quiet_third_party()
    quiet_third_party()  # idempotent
    serve = logging.getLogger("ray.serve")

    def passes(level: int, msg: str) -> bool:
        return bool(serve.filter(logging.LogRecord("ray.serve", level, __file__, 1, msg, (), None)))

    assert not passes(logging.INFO, "Deployed app 'mcp-fmp' successfully.")
    assert not passes(logging.WARNING, "Failed to get queue length from Replica(id='x') within 0.1s. If this")
    assert passes(logging.WARNING, "Replica(id='x') failed health check")
    assert passes(logging.ERROR, "Failed to get queue length from Replica(id='x')")  # errors stay
    drops = [f for f in serve.filters if isinstance(f, DropBelow)]
    assert len(drops) == len({(f.level, f.prefixes) for f in drops}) == 2
