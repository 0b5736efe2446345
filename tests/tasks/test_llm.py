"""The `llm` and `mcp` generators and their structured-outputs client, against a local OpenAI stand-in.

Nothing here leaves 127.0.0.1: every config points `generation.openai.base_url` at the stand-in.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from configs.loader import load_config
from configs.schema import OpenAIConfig
from serve_apps.tool_pool import LocalToolPool
from tasks.generators import llm, mcp
from tasks.generators.options import GenerateOptions, GenerationError
from tasks.openai_client import MissingAPIKey, RequestFailed, StructuredClient, StructuredOutputError, cache_key
from tasks.schema import TaskRow
from tests.tasks.openai_standin import OpenAIStandin, messages_of, schema_of, words

BUILTINS = ("polygon", "fmp", "tavily", "slack", "python")
STDIO_SERVER = str(Path(__file__).parents[1] / "serve_apps" / "stdio_server.py")
KEY_ENV = "MCPRL_TEST_OPENAI_KEY"  # unset unless a test sets it: the stand-in needs no key
MODEL = "standin-model"

# What the scripted model answers, by the focus tool the prompt names (params as a JSON string).
PLANS: dict[str, dict[str, Any]] = {
    "polygon.previous_close": {
        "user_prompt": "What did Apple's stock close at on the last trading day?",
        "params": {"ticker": "AAPL"},
        "answer_path": "results.0.c",
        "final_answer_hint": "The close in USD.",
    },
    "polygon.ticker_details": {
        "user_prompt": "Tell me what NVIDIA does and where it is listed.",
        "params": {"ticker": "NVDA"},
        "answer_path": "",
        "final_answer_hint": "",
    },
    "polygon.daily_aggregates": {
        "user_prompt": "On how many trading days did Microsoft trade from 2 to 6 November 2026?",
        "params": {"ticker": "MSFT", "from_date": "2026-11-02", "to_date": "2026-11-06"},
        "answer_path": "resultsCount",
        "final_answer_hint": "The number of trading days.",
    },
    "fmp.company_profile": {"user_prompt": "Apple's sector?", "params": {"symbol": "AAPL"}, "answer_path": ""},
    "fmp.income_statement": {"user_prompt": "Apple's last revenue?", "params": {"symbol": "AAPL"}, "answer_path": ""},
    "fmp.key_ratios": {"user_prompt": "Apple's P/E last year?", "params": {"symbol": "AAPL"}, "answer_path": ""},
    "notes.echo": {"user_prompt": "Say hi back to me.", "params": {"text": "hi"}, "answer_path": ""},
    "notes.add": {"user_prompt": "What is 2 plus 3?", "params": {"a": 2, "b": 3}, "answer_path": "sum"},
    "notes.sleep": {"user_prompt": "Wait for no time at all.", "params": {"seconds": 0}, "answer_path": ""},
    "notes.whoami": {"user_prompt": "Which process answers you?", "params": {}, "answer_path": ""},
}
FOCUS = re.compile(r"The first call is (\S+?)\.\n")


def focus_of(body: dict[str, Any]) -> str:
    return FOCUS.search(messages_of(body)[-1]["content"]).group(1)


def plan_answer(body: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """The scripted model: a one-call task for the prompt's focus tool."""
    focus = focus_of(body)
    server, tool = focus.split(".", 1)
    plan = PLANS[focus]
    answer = {
        "user_prompt": plan["user_prompt"],
        "complexity": "simple",
        "tool_sequence": [{"server": server, "tool": tool, "params": json.dumps(plan["params"])}],
        "answer_path": plan["answer_path"],
        "final_answer_hint": plan.get("final_answer_hint", ""),
    }
    answer.update(changes)
    return answer


def make_cfg(base_url: str, tmp_path: Path, backend: str = "chat", servers: tuple[str, ...] = ("polygon",), *more):
    sets = [
        f"generation.openai.base_url={base_url}",
        f"generation.openai.model={MODEL}",
        f"generation.openai.backend={backend}",
        f"generation.openai.cache_dir={tmp_path / 'openai-cache'}",
        f"generation.openai.api_key_env={KEY_ENV}",
        *[f"tools.servers.{n}.enabled=false" for n in BUILTINS if n not in servers],
        *more,
    ]
    return load_config(None, sets)


def client_cfg(base_url: str, tmp_path: Path, **kw: Any) -> OpenAIConfig:
    return OpenAIConfig(model=MODEL, base_url=base_url, api_key_env=KEY_ENV, cache_dir=str(tmp_path / "c"), **kw)


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with OpenAIStandin() as s:
        yield s


@pytest.fixture
async def polygon_pool(tmp_path):
    pool = await LocalToolPool.create(make_cfg("http://127.0.0.1:1/v1", tmp_path).tools)
    yield pool
    await pool.close()


SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}


# --------------------------------------------------------------------------- the generator's rows


@pytest.mark.parametrize("backend", ["chat", "responses"])
async def test_rows_exact_for_both_backends(standin, tmp_path, polygon_pool, backend):
    standin.responder = plan_answer
    cfg = make_cfg(standin.base_url, tmp_path, backend)
    opts = GenerateOptions(n=6, seed=3, domains=("polygon",), complexities=("simple",), max_tools=2, max_turns=4)
    rows, report = await llm.generate_with_report(cfg, opts, polygon_pool)

    assert report.requested == 6 and report.produced == 6 and not report.skipped
    for row in rows:
        TaskRow.model_validate(row)
    # The focus tools are the seed's draw; each sample asked for its own.
    catalog = llm.tool_catalog(await polygon_pool.list_tools())
    specs = llm.plan_samples(catalog, opts, "llm", "random")
    assert [r["extra_info"]["focus_tool"] for r in rows] == [s.focus.qualified for s in specs]
    assert [r["extra_info"]["sample"] for r in rows] == list(range(6))

    by_focus = {r["extra_info"]["focus_tool"]: r for r in rows}
    assert "polygon.previous_close" in by_focus  # seed 3 draws it (the exact row below)
    row = by_focus["polygon.previous_close"]
    task_id = row["reward_spec"]["ground_truth"]["task_id"]
    assert re.fullmatch(r"llm-[0-9a-f]{12}", task_id)
    system = llm.AGENT_SYSTEM_PROMPT.format(servers="polygon")
    assert row == {
        "data_source": "mcprl/llm",
        "env_class": "MCPToolEnv",
        "prompt": [
            {"role": "system", "content": system},
            {"role": "user", "content": "What did Apple's stock close at on the last trading day?"},
        ],
        "reward_spec": {
            "method": "rule",
            "ground_truth": {
                "task_id": task_id,
                "complexity": "simple",
                "max_turns": 4,
                "success": {"must_call_tool": "polygon.previous_close"},
                "tool_sequence": [
                    {"step": 1, "server": "polygon", "tool": "previous_close", "params": {"ticker": "AAPL"}}
                ],
                "limits": {"max_servers": 1, "max_tools": 2},
                # The offline backend's close for AAPL, found by running the plan.
                "final_answer": {"value": 271.35, "tolerance": 0.27135, "description": "The close in USD."},
            },
        },
        "extra_info": {
            "method": "llm",
            "model": MODEL,
            "sample": row["extra_info"]["sample"],
            "seed": 3,
            "template": "llm:polygon.previous_close",
            "focus_tool": "polygon.previous_close",
            "final_answer_hint": "The close in USD.",
            "answer_path": "results.0.c",
        },
    }
    if "polygon.ticker_details" in by_focus:  # no answer path: no final answer
        assert by_focus["polygon.ticker_details"]["reward_spec"]["ground_truth"]["final_answer"] is None
    if "polygon.daily_aggregates" in by_focus:
        assert by_focus["polygon.daily_aggregates"]["reward_spec"]["ground_truth"]["final_answer"]["value"] == 5

    # What went over the wire: the model, the two messages, and strict structured outputs.
    assert len(standin.requests) == 6
    for rec, spec in zip(
        sorted(standin.requests, key=lambda r: focus_of(r.body)),
        sorted(specs, key=lambda s: s.focus.qualified),
        strict=True,
    ):
        body = rec.body
        system_text, user_text, schema = llm.build_request(catalog, spec, opts)
        assert body["model"] == MODEL
        assert rec.headers["authorization"] == "Bearer not-needed"  # local server, no key
        assert messages_of(body) == [{"role": "system", "content": system_text}, {"role": "user", "content": user_text}]
        if backend == "chat":
            assert rec.path == "/v1/chat/completions"
            assert body["response_format"] == {
                "type": "json_schema",
                "json_schema": {"name": "mcprl_task", "schema": schema, "strict": True},
            }
            assert "text" not in body
        else:
            assert rec.path == "/v1/responses"
            assert body["text"] == {
                "format": {"type": "json_schema", "name": "mcprl_task", "schema": schema, "strict": True}
            }
            assert body["store"] is False and "response_format" not in body
        assert body["temperature"] == 0.7


def test_task_schema_is_strict_and_shaped_by_the_catalog():
    catalog = [
        llm.ToolInfo("polygon", "previous_close", "d", {"type": "object"}),
        llm.ToolInfo("notes", "add", "d", {"type": "object"}),
    ]
    schema = llm.task_schema(catalog, "medium", max_turns=8)
    jsonschema.Draft202012Validator.check_schema(schema)

    def strict(node: dict) -> None:  # strict mode: every object closed, every property required
        if node.get("type") == "object":
            assert node["additionalProperties"] is False
            assert set(node["required"]) == set(node["properties"])
            for child in node["properties"].values():
                strict(child)
        if node.get("type") == "array":
            strict(node["items"])

    strict(schema)
    seq = schema["properties"]["tool_sequence"]
    assert (seq["minItems"], seq["maxItems"]) == (2, 3)
    assert seq["items"]["properties"]["server"]["enum"] == ["notes", "polygon"]
    assert seq["items"]["properties"]["tool"]["enum"] == ["add", "previous_close"]
    assert seq["items"]["properties"]["params"]["type"] == "string"
    assert schema["properties"]["complexity"]["enum"] == ["medium"]
    assert llm.task_schema(catalog, "hard", max_turns=5)["properties"]["tool_sequence"]["maxItems"] == 5
    assert "maxLength" not in json.dumps(schema)  # OpenAI's strict mode has no string lengths
    assert llm.task_schema(catalog, "simple", 8, max_string_chars=50)["properties"]["user_prompt"]["maxLength"] == 50


def test_prompt_lists_tools_with_their_parameters():
    tool = llm.ToolInfo(
        "fmp",
        "key_ratios",
        "Financial ratios per period.\n\nMore text.",
        {
            "type": "object",
            "properties": {
                "symbol": {"type": "string", "description": "Ticker."},
                "period": {"enum": ["annual", "quarter"], "default": "annual", "type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5},
            },
            "required": ["symbol"],
        },
    )
    assert llm.describe_tool(tool) == (
        "- fmp.key_ratios: Financial ratios per period.\n"
        "    symbol (string, required): Ticker.\n"
        '    period ("annual" | "quarter", default "annual")\n'
        "    limit (integer 1..20, default 5)"
    )
    empty = llm.ToolInfo("slack", "list_channels", "Channels.", {"type": "object", "properties": {}})
    assert llm.describe_tool(empty) == "- slack.list_channels: Channels.\n    (no parameters)"


# --------------------------------------------------------------------------- the client


async def test_retries_on_429_and_500_then_success(standin, tmp_path):
    standin.fail_next(429, 2, retry_after=0)
    standin.fail_next(500, 1)
    standin.script({"city": "Oslo", "days": 3})
    client = StructuredClient(client_cfg(standin.base_url, tmp_path, max_retries=3), backoff_s=0.001)
    async with client:
        assert await client.complete("sys", "user", "trip", SCHEMA) == {"city": "Oslo", "days": 3}
    assert len(standin.requests) == 4
    usage = client.usage()
    assert usage["retries"] == 3 and usage["requests"] == 1  # failed attempts spend no tokens


async def test_retries_are_bounded_and_only_for_retryable_errors(standin, tmp_path):
    client = StructuredClient(client_cfg(standin.base_url, tmp_path, max_retries=2), backoff_s=0.001)
    standin.fail_next(503, 5)
    with pytest.raises(RequestFailed) as err:
        await client.complete("sys", "a", "trip", SCHEMA)
    assert (err.value.kind, err.value.status, err.value.attempts) == ("server", 503, 3)
    assert len(standin.requests) == 3

    standin.reset()
    standin.fail_next(400, 1)
    standin.fail_next(400, 1)  # would be the retry; never asked
    with pytest.raises(RequestFailed) as err:
        await client.complete("sys", "b", "trip", SCHEMA)
    assert (err.value.kind, err.value.status, err.value.attempts, err.value.fatal) == ("bad_request", 400, 1, False)
    assert len(standin.requests) == 1
    await client.aclose()


async def test_connection_errors_are_retried_then_named(tmp_path):
    with OpenAIStandin() as dead:
        url = dead.base_url  # a port nobody listens on once it is stopped
    client = StructuredClient(client_cfg(url, tmp_path, max_retries=1), backoff_s=0.001)
    with pytest.raises(RequestFailed) as err:
        await client.complete("s", "u", "trip", SCHEMA)
    assert (err.value.kind, err.value.attempts) == ("connection", 2)
    assert client.usage()["retries"] == 1
    await client.aclose()


async def test_token_counting_and_cache(standin, tmp_path):
    answer = {"city": "Lima", "days": 12}
    standin.script(answer, answer)
    cfg = client_cfg(standin.base_url, tmp_path)
    async with StructuredClient(cfg) as client:
        assert await client.complete("be brief", "plan a trip to Lima", "trip", SCHEMA) == answer
        prompt, completion = words("be brief") + words("plan a trip to Lima"), words(json.dumps(answer))
        assert client.usage() == {
            "requests": 1,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "cache_hits": 0,
            "retries": 0,
        }
        # Same prompt, next sample: a new request; the same sample again: the cache, for free.
        assert await client.complete("be brief", "plan a trip to Lima", "trip", SCHEMA, sample=1) == answer
        assert await client.complete("be brief", "plan a trip to Lima", "trip", SCHEMA) == answer
        assert len(standin.requests) == 2
        assert client.usage()["total_tokens"] == 2 * (prompt + completion)
        assert client.usage()["cache_hits"] == 1

    # A new client (a rerun) reads the disk cache: no request, no tokens.
    async with StructuredClient(cfg) as again:
        assert await again.complete("be brief", "plan a trip to Lima", "trip", SCHEMA, sample=1) == answer
        assert again.usage()["total_tokens"] == 0 and again.usage()["cache_hits"] == 1
    assert len(standin.requests) == 2
    files = list((tmp_path / "c").rglob("*.json"))
    assert len(files) == 2 and not list((tmp_path / "c").rglob(".tmp-*"))  # atomic writes leave no temp files
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "plan a trip to Lima"}]
    key = cache_key(MODEL, "chat", messages, "trip", SCHEMA, 0.7, 1)
    assert (tmp_path / "c" / key[:2] / f"{key}.json").is_file()
    # Anything that shapes the answer changes the key.
    base = ("m", "chat", [], "n", SCHEMA, 0.7, 0)
    variants = [base, ("m2", *base[1:]), ("m", "responses", *base[2:]), (*base[:2], [{"role": "user", "content": "x"}],
                *base[3:]), (*base[:4], {}, *base[5:]), (*base[:5], 0.2, 0), (*base[:6], 1)]  # fmt: skip
    assert len({cache_key(*v) for v in variants}) == len(variants)


async def test_responses_backend_counts_input_and_output_tokens(standin, tmp_path):
    standin.script({"city": "Rome", "days": 2})
    async with StructuredClient(client_cfg(standin.base_url, tmp_path, backend="responses")) as client:
        assert await client.complete("s", "go to Rome", "trip", SCHEMA) == {"city": "Rome", "days": 2}
        assert client.usage()["prompt_tokens"] == 1 + 3
        assert client.usage()["completion_tokens"] == words(json.dumps({"city": "Rome", "days": 2}))
    body = standin.requests[0].body
    assert body["instructions"] == "s" and body["input"] == [{"role": "user", "content": "go to Rome"}]
    assert body["text"]["format"] == {"type": "json_schema", "name": "trip", "schema": SCHEMA, "strict": True}


async def test_concurrency_is_bounded(standin, tmp_path):
    standin.responder = lambda body: {"city": messages_of(body)[-1]["content"], "days": 1}
    standin.hold()
    client = StructuredClient(client_cfg(standin.base_url, tmp_path, concurrency=2), use_cache=False)
    calls = [asyncio.create_task(client.complete("s", f"city{i}", "trip", SCHEMA)) for i in range(6)]
    assert await asyncio.to_thread(standin.wait_in_flight, 2)
    await asyncio.sleep(0.3)  # room for a third request to arrive, if the bound did not hold
    assert standin.in_flight == 2
    standin.release()
    results = await asyncio.gather(*calls)
    assert [r["city"] for r in results] == [f"city{i}" for i in range(6)]
    assert standin.max_in_flight == 2
    await client.aclose()


async def test_unparsable_answers_are_named_errors(standin, tmp_path):
    standin.script("not json at all", "[1, 2]", {"city": "Oslo"}, "")
    async with StructuredClient(client_cfg(standin.base_url, tmp_path), use_cache=False) as client:
        reasons = []
        for i in range(4):
            with pytest.raises(StructuredOutputError) as err:
                await client.complete("s", f"u{i}", "trip", SCHEMA)
            reasons.append(err.value.reason)
    assert reasons == ["not_json", "not_object", "schema_mismatch", "empty"]


def test_missing_key_for_a_remote_endpoint(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(MissingAPIKey, match=KEY_ENV):
        StructuredClient(OpenAIConfig(api_key_env=KEY_ENV))  # OpenAI's own endpoint: raised before any request
    with pytest.raises(MissingAPIKey):
        StructuredClient(OpenAIConfig(api_key_env=KEY_ENV, base_url="https://llm.example.invalid/v1"))
    StructuredClient(OpenAIConfig(api_key_env=KEY_ENV, base_url="http://localhost:9/v1"))  # local: no key needed


async def test_bad_key_stops_the_run_without_showing_the_key(standin, tmp_path, polygon_pool, monkeypatch):
    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv(KEY_ENV, secret)
    standin.fail_next(401, 10)
    cfg = make_cfg(standin.base_url, tmp_path)
    with pytest.raises(GenerationError) as err:
        await llm.generate(cfg, GenerateOptions(n=2, complexities=("simple",)), polygon_pool)
    assert "401" in str(err.value) and "auth" in str(err.value)
    assert secret not in str(err.value) and secret not in repr(StructuredClient(cfg.generation.openai))
    assert standin.requests[0].headers["authorization"] == f"Bearer {secret}"


async def test_missing_key_stops_the_generator(tmp_path, polygon_pool, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    cfg = make_cfg("https://llm.example.invalid/v1", tmp_path)
    with pytest.raises(GenerationError, match=KEY_ENV):
        await llm.generate(cfg, GenerateOptions(n=1), polygon_pool)


# --------------------------------------------------------------------------- rerun, skips


async def test_rerun_hits_the_cache_sends_nothing_and_spends_nothing(standin, tmp_path, polygon_pool):
    standin.responder = plan_answer
    cfg = make_cfg(standin.base_url, tmp_path)
    opts = GenerateOptions(n=4, seed=1, complexities=("simple",))
    first, report1 = await llm.generate_with_report(cfg, opts, polygon_pool)
    assert len(standin.requests) == 4 and report1.usage["total_tokens"] > 0
    second, report2 = await llm.generate_with_report(cfg, opts, polygon_pool)
    assert len(standin.requests) == 4  # nothing new went out
    assert report2.usage["total_tokens"] == 0 and report2.usage["cache_hits"] == 4
    assert second == first
    # Another seed is other samples: asked again.
    await llm.generate_with_report(cfg, GenerateOptions(n=1, seed=2, complexities=("simple",)), polygon_pool)
    assert len(standin.requests) == 5


async def test_unusable_answers_are_counted_and_skipped(standin, tmp_path):
    def wrong_first(body):
        other = next(f for f in ("polygon.previous_close", "polygon.ticker_details") if f != focus_of(body))
        return plan_answer(body, tool_sequence=[{"server": "polygon", "tool": other.split(".")[1], "params": "{}"}])

    def step(server, tool, params):
        return lambda body: plan_answer(body, tool_sequence=[{"server": server, "tool": tool, "params": params}])

    def with_params(params):
        def answer(body):
            first = plan_answer(body)["tool_sequence"][0]
            return plan_answer(body, tool_sequence=[{**first, "params": params}])

        return answer

    standin.script(
        "this is not JSON",  # output_not_json
        '["a", "list"]',  # output_not_object
        {"user_prompt": "missing fields"},  # output_schema_mismatch
        lambda body: plan_answer(body, tool_sequence=[]),  # output_schema_mismatch (minItems)
        with_params("{bad"),  # params_not_json
        with_params("[1]"),  # params_not_object
        step("polygon", "company_profile", "{}"),  # unknown_tool: fmp's tool under polygon
        wrong_first,  # first_call_not_focus
        lambda body: plan_answer(body, user_prompt="   "),  # empty_prompt
        plan_answer,  # the one good answer
    )
    standin.fail_next(400, 1)  # request_bad_request (takes no scripted answer)
    cfg = make_cfg(standin.base_url, tmp_path, "chat", ("polygon", "fmp"))
    pool = await LocalToolPool.create(cfg.tools)
    try:
        opts = GenerateOptions(n=11, domains=("polygon", "fmp"), complexities=("simple",))
        rows, report = await llm.generate_with_report(cfg, opts, pool)
    finally:
        await pool.close()
    assert report.skipped == Counter(
        {
            "output_not_json": 1,
            "output_not_object": 1,
            "output_schema_mismatch": 2,
            "params_not_json": 1,
            "params_not_object": 1,
            "unknown_tool": 1,
            "first_call_not_focus": 1,
            "empty_prompt": 1,
            "request_bad_request": 1,
        }
    )
    assert report.produced == len(rows) == 1
    TaskRow.model_validate(rows[0])
    assert "skipped:" in report.summary() and "1/11" in report.summary()


def test_decode_steps_checks_counts_and_distinct_tools():
    catalog = [llm.ToolInfo("p", "a", "", {}), llm.ToolInfo("p", "b", "", {})]
    spec = llm.SampleSpec(0, "medium", catalog[0])
    two = {"complexity": "medium", "tool_sequence": [
        {"server": "p", "tool": "a", "params": "{}"}, {"server": "p", "tool": "b", "params": {"x": 1}}]}  # fmt: skip
    steps = llm.decode_steps(two, catalog, spec, GenerateOptions(max_tools=2))
    assert steps == [{"step": 1, "server": "p", "tool": "a", "params": {}},
                     {"step": 2, "server": "p", "tool": "b", "params": {"x": 1}}]  # fmt: skip
    with pytest.raises(llm.Unusable) as err:
        llm.decode_steps(two, catalog, spec, GenerateOptions(max_tools=1))
    assert err.value.reason == "too_many_tools"
    with pytest.raises(llm.Unusable) as err:
        llm.decode_steps({**two, "complexity": "hard"}, catalog, spec, GenerateOptions())
    assert err.value.reason == "wrong_call_count"


def test_lookup_path_and_numbers():
    data = {"results": [{"c": 1.5}], "stdout": "42\n", "n": True}
    assert llm.lookup_path(data, "results.0.c") == 1.5
    assert llm.lookup_path(data, "results[0].c") == 1.5
    with pytest.raises(KeyError):
        llm.lookup_path(data, "results.3.c")
    assert llm.as_number(llm.lookup_path(data, "stdout")) == 42.0
    assert llm.as_number(True) is None and llm.as_number("n/a") is None and llm.as_number("nan") is None


def test_no_complexity_fits_max_turns():
    catalog = [llm.ToolInfo("p", "a", "", {})]
    with pytest.raises(GenerationError, match="max_turns"):
        llm.plan_samples(catalog, GenerateOptions(complexities=("hard",), max_turns=3), "llm", "random")


# --------------------------------------------------------------------------- mcp: an external server


async def test_mcp_generator_writes_tasks_only_for_the_external_servers_tools(standin, tmp_path):
    standin.responder = plan_answer
    external = json.dumps([{"name": "notes", "command": [sys.executable, STDIO_SERVER]}])
    cfg = make_cfg(standin.base_url, tmp_path, "responses", ("polygon",), f"tools.external={external}")
    opts = GenerateOptions(n=4, seed=7, servers=("notes",), complexities=("simple",), max_turns=3)
    # No pool given: the generator builds the in-process pool from cfg.tools (and starts the stdio server).
    rows, report = await mcp.generate_with_report(cfg, opts, None)

    assert report.produced == 4 and not report.skipped
    assert [r["extra_info"]["focus_tool"] for r in rows] == ["notes.echo", "notes.add", "notes.sleep", "notes.whoami"]
    for row in rows:
        TaskRow.model_validate(row)
        assert row["data_source"] == "mcprl/mcp" and row["extra_info"]["method"] == "mcp"
        assert {s["server"] for s in row["reward_spec"]["ground_truth"]["tool_sequence"]} == {"notes"}
    add = rows[1]["reward_spec"]["ground_truth"]
    assert add["tool_sequence"] == [{"step": 1, "server": "notes", "tool": "add", "params": {"a": 2, "b": 3}}]
    assert add["success"] == {"must_call_tool": "notes.add"}
    assert add["final_answer"]["value"] == 5  # the stdio server really added them

    for rec in standin.requests:
        schema = schema_of(rec.body)
        item = schema["properties"]["tool_sequence"]["items"]["properties"]
        assert item["server"]["enum"] == ["notes"]
        assert item["tool"]["enum"] == ["add", "echo", "sleep", "whoami"]
        prompt = messages_of(rec.body)[-1]["content"]
        assert "- notes.add: Add two integers." in prompt and "polygon" not in prompt


async def test_mcp_generator_names_unknown_servers(standin, tmp_path, polygon_pool):
    cfg = make_cfg(standin.base_url, tmp_path)
    with pytest.raises(GenerationError, match=r"no MCP server \['nowhere'\].*tools.external"):
        await mcp.generate(cfg, GenerateOptions(n=1, servers=("nowhere",)), polygon_pool)
    assert not standin.requests
