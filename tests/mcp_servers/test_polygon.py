"""The polygon server: offline simulation and the live backend against a local stand-in."""

from __future__ import annotations

from datetime import date, timedelta

import pytest
from fastmcp import Client
from fastmcp.exceptions import ValidationError

from configs.schema import LiveService
from mcp_servers import build_server
from mcp_servers import market_data as md
from mcp_servers.errors import InvalidArguments, Unavailable, UpstreamError

from .standins import HTTP_FAULTS, UNKNOWN, assert_documented, call, closed_port_url, fault

SERVER = "polygon"
CONFIG = LiveService
KEY_ENV = "POLYGON_API_KEY"
KEY = "pk-test-SECRET-7f3a"
TOOLS = {"previous_close", "daily_aggregates", "ticker_details"}


# --------------------------------------------------------------------------- offline


async def test_schemas_are_documented(offline):
    await assert_documented(offline, TOOLS)
    tools = {t.name: t.parameters for t in await offline.list_tools()}
    assert tools["daily_aggregates"]["properties"]["from_date"]["pattern"]


async def test_every_tool_through_the_mcp_client(offline):
    async with Client(offline) as client:
        prev = await client.call_tool("previous_close", {"ticker": "AAPL"})
        bars = await client.call_tool(
            "daily_aggregates", {"ticker": "AAPL", "from_date": "2026-11-02", "to_date": "2026-11-06"}
        )
        details = await client.call_tool("ticker_details", {"ticker": "AAPL"})
        failed = await client.call_tool("previous_close", {"ticker": UNKNOWN}, raise_on_error=False)
    assert prev.structured_content["results"][0]["c"] == md.COMPANIES["AAPL"].price
    assert [b["date"] for b in bars.structured_content["results"]] == [f"2026-11-0{d}" for d in range(2, 7)]
    assert details.structured_content["results"]["name"] == "Apple Inc."
    assert failed.is_error and UNKNOWN in failed.content[0].text


async def test_previous_close_is_the_last_daily_bar_before_today(offline):
    prev = (await call(offline, "previous_close", ticker="msft"))["results"][0]
    bars = await call(offline, "daily_aggregates", ticker="MSFT", from_date="2026-11-01", to_date="2026-12-31")
    last = bars["results"][-1]
    assert prev["date"] == last["date"] == (md.REFERENCE_TODAY - timedelta(days=1)).isoformat()
    assert {k: v for k, v in prev.items() if k != "T"} == last
    assert prev["T"] == bars["ticker"] == "MSFT"
    assert prev["l"] <= min(prev["o"], prev["c"]) <= max(prev["o"], prev["c"]) <= prev["h"]


async def test_daily_bars_are_weekdays_with_new_york_midnight_timestamps(offline):
    bars = await call(offline, "daily_aggregates", ticker="NVDA", from_date="2026-03-01", to_date="2026-03-15")
    days = [date.fromisoformat(b["date"]) for b in bars["results"]]
    assert days == [d for d in (date(2026, 3, 1) + timedelta(i) for i in range(15)) if d.weekday() < 5]
    assert bars["resultsCount"] == len(days) == 10
    by_day = {b["date"]: b["t"] for b in bars["results"]}
    assert by_day["2026-03-06"] == 1772773200000  # 05:00 UTC (EST)
    assert by_day["2026-03-09"] == 1773028800000  # 04:00 UTC (EDT from March 8)


async def test_outputs_are_deterministic_across_fresh_servers():
    a, b = build_server("polygon", LiveService()), build_server("polygon", LiveService())
    for tool, args in [
        ("previous_close", {"ticker": "TSLA"}),
        ("daily_aggregates", {"ticker": "KO", "from_date": "2025-01-01", "to_date": "2025-12-31"}),
        ("ticker_details", {"ticker": "JPM"}),
    ]:
        assert await call(a, tool, **args) == await call(b, tool, **args)


async def test_ranges_outside_the_history_are_empty(offline):
    future = await call(offline, "daily_aggregates", ticker="AAPL", from_date="2026-11-20", to_date="2026-11-30")
    assert future["resultsCount"] == 0 and future["results"] == []
    weekend = await call(offline, "daily_aggregates", ticker="AAPL", from_date="2026-11-14", to_date="2026-11-15")
    assert weekend["results"] == []


async def test_ticker_details_agree_with_the_price(offline):
    details = (await call(offline, "ticker_details", ticker="NVDA"))["results"]
    close = (await call(offline, "previous_close", ticker="NVDA"))["results"][0]["c"]
    assert details["market_cap"] == pytest.approx(close * details["weighted_shares_outstanding"])
    assert details["primary_exchange"] == "XNAS" and details["active"] is True


@pytest.mark.parametrize("tool", sorted(TOOLS))
async def test_unknown_ticker_names_it_and_valid_ones(offline, tool):
    args = {"ticker": "ZZZZ"}
    if tool == "daily_aggregates":
        args |= {"from_date": "2026-11-02", "to_date": "2026-11-06"}
    error = await fault(offline, tool, **args)
    assert isinstance(error, InvalidArguments) and not error.retryable
    assert "'ZZZZ'" in str(error) and "AAPL" in str(error)


@pytest.mark.parametrize(
    ("from_date", "to_date", "field"),
    [
        ("2026-11-10", "2026-11-01", "from_date"),  # from after to
        ("2026-02-30", "2026-03-05", "from_date"),  # no such day
        ("2026-01-01", "2026-13-01", "to_date"),
        ("2024-01-01", "2026-01-01", "to_date"),  # longer than MAX_RANGE_DAYS
    ],
)
async def test_bad_date_ranges_name_the_field(offline, from_date, to_date, field):
    error = await fault(offline, "daily_aggregates", ticker="AAPL", from_date=from_date, to_date=to_date)
    assert isinstance(error, InvalidArguments) and field in str(error)


async def test_schema_violations_are_validation_errors_naming_the_field(offline):
    with pytest.raises(ValidationError, match="from_date"):
        await offline.call_tool(
            "daily_aggregates", {"ticker": "AAPL", "from_date": "11/02/2026", "to_date": "2026-11-06"}
        )
    with pytest.raises(ValidationError, match="ticker"):
        await offline.call_tool("previous_close", {"ticker": "$AAPL"})


# --------------------------------------------------------------------------- live


async def test_live_previous_close_request_and_parsing(live, api):
    result = await call(live, "previous_close", ticker="aapl")
    req = api.last
    assert (req.method, req.path, req.query) == ("GET", "/v2/aggs/ticker/AAPL/prev", {"adjusted": "true"})
    assert req.headers["authorization"] == f"Bearer {KEY}"
    assert result == {
        "ticker": "AAPL", "adjusted": True, "status": "OK", "resultsCount": 1,
        "results": [{"T": "AAPL", "o": 270.35, "h": 272.35, "l": 269.35, "c": 271.35, "v": 1000.0,
                     "vw": 271.35, "n": 10, "t": 1795064400000, "date": "2026-11-19"}],
    }  # fmt: skip


async def test_live_daily_aggregates_request(live, api):
    result = await call(live, "daily_aggregates", ticker="AAPL", from_date="2026-11-18", to_date="2026-11-19")
    req = api.last
    assert req.path == "/v2/aggs/ticker/AAPL/range/1/day/2026-11-18/2026-11-19"
    assert req.query == {"adjusted": "true", "sort": "asc", "limit": "5000"}
    assert [b["date"] for b in result["results"]] == ["2026-11-18", "2026-11-19"]
    assert "request_id" not in result


async def test_live_ticker_details_is_trimmed(live, api):
    result = await call(live, "ticker_details", ticker="AAPL")
    assert api.last.path == "/v3/reference/tickers/AAPL"
    assert result["results"]["name"] == "Apple Inc." and result["results"]["market_cap"] == 4.0e12
    assert not {"branding", "address", "cik", "sic_code"} & set(result["results"])


async def test_live_unknown_ticker_is_invalid_arguments(live):
    assert isinstance(await fault(live, "previous_close", ticker=UNKNOWN), InvalidArguments)
    assert isinstance(await fault(live, "ticker_details", ticker=UNKNOWN), InvalidArguments)


async def test_live_without_key_is_unavailable(api, monkeypatch):
    monkeypatch.delenv("POLYGON_API_KEY", raising=False)
    server = build_server("polygon", LiveService(backend="live", base_url=api.url))  # building needs no key
    api.reset()
    error = await fault(server, "previous_close", ticker="AAPL")
    assert isinstance(error, Unavailable) and "POLYGON_API_KEY" in str(error)
    assert api.requests == []


@pytest.mark.parametrize(("status", "kind", "retryable"), HTTP_FAULTS)
async def test_live_http_failures_map_to_fault_kinds(live, api, status, kind, retryable):
    api.fail_next(status)  # the body echoes the URL and the Authorization header
    error = await fault(live, "ticker_details", ticker="AAPL")
    assert type(error) is kind and error.retryable is retryable
    assert str(status) in str(error) and KEY not in str(error)


async def test_live_network_errors_are_retryable(api, monkeypatch):
    monkeypatch.setenv("POLYGON_API_KEY", KEY)
    refused = build_server("polygon", LiveService(backend="live", base_url=closed_port_url()))
    error = await fault(refused, "previous_close", ticker="AAPL")
    assert isinstance(error, UpstreamError) and error.retryable and KEY not in str(error)

    api.reset()
    api.delay_s = 0.5
    slow = build_server("polygon", LiveService(backend="live", base_url=api.url, http_timeout_s=0.1))
    error = await fault(slow, "previous_close", ticker="AAPL")
    assert isinstance(error, UpstreamError) and error.retryable and "timed out" in str(error)
    api.delay_s = 0.0


async def test_live_and_offline_answers_have_the_same_shape(live, offline):
    def shape(x):
        if isinstance(x, dict):
            return {k: shape(v) for k, v in x.items()}
        if isinstance(x, list):
            return [shape(x[0])] if x else []
        return "number" if isinstance(x, int | float) and not isinstance(x, bool) else type(x).__name__

    for tool, args in [
        ("previous_close", {"ticker": "AAPL"}),
        ("daily_aggregates", {"ticker": "AAPL", "from_date": "2026-11-18", "to_date": "2026-11-19"}),
        ("ticker_details", {"ticker": "AAPL"}),
    ]:
        assert shape(await call(live, tool, **args)) == shape(await call(offline, tool, **args)), tool
