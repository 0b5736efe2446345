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
    assert shown("vllm.config.vllm", logging.WARNING, "Some other warning")
    assert shown("vllm.engine.core", logging.WARNING, "Enforce eager set")  # another logger's: not a notice

    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert vllm_logging_config("INFO", tmp_path / "v") is None  # -v: vLLM's own config
