"""The fmp server: offline simulation (and its agreement with polygon) and the live backend."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import date

import pytest
from fastmcp import Client
from fastmcp.exceptions import ValidationError

from configs.schema import LiveService
from mcp_servers import build_server
from mcp_servers.errors import InvalidArguments, Unavailable, UpstreamError
from tests.conftest import library_logs

from .standins import HTTP_FAULTS, UNKNOWN, assert_documented, call, fault


@pytest.fixture
def loud_logs() -> Iterator[None]:
    with library_logs("httpx", "fastmcp"):  # what these tests check is that such a log never holds the key
        yield


SERVER = "fmp"
CONFIG = LiveService
KEY_ENV = "FMP_API_KEY"
KEY = "fmp-test-SECRET-91c2"
TOOLS = {"company_profile", "income_statement", "key_ratios"}


# --------------------------------------------------------------------------- offline


async def test_schemas_are_documented(offline):
    await assert_documented(offline, TOOLS)


async def test_every_tool_through_the_mcp_client(offline):
    async with Client(offline) as client:
        profile = await client.call_tool("company_profile", {"symbol": "AAPL"})
        income = await client.call_tool("income_statement", {"symbol": "AAPL", "period": "quarter", "limit": 2})
        ratios = await client.call_tool("key_ratios", {"symbol": "AAPL"})
    assert profile.structured_content["companyName"] == "Apple Inc."
    assert [s["period"] for s in income.structured_content["statements"]] == ["Q3", "Q2"]
    assert len(ratios.structured_content["ratios"]) == 5


async def test_outputs_are_deterministic_across_fresh_servers():
    a, b = build_server("fmp", LiveService()), build_server("fmp", LiveService())
    for tool, args in [
        ("company_profile", {"symbol": "META"}),
        ("income_statement", {"symbol": "KO", "period": "quarter", "limit": 8}),
        ("key_ratios", {"symbol": "XOM", "period": "annual", "limit": 10}),
    ]:
        assert await call(a, tool, **args) == await call(b, tool, **args)


async def test_statements_are_filed_before_today_newest_first(offline):
    annual = (await call(offline, "income_statement", symbol="NVDA", limit=20))["statements"]
    assert [s["fiscalYear"] for s in annual] == [str(y) for y in range(2025, 2015, -1)]  # FY2026 not filed yet
    quarters = (await call(offline, "income_statement", symbol="NVDA", period="quarter", limit=20))["statements"]
    assert (quarters[0]["fiscalYear"], quarters[0]["period"]) == ("2026", "Q3")
    assert all(s["filingDate"] < "2026-11-20" for s in annual + quarters)
    assert [s["date"] for s in quarters] == sorted((s["date"] for s in quarters), reverse=True)


async def test_statement_lines_add_up_and_years_sum_their_quarters(offline):
    annual = (await call(offline, "income_statement", symbol="AAPL", limit=1))["statements"][0]
    quarters = (await call(offline, "income_statement", symbol="AAPL", period="quarter", limit=12))["statements"]
    fy = [q for q in quarters if q["fiscalYear"] == annual["fiscalYear"]]
    assert len(fy) == 4
    for field in ("revenue", "grossProfit", "operatingIncome", "netIncome"):
        assert annual[field] == sum(q[field] for q in fy)
    for s in [annual, *fy]:
        assert s["grossProfit"] == s["revenue"] - s["costOfRevenue"]
        assert s["operatingIncome"] == s["grossProfit"] - s["operatingExpenses"]
        assert s["netIncome"] == s["incomeBeforeTax"] - s["incomeTaxExpense"]
        assert s["eps"] == round(s["netIncome"] / s["weightedAverageShsOut"], 2)


async def test_ratios_agree_with_statements_and_polygon_prices(offline):
    polygon = build_server("polygon", LiveService())
    statements = (await call(offline, "income_statement", symbol="MSFT", period="quarter", limit=3))["statements"]
    ratios = (await call(offline, "key_ratios", symbol="MSFT", period="quarter", limit=3))["ratios"]
    for s, r in zip(statements, ratios, strict=True):
        assert (r["date"], r["period"], r["fiscalYear"]) == (s["date"], s["period"], s["fiscalYear"])
        assert r["grossProfitMargin"] == round(s["grossProfit"] / s["revenue"], 4)
        assert r["netProfitMargin"] == round(s["netIncome"] / s["revenue"], 4)
        assert r["netIncomePerShare"] == round(s["netIncome"] / s["weightedAverageShsOut"], 4)
        end = date.fromisoformat(s["date"])
        bars = await call(polygon, "daily_aggregates", ticker="MSFT", from_date=f"{end.year}-01-01", to_date=s["date"])
        price = bars["results"][-1]["c"]  # the close on or before the period's end
        assert r["priceToEarningsRatio"] == round(price * s["weightedAverageShsOut"] / s["netIncome"], 4)
        assert r["priceToSalesRatio"] == round(price * s["weightedAverageShsOut"] / s["revenue"], 4)


async def test_profile_agrees_with_polygon(offline):
    polygon = build_server("polygon", LiveService())
    profile = await call(offline, "company_profile", symbol="nvda")
    prev = (await call(polygon, "previous_close", ticker="NVDA"))["results"][0]
    details = (await call(polygon, "ticker_details", ticker="NVDA"))["results"]
    assert profile["price"] == prev["c"] and profile["volume"] == prev["v"]
    assert profile["marketCap"] == details["market_cap"]
    assert profile["companyName"] == details["name"]
    low, high = map(float, profile["range"].split("-"))
    assert low <= profile["price"] <= high


@pytest.mark.parametrize("tool", sorted(TOOLS))
async def test_unknown_symbol_names_it_and_valid_ones(offline, tool):
    error = await fault(offline, tool, symbol="ZZZZ")
    assert isinstance(error, InvalidArguments)
    assert "symbol 'ZZZZ'" in str(error) and "AAPL" in str(error)


async def test_schema_violations_name_the_field(offline):
    with pytest.raises(ValidationError, match="period"):
        await offline.call_tool("income_statement", {"symbol": "AAPL", "period": "monthly"})
    with pytest.raises(ValidationError, match="limit"):
        await offline.call_tool("key_ratios", {"symbol": "AAPL", "limit": 0})


# --------------------------------------------------------------------------- live


async def test_live_profile_request_and_trimming(live, api):
    result = await call(live, "company_profile", symbol="aapl")
    req = api.last
    assert (req.method, req.path, req.query) == ("GET", "/stable/profile", {"symbol": "AAPL", "apikey": KEY})
    assert "authorization" not in req.headers
    assert result["companyName"] == "Apple Inc." and result["price"] == 271.35
    assert not {"cik", "isin", "image", "phone"} & set(result)


@pytest.mark.parametrize(("tool", "path", "key"), [
    ("income_statement", "/stable/income-statement", "statements"),
    ("key_ratios", "/stable/ratios", "ratios"),
])  # fmt: skip
async def test_live_period_endpoints(live, api, tool, path, key):
    result = await call(live, tool, symbol="AAPL", period="quarter", limit=3)
    req = api.last
    assert req.path == path
    assert req.query == {"symbol": "AAPL", "period": "quarter", "limit": "3", "apikey": KEY}
    assert result["symbol"] == "AAPL" and result["period"] == "quarter"
    rows = result[key]
    assert len(rows) == 3 and rows[0]["fiscalYear"] == "2025"
    assert not {"link", "finalLink", "cik"} & set(rows[0])


async def test_live_unknown_symbol_is_invalid_arguments(live):
    error = await fault(live, "company_profile", symbol=UNKNOWN)
    assert isinstance(error, InvalidArguments) and UNKNOWN in str(error)


async def test_live_without_key_is_unavailable(api, monkeypatch):
    monkeypatch.delenv("FMP_API_KEY", raising=False)
    server = build_server("fmp", LiveService(backend="live", base_url=api.url))
    api.reset()
    error = await fault(server, "key_ratios", symbol="AAPL")
    assert isinstance(error, Unavailable) and "FMP_API_KEY" in str(error)
    assert api.requests == []


@pytest.mark.parametrize(("status", "kind", "retryable"), HTTP_FAULTS)
async def test_live_http_failures_never_leak_the_query_key(live, api, status, kind, retryable):
    api.fail_next(status)  # the body echoes the URL, whose query holds apikey=KEY
    error = await fault(live, "company_profile", symbol="AAPL")
    assert type(error) is kind and error.retryable is retryable
    assert KEY not in str(error) and KEY in api.last.url


async def test_httpx_request_logs_are_redacted(live, caplog, loud_logs):
    caplog.set_level(logging.INFO, logger="httpx")
    await call(live, "company_profile", symbol="AAPL")
    assert "/stable/profile" in caplog.text
    assert KEY not in caplog.text and "apikey=***" in caplog.text


async def test_live_error_object_instead_of_rows_is_an_upstream_error(live, api):
    api.reply_next(200, {"Error Message": "Limit Reach. Please upgrade your plan."})
    error = await fault(live, "income_statement", symbol="AAPL")
    assert type(error) is UpstreamError and not error.retryable and "Limit Reach" in str(error)


async def test_failure_logs_never_hold_the_key(live, api, caplog, capfd, loud_logs):
    caplog.set_level(logging.DEBUG)
    # vLLM, once imported, raises httpx's level; its URL log (with the key) is the risk under test
    caplog.set_level(logging.DEBUG, logger="httpx")
    api.fail_next(500)  # the body echoes the URL with apikey=KEY
    await fault(live, "company_profile", symbol="AAPL")
    fastmcp_log = capfd.readouterr().err  # FastMCP logs tool failures (with traceback) to stderr, not to root
    assert "Error calling tool" in fastmcp_log and "/stable/profile" in caplog.text
    assert KEY not in caplog.text and KEY not in fastmcp_log
