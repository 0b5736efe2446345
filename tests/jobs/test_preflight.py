"""Preflight's model check with an HF id: what it says when this node cannot get the model."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from configs.schema import Config
from jobs.preflight import Preflight, check_model

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it


def test_model_check_names_the_model_and_the_node_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache; offline (tests/conftest.py)
    cfg = Config()
    cfg.model.name = "Qwen/Qwen2.5-1.5B-Instruct"
    pf = Preflight()
    check_model(cfg, pf)
    [check] = pf.checks
    assert check.name == "model" and not check.ok
    assert f"'Qwen/Qwen2.5-1.5B-Instruct' is not in the HF cache of node {socket.gethostname()}" in check.detail
    assert "HF_HUB_OFFLINE is set" in check.detail
    assert "HF_HUB_OFFLINE" in check.fix
    assert pf.tokenizer is None


def test_model_check_refuses_a_vllm_context_longer_than_the_models_positions() -> None:
    cfg = Config()  # tiny-random: 2048 positions
    cfg.rollout.backend, cfg.rollout.max_model_len = "vllm", 4096
    pf = Preflight()
    check_model(cfg, pf)
    [check] = pf.checks
    assert not check.ok and "rollout.max_model_len 4096 > tiny-random's 2048 positions" in check.detail
    assert check.fix == "set rollout.max_model_len to at most 2048"
    cfg.rollout.max_model_len = 2048
    pf = Preflight()
    check_model(cfg, pf)
    assert pf.checks[0].ok, pf.checks[0].detail


def test_a_python_tool_without_its_sandbox_fails_preflight_by_name(tmp_path: Path) -> None:
    """Without bubblewrap every run_python call fails; the rule generator used to drop the tasks that need it
    as if their templates had run out of tasks, and the run trained without them."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no bwrap on it
    data = tmp_path / "data"
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.train", "--config", "configs/ci-tiny.yaml",
         "--set", "tools.servers.python.enabled=true",
         "--set", f"data.train={data / 'tasks.train.jsonl'}",
         "--set", f"data.validation={data / 'tasks.validation.jsonl'}"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[FAIL] MCP servers: python: sandbox unavailable: bubblewrap (bwrap) is not installed" in proc.stdout
    assert "make sandbox" in proc.stdout and "[FAIL] data: skipped" in proc.stdout
    assert not data.exists()
