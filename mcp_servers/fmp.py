"""Financial Modeling Prep fundamentals: company profile, income statements, financial ratios.

Live: FMP's *stable* API (`/stable/profile`, `/stable/income-statement`, `/stable/ratios`, each with
`?symbol=`), key FMP_API_KEY sent as the `apikey` query parameter (the one way FMP documents;
`http_api` redacts it from messages and httpx's logs). Offline: the simulated market of
`market_data`: the profile price is polygon's previous close, and every ratio is computed from the
statement of the same period and the close on or before its end (quarter ratios use that quarter's
figures, not trailing twelve months, as FMP does). Both return FMP's field names, trimmed; the
statement and ratio lists come wrapped in an object with the symbol and period, newest first.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any, Protocol

from fastmcp import FastMCP
from pydantic import Field

from configs.schema import LiveService
from mcp_servers import market_data as md
from mcp_servers.errors import InvalidArguments
from mcp_servers.http_api import HttpApi
from mcp_servers.mirror import mirror_server

DEFAULT_BASE_URL = "https://financialmodelingprep.com"

Symbol = Annotated[
    str,
    Field(
        description="Stock ticker symbol, e.g. AAPL (case-insensitive).",
        min_length=1,
        max_length=12,
        pattern=r"^[A-Za-z][A-Za-z0-9.\-]*$",
    ),
]
PeriodArg = Annotated[
    md.PeriodName, Field(description="annual = fiscal years (FY); quarter = fiscal quarters (Q1-Q4).")
]
Limit = Annotated[int, Field(ge=1, le=20, description="How many periods to return, newest first (1-20).")]

PROFILE_FIELDS = (
    "symbol", "companyName", "price", "marketCap", "beta", "change", "changePercentage", "volume",
    "averageVolume", "range", "currency", "exchange", "exchangeFullName", "sector", "industry", "country",
    "fullTimeEmployees", "website", "description", "ipoDate", "isEtf", "isActivelyTrading",
)  # fmt: skip
STATEMENT_FIELDS = (
    "date", "symbol", "reportedCurrency", "fiscalYear", "period", "filingDate", "revenue", "costOfRevenue",
    "grossProfit", "researchAndDevelopmentExpenses", "sellingGeneralAndAdministrativeExpenses",
    "operatingExpenses", "operatingIncome", "interestExpense", "incomeBeforeTax", "incomeTaxExpense",
    "netIncome", "ebitda", "eps", "epsDiluted", "weightedAverageShsOut", "weightedAverageShsOutDil",
)  # fmt: skip
RATIO_FIELDS = (
    "date", "symbol", "fiscalYear", "period", "reportedCurrency", "grossProfitMargin", "operatingProfitMargin",
    "netProfitMargin", "ebitdaMargin", "effectiveTaxRate", "currentRatio", "debtToEquityRatio",
    "priceToEarningsRatio", "priceToSalesRatio", "priceToBookRatio", "dividendYield", "dividendPerShare",
    "revenuePerShare", "netIncomePerShare", "bookValuePerShare",
)  # fmt: skip


def _trim(row: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {k: row[k] for k in fields if k in row}


class Backend(Protocol):
    async def company_profile(self, symbol: str) -> dict[str, Any]: ...
    async def income_statement(self, symbol: str, period: md.PeriodName, limit: int) -> list[dict[str, Any]]: ...
    async def key_ratios(self, symbol: str, period: md.PeriodName, limit: int) -> list[dict[str, Any]]: ...


def statement_json(p: md.Period) -> dict[str, Any]:
    """A simulated period in FMP's income-statement shape."""
    return {
        "date": p.end.isoformat(), "symbol": p.symbol, "reportedCurrency": "USD",
        "fiscalYear": str(p.fiscal_year), "period": p.period, "filingDate": p.filed.isoformat(),
        "revenue": p.revenue, "costOfRevenue": p.cost_of_revenue, "grossProfit": p.gross_profit,
        "researchAndDevelopmentExpenses": p.research_and_development,
        "sellingGeneralAndAdministrativeExpenses": p.selling_general_admin,
        "operatingExpenses": p.operating_expenses, "operatingIncome": p.operating_income,
        "interestExpense": p.interest_expense, "incomeBeforeTax": p.pretax_income,
        "incomeTaxExpense": p.income_tax, "netIncome": p.net_income, "ebitda": p.ebitda,
        "eps": p.eps, "epsDiluted": p.eps, "weightedAverageShsOut": p.shares, "weightedAverageShsOutDil": p.shares,
    }  # fmt: skip


def ratios_json(p: md.Period) -> dict[str, Any]:
    """FMP's ratios for a simulated period, from its statement and the close on or before its end."""
    price = md.close_on_or_before(p.symbol, p.end)
    cap = price * p.shares

    def r(x: float) -> float:
        return round(x, 4)

    return {
        "date": p.end.isoformat(), "symbol": p.symbol, "fiscalYear": str(p.fiscal_year), "period": p.period,
        "reportedCurrency": "USD",
        "grossProfitMargin": r(p.gross_profit / p.revenue),
        "operatingProfitMargin": r(p.operating_income / p.revenue),
        "netProfitMargin": r(p.net_income / p.revenue),
        "ebitdaMargin": r(p.ebitda / p.revenue),
        "effectiveTaxRate": r(p.income_tax / p.pretax_income) if p.pretax_income > 0 else 0.0,
        "currentRatio": p.current_ratio, "debtToEquityRatio": p.debt_to_equity,
        "priceToEarningsRatio": r(cap / p.net_income) if p.net_income else 0.0,
        "priceToSalesRatio": r(cap / p.revenue),
        "priceToBookRatio": r(cap / p.total_equity),
        "dividendYield": r(p.dividends_per_share / price),
        "dividendPerShare": p.dividends_per_share,
        "revenuePerShare": r(p.revenue / p.shares),
        "netIncomePerShare": r(p.net_income / p.shares),
        "bookValuePerShare": r(p.total_equity / p.shares),
    }  # fmt: skip


class Offline:
    def _company(self, symbol: str) -> md.Company:
        company = md.lookup(symbol)
        if company is None:
            raise InvalidArguments(md.unknown_ticker(symbol, "symbol"))
        return company

    async def company_profile(self, symbol: str) -> dict[str, Any]:
        c = self._company(symbol)
        year = md.daily_bars(c.ticker, md.REFERENCE_TODAY - timedelta(days=365), md.REFERENCE_TODAY)
        last, prev = year[-1], year[-2]
        return {
            "symbol": c.ticker, "companyName": c.name, "price": last.c, "marketCap": md.market_cap(c.ticker),
            "beta": c.beta, "change": round(last.c - prev.c, 2),
            "changePercentage": round((last.c / prev.c - 1) * 100, 4), "volume": last.v,
            "averageVolume": round(sum(b.v for b in year[-63:]) / len(year[-63:])),
            "range": f"{min(b.low for b in year)}-{max(b.h for b in year)}", "currency": "USD",
            "exchange": c.exchange,
            "exchangeFullName": {"NASDAQ": "NASDAQ Global Select", "NYSE": "New York Stock Exchange"}[c.exchange],
            "sector": c.sector, "industry": c.industry, "country": "US", "fullTimeEmployees": str(c.employees),
            "website": c.website, "description": f"{c.name} {c.about}.", "ipoDate": c.ipo,
            "isEtf": False, "isActivelyTrading": True,
        }  # fmt: skip

    async def income_statement(self, symbol: str, period: md.PeriodName, limit: int) -> list[dict[str, Any]]:
        c = self._company(symbol)
        return [statement_json(p) for p in md.statements(c.ticker, period, limit)]

    async def key_ratios(self, symbol: str, period: md.PeriodName, limit: int) -> list[dict[str, Any]]:
        c = self._company(symbol)
        return [ratios_json(p) for p in md.statements(c.ticker, period, limit)]


class Live:
    def __init__(self, cfg: LiveService) -> None:
        self.api = HttpApi("fmp", cfg.base_url or DEFAULT_BASE_URL, "FMP_API_KEY", cfg.http_timeout_s, "apikey")

    async def _rows(self, path: str, symbol: str, **params: Any) -> list[dict[str, Any]]:
        rows = await self.api.call("GET", path, params={"symbol": symbol, **params}, expect=list)
        if not rows:  # FMP answers an unknown symbol with an empty list
            raise InvalidArguments(f"FMP has no data at {path} for symbol {symbol!r}; check the symbol")
        return rows

    async def company_profile(self, symbol: str) -> dict[str, Any]:
        return _trim((await self._rows("/stable/profile", symbol))[0], PROFILE_FIELDS)

    async def income_statement(self, symbol: str, period: md.PeriodName, limit: int) -> list[dict[str, Any]]:
        rows = await self._rows("/stable/income-statement", symbol, period=period, limit=limit)
        return [_trim(row, STATEMENT_FIELDS) for row in rows[:limit]]

    async def key_ratios(self, symbol: str, period: md.PeriodName, limit: int) -> list[dict[str, Any]]:
        rows = await self._rows("/stable/ratios", symbol, period=period, limit=limit)
        return [_trim(row, RATIO_FIELDS) for row in rows[:limit]]


def build(cfg: LiveService | None = None) -> FastMCP:
    mcp, backend, read_only = mirror_server(
        "fmp",
        "Company fundamentals from Financial Modeling Prep: profile, income statements, ratios.",
        cfg,
        Live,
        Offline,
    )

    @mcp.tool(annotations=read_only)
    async def company_profile(symbol: Symbol) -> dict[str, Any]:
        """A company's profile: name, latest price and change, market cap, beta, 52-week range, volume,
        exchange, sector, industry, employees, website, description and IPO date."""
        return await backend.company_profile(symbol.upper())

    @mcp.tool(annotations=read_only)
    async def income_statement(symbol: Symbol, period: PeriodArg = "annual", limit: Limit = 5) -> dict[str, Any]:
        """Income statements, newest first: revenue, cost of revenue, gross profit, R&D, SG&A, operating
        income, interest, pre-tax income, tax, net income, EBITDA, EPS and share counts (amounts in USD)."""
        rows = await backend.income_statement(symbol.upper(), period, limit)
        return {"symbol": symbol.upper(), "period": period, "statements": rows}

    @mcp.tool(annotations=read_only)
    async def key_ratios(symbol: Symbol, period: PeriodArg = "annual", limit: Limit = 5) -> dict[str, Any]:
        """Financial ratios per period, newest first: margins (fractions, 0.25 = 25%), effective tax rate,
        current ratio, debt/equity, P/E, P/S, P/B (at the period-end price), dividend yield and per-share values."""
        rows = await backend.key_ratios(symbol.upper(), period, limit)
        return {"symbol": symbol.upper(), "period": period, "ratios": rows}

    return mcp
