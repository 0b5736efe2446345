"""Polygon.io stock data: previous close, daily bars, ticker details.

Live: Polygon's REST API (`/v2/aggs/ticker/{t}/prev`, `/v2/aggs/ticker/{t}/range/1/day/{from}/{to}`,
`/v3/reference/tickers/{t}`), key POLYGON_API_KEY sent as a bearer token. Offline: the simulated
market of `market_data` as of its fixed reference day. Both return Polygon's response shape trimmed
to the useful fields, plus a `date` (YYYY-MM-DD, New York) on every bar, which Polygon only gives
as the epoch-ms `t`.
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Annotated, Any, Protocol

from fastmcp import FastMCP
from pydantic import Field

from configs.schema import LiveService
from mcp_servers import market_data as md
from mcp_servers.errors import InvalidArguments
from mcp_servers.http_api import HttpApi
from mcp_servers.mirror import mirror_server

DEFAULT_BASE_URL = "https://api.polygon.io"
MAX_RANGE_DAYS = 366  # one call returns at most about a year of daily bars (keeps observations short)

Ticker = Annotated[
    str,
    Field(
        description="Stock ticker symbol, e.g. AAPL or BRK.B (case-insensitive).",
        min_length=1,
        max_length=12,
        pattern=r"^[A-Za-z][A-Za-z0-9.\-]*$",
    ),
]
_DAY = r"^\d{4}-\d{2}-\d{2}$"
FromDate = Annotated[str, Field(pattern=_DAY, description="First day of the range, YYYY-MM-DD (included).")]
ToDate = Annotated[
    str,
    Field(pattern=_DAY, description=f"Last day, YYYY-MM-DD (included); at most {MAX_RANGE_DAYS} days after from_date."),
]
BAR_FIELDS = ("o", "h", "l", "c", "v", "vw", "n", "t")


class Backend(Protocol):
    async def previous_close(self, ticker: str) -> dict[str, Any]: ...
    async def daily_aggregates(self, ticker: str, start: date, end: date) -> dict[str, Any]: ...
    async def ticker_details(self, ticker: str) -> dict[str, Any]: ...


def _bar_json(bar: dict[str, Any]) -> dict[str, Any]:
    out = {k: bar[k] for k in ("T", *BAR_FIELDS) if k in bar}
    if "t" in bar:  # Polygon's daily `t` is midnight New York, which is the same UTC calendar day
        out["date"] = datetime.fromtimestamp(bar["t"] / 1000, UTC).date().isoformat()
    return out


def _aggs_json(payload: dict[str, Any]) -> dict[str, Any]:
    results = [_bar_json(b) for b in payload.get("results") or []]
    return {
        "ticker": payload.get("ticker"),
        "adjusted": payload.get("adjusted", True),
        "status": payload.get("status", "OK"),
        "resultsCount": len(results),
        "results": results,
    }


DETAIL_FIELDS = (
    "ticker", "name", "market", "locale", "primary_exchange", "type", "active", "currency_name",
    "description", "homepage_url", "list_date", "market_cap", "share_class_shares_outstanding",
    "weighted_shares_outstanding", "total_employees",
)  # fmt: skip


class Offline:
    """The simulated market (see market_data): weekdays up to the day before its reference day."""

    def _company(self, ticker: str) -> md.Company:
        company = md.lookup(ticker)
        if company is None:
            raise InvalidArguments(md.unknown_ticker(ticker))
        return company

    @staticmethod
    def _bar(b: md.Bar, **extra: str) -> dict[str, Any]:
        return _bar_json({**extra, "o": b.o, "h": b.h, "l": b.low, "c": b.c, "v": b.v, "vw": b.vw, "n": b.n, "t": b.t})

    async def previous_close(self, ticker: str) -> dict[str, Any]:
        c = self._company(ticker)
        return _aggs_json({"ticker": c.ticker, "results": [self._bar(md.last_bar(c.ticker), T=c.ticker)]})

    async def daily_aggregates(self, ticker: str, start: date, end: date) -> dict[str, Any]:
        c = self._company(ticker)  # range bars carry no per-bar ticker `T` in Polygon's answer
        return _aggs_json({"ticker": c.ticker, "results": [self._bar(b) for b in md.daily_bars(c.ticker, start, end)]})

    async def ticker_details(self, ticker: str) -> dict[str, Any]:
        c = self._company(ticker)
        shares = int(c.shares_m * 1e6)
        return {
            "status": "OK",
            "results": {
                "ticker": c.ticker,
                "name": c.name,
                "market": "stocks",
                "locale": "us",
                "primary_exchange": {"NASDAQ": "XNAS", "NYSE": "XNYS"}[c.exchange],
                "type": "CS",
                "active": True,
                "currency_name": "usd",
                "description": f"{c.name} {c.about}.",
                "homepage_url": c.website,
                "list_date": c.ipo,
                "market_cap": md.market_cap(c.ticker),
                "share_class_shares_outstanding": shares,
                "weighted_shares_outstanding": shares,
                "total_employees": c.employees,
            },
        }


class Live:
    def __init__(self, cfg: LiveService) -> None:
        self.api = HttpApi("polygon", cfg.base_url or DEFAULT_BASE_URL, "POLYGON_API_KEY", cfg.http_timeout_s)

    async def previous_close(self, ticker: str) -> dict[str, Any]:
        payload = await self.api.call("GET", f"/v2/aggs/ticker/{ticker}/prev", params={"adjusted": "true"})
        if not payload.get("results"):
            raise InvalidArguments(f"Polygon has no previous close for ticker {ticker!r}; check the symbol")
        return _aggs_json(payload)

    async def daily_aggregates(self, ticker: str, start: date, end: date) -> dict[str, Any]:
        path = f"/v2/aggs/ticker/{ticker}/range/1/day/{start.isoformat()}/{end.isoformat()}"
        params = {"adjusted": "true", "sort": "asc", "limit": 5000}
        return _aggs_json(await self.api.call("GET", path, params=params))

    async def ticker_details(self, ticker: str) -> dict[str, Any]:
        payload = await self.api.call(
            "GET", f"/v3/reference/tickers/{ticker}", not_found=f"Polygon knows no ticker {ticker!r}"
        )
        results = payload.get("results") or {}
        return {
            "status": payload.get("status", "OK"),
            "results": {k: results[k] for k in DETAIL_FIELDS if k in results},
        }


def _parse_day(value: str, field: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise InvalidArguments(f"{field} {value!r} is not a valid date (YYYY-MM-DD)") from None


def build(cfg: LiveService | None = None) -> FastMCP:
    mcp, backend, read_only = mirror_server(
        "polygon", "US stock prices from Polygon.io: previous close, daily bars, company details.", cfg, Live, Offline
    )

    @mcp.tool(annotations=read_only)
    async def previous_close(ticker: Ticker) -> dict[str, Any]:
        """The previous trading day's bar for a stock: open (o), high (h), low (l), close (c), volume (v),
        volume-weighted average price (vw), number of trades (n), start time in epoch ms (t) and its date."""
        return await backend.previous_close(ticker.upper())

    @mcp.tool(annotations=read_only)
    async def daily_aggregates(
        ticker: Ticker,
        from_date: FromDate,
        to_date: ToDate,
    ) -> dict[str, Any]:
        """Daily bars (o, h, l, c, v, vw, n, t, date) of a stock for each trading day in a date range, oldest first."""
        start, end = _parse_day(from_date, "from_date"), _parse_day(to_date, "to_date")
        if start > end:
            raise InvalidArguments(f"from_date {from_date} is after to_date {to_date}")
        if (end - start).days > MAX_RANGE_DAYS:
            raise InvalidArguments(f"to_date is {(end - start).days} days after from_date; at most {MAX_RANGE_DAYS}")
        return await backend.daily_aggregates(ticker.upper(), start, end)

    @mcp.tool(annotations=read_only)
    async def ticker_details(ticker: Ticker) -> dict[str, Any]:
        """Reference data for a stock: company name, exchange, description, website, listing date, market cap,
        shares outstanding and employees."""
        return await backend.ticker_details(ticker.upper())

    return mcp
