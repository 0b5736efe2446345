"""The tavily server: the offline web (and its agreement with polygon/fmp) and the live backend."""

from __future__ import annotations

import pytest
from fastmcp import Client
from fastmcp.exceptions import ValidationError

from configs.schema import LiveService
from mcp_servers import build_server
from mcp_servers.errors import Unavailable
from mcp_servers.tavily import MAX_RAW_CONTENT

from .standins import HTTP_FAULTS, assert_documented, call, fault

SERVER = "tavily"
CONFIG = LiveService
KEY_ENV = "TAVILY_API_KEY"
KEY = "tvly-test-SECRET-55aa"
TOOLS = {"search", "extract"}


# --------------------------------------------------------------------------- offline


async def test_schemas_are_documented(offline):
    await assert_documented(offline, TOOLS)


async def test_every_tool_through_the_mcp_client(offline):
    async with Client(offline) as client:
        found = await client.call_tool("search", {"query": "Microsoft stock price"})
        url = found.structured_content["results"][0]["url"]
        page = await client.call_tool("extract", {"urls": [url]})
    assert "MSFT" in url
    assert page.structured_content["results"][0]["url"] == url


async def test_search_finds_pages_that_agree_with_polygon(offline):
    result = await call(offline, "search", query="AAPL stock price", max_results=3)
    assert result["query"] == "AAPL stock price" and len(result["results"]) == 3
    top = result["results"][0]
    assert top["url"].endswith("/quote/AAPL") and 0 < top["score"] <= 1
    polygon = build_server("polygon", LiveService())
    close = (await call(polygon, "previous_close", ticker="AAPL"))["results"][0]["c"]
    assert f"${close:.2f}" in top["content"]


async def test_news_topic_returns_dated_news_only(offline):
    result = await call(offline, "search", query="NVIDIA earnings results", topic="news", max_results=5)
    assert result["results"] and all("published_date" in r for r in result["results"])
    top = result["results"][0]
    fmp = build_server("fmp", LiveService())
    latest = (await call(fmp, "income_statement", symbol="NVDA", period="quarter", limit=1))["statements"][0]
    assert "NVIDIA" in top["title"] and top["published_date"] == latest["filingDate"]
    assert f"${latest['revenue'] / 1e9:,.2f} billion" in top["content"]
    general = await call(offline, "search", query="NVIDIA earnings results")
    assert all("published_date" not in r for r in general["results"])


async def test_depth_and_limits(offline):
    basic = await call(offline, "search", query="Apple company profile employees", max_results=1)
    advanced = await call(
        offline, "search", query="Apple company profile employees", max_results=1, search_depth="advanced"
    )
    assert basic["results"][0]["url"] == advanced["results"][0]["url"]
    assert advanced["results"][0]["content"].startswith(basic["results"][0]["content"])
    assert len(basic["results"][0]["content"]) < len(advanced["results"][0]["content"])
    assert (await call(offline, "search", query="zebra quantum")) == {"query": "zebra quantum", "results": []}


async def test_extract_reports_unknown_pages_as_failed(offline):
    url = "https://www.simfinance.example/quote/KO"
    result = await call(offline, "extract", urls=[url, "https://nowhere.example/x"])
    assert [r["url"] for r in result["results"]] == [url]
    assert "Recent closes" in result["results"][0]["raw_content"]
    assert result["failed_results"] == [{"url": "https://nowhere.example/x", "error": "Failed to fetch url"}]


async def test_outputs_are_deterministic_across_fresh_servers():
    a, b = build_server("tavily", LiveService()), build_server("tavily", LiveService())
    for tool, args in [
        ("search", {"query": "bank earnings", "max_results": 10, "topic": "news"}),
        ("search", {"query": "semiconductors market cap", "search_depth": "advanced"}),
        ("extract", {"urls": ["https://www.simfinance.example/company/JPM"]}),
    ]:
        assert await call(a, tool, **args) == await call(b, tool, **args)


async def test_schema_violations_name_the_field(offline):
    with pytest.raises(ValidationError, match="max_results"):
        await offline.call_tool("search", {"query": "x", "max_results": 50})
    with pytest.raises(ValidationError, match="topic"):
        await offline.call_tool("search", {"query": "x", "topic": "finance-ish"})
    with pytest.raises(ValidationError, match="urls"):
        await offline.call_tool("extract", {"urls": []})
    with pytest.raises(ValidationError, match="urls"):
        await offline.call_tool("extract", {"urls": ["ftp://x"]})


# --------------------------------------------------------------------------- live


async def test_live_search_request_and_trimming(live, api):
    result = await call(live, "search", query="apple stock", max_results=3, topic="news", search_depth="advanced")
    req = api.last
    assert (req.method, req.path) == ("POST", "/search")
    assert req.headers["authorization"] == f"Bearer {KEY}" and req.query == {}
    assert req.body == {"query": "apple stock", "max_results": 3, "topic": "news", "search_depth": "advanced"}
    assert result == {
        "query": "apple stock",
        "results": [{"title": "Apple stock", "url": "https://news.example/aapl", "content": "AAPL rose.",
                     "score": 0.91, "published_date": "Thu, 19 Nov 2026 21:00:00 GMT"}],
    }  # fmt: skip


async def test_live_extract_request_and_truncation(live, api):
    result = await call(live, "extract", urls=["https://a.example/1", "https://a.example/fail"])
    req = api.last
    assert (req.method, req.path, req.body) == (
        "POST",
        "/extract",
        {"urls": ["https://a.example/1", "https://a.example/fail"]},
    )
    assert [len(r["raw_content"]) for r in result["results"]] == [MAX_RAW_CONTENT]
    assert result["failed_results"] == [{"url": "https://a.example/fail", "error": "timeout"}]


async def test_live_without_key_is_unavailable(api, monkeypatch):
    monkeypatch.delenv("TAVILY_API_KEY", raising=False)
    server = build_server("tavily", LiveService(backend="live", base_url=api.url))
    api.reset()
    error = await fault(server, "search", query="x")
    assert isinstance(error, Unavailable) and "TAVILY_API_KEY" in str(error)
    assert api.requests == []


@pytest.mark.parametrize(("status", "kind", "retryable"), HTTP_FAULTS)
async def test_live_http_failures_map_to_fault_kinds(live, api, status, kind, retryable):
    api.fail_next(status)
    error = await fault(live, "search", query="x")
    assert type(error) is kind and error.retryable is retryable and KEY not in str(error)


async def test_live_and_offline_answers_have_the_same_keys(live, offline):
    for args in [{"query": "apple stock"}, {"query": "apple stock", "topic": "news"}]:
        live_answer, offline_answer = await call(live, "search", **args), await call(offline, "search", **args)
        assert live_answer.keys() == offline_answer.keys()
        assert live_answer["results"][0].keys() == offline_answer["results"][0].keys(), args
    live_pages = await call(live, "extract", urls=["https://www.simfinance.example/quote/KO"])
    offline_pages = await call(offline, "extract", urls=["https://www.simfinance.example/quote/KO"])
    assert live_pages.keys() == offline_pages.keys()
    assert live_pages["results"][0].keys() == offline_pages["results"][0].keys()
