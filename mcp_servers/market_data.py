"""Deterministic simulated market data for the offline polygon, fmp and tavily backends.

One source so the servers agree: polygon's previous close is fmp's profile price, the ratios fmp
reports are computed from the statements it reports and the closes polygon reports, and the pages
tavily finds quote the same numbers. Everything is a pure function of the ticker and a fixed
reference "today" (never the wall clock), drawn from SHA-256 (never Python's salted `hash()`), so a
task's true answer can be computed by calling the tool.

Simplifications, on purpose: trading days are the weekdays (no holidays); fiscal years are calendar
years; a quarter's 10-Q is filed ~5 weeks after its end, a 10-K ~7 weeks after the year's end.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from statistics import NormalDist
from typing import Literal

# Offline "today" (a Friday): the newest daily bar is the day before, 2026-11-19.
REFERENCE_TODAY = date(2026, 11, 20)
# First simulated trading day: enough history for ten fiscal years of prices.
HISTORY_START = date(2016, 1, 4)
FIRST_FISCAL_YEAR = 2016
PeriodName = Literal["annual", "quarter"]


@dataclass(frozen=True)
class Company:
    ticker: str
    name: str
    exchange: Literal["NASDAQ", "NYSE"]
    sector: str
    industry: str
    price: float  # close of the newest bar (the day before REFERENCE_TODAY)
    shares_m: float  # shares outstanding today, millions
    revenue_b: float  # revenue of fiscal 2025, billions USD
    growth: float  # yearly revenue growth
    gross_margin: float
    op_margin: float
    rd_share: float  # share of operating expenses that is R&D
    vol: float  # daily volatility of the close
    beta: float
    employees: int
    ipo: str
    website: str
    dividend: float  # yearly dividend per share today, USD
    about: str  # what the company does (one sentence)


# A fixed universe of real-looking companies; numbers are plausible, not real.
COMPANIES: dict[str, Company] = {
    c.ticker: c
    for c in (
        Company("AAPL", "Apple Inc.", "NASDAQ", "Technology", "Consumer Electronics", 271.35, 14800, 416.0, 0.06,
           0.47, 0.32, 0.55, 0.016, 1.10, 166000, "1980-12-12", "https://www.apple.com", 1.04,
           "designs and sells iPhone, Mac, iPad, wearables and services"),
        Company("MSFT", "Microsoft Corporation", "NASDAQ", "Technology", "Software - Infrastructure", 487.12, 7430,
           282.0, 0.14, 0.69, 0.45, 0.50, 0.015, 0.95, 228000, "1986-03-13", "https://www.microsoft.com", 3.64,
           "develops software, cloud services (Azure), devices and gaming"),
        Company("NVDA", "NVIDIA Corporation", "NASDAQ", "Technology", "Semiconductors", 186.52, 24300, 187.0, 0.45,
           0.72, 0.60, 0.70, 0.030, 1.90, 36000, "1999-01-22", "https://www.nvidia.com", 0.04,
           "designs GPUs and accelerated computing platforms for data centers, gaming and AI"),
        Company("GOOGL", "Alphabet Inc.", "NASDAQ", "Communication Services", "Internet Content & Information", 289.47,
           12100, 400.0, 0.13, 0.59, 0.32, 0.55, 0.018, 1.00, 187000, "2004-08-19", "https://abc.xyz", 0.84,
           "runs Google Search, YouTube, Android and Google Cloud"),
        Company("AMZN", "Amazon.com, Inc.", "NASDAQ", "Consumer Cyclical", "Internet Retail", 226.28, 10700,
           715.0, 0.11, 0.50, 0.11, 0.40, 0.019, 1.15, 1556000, "1997-05-15", "https://www.amazon.com", 0.0,
           "operates online retail, advertising and Amazon Web Services"),
        Company("META", "Meta Platforms, Inc.", "NASDAQ", "Communication Services", "Internet Content & Information",
           612.38, 2520, 198.0, 0.20, 0.82, 0.41, 0.65, 0.024, 1.25, 78000, "2012-05-18",
           "https://about.meta.com", 2.10, "runs Facebook, Instagram, WhatsApp and Reality Labs"),
        Company("TSLA", "Tesla, Inc.", "NASDAQ", "Consumer Cyclical", "Auto - Manufacturers", 401.99, 3320, 95.0, 0.05,
           0.18, 0.06, 0.45, 0.034, 2.10, 125000, "2010-06-29", "https://www.tesla.com", 0.0,
           "makes electric vehicles, batteries and energy storage"),
        Company("AVGO", "Broadcom Inc.", "NASDAQ", "Technology", "Semiconductors", 342.61, 4700, 64.0, 0.25, 0.67,
           0.38, 0.60, 0.027, 1.30, 37000, "2009-08-06", "https://www.broadcom.com", 2.36,
           "designs semiconductors and infrastructure software"),
        Company("AMD", "Advanced Micro Devices, Inc.", "NASDAQ", "Technology", "Semiconductors", 218.09, 1620, 33.0,
           0.30, 0.52, 0.10, 0.60, 0.030, 1.80, 28000, "1972-09-27", "https://www.amd.com", 0.0,
           "designs CPUs, GPUs and adaptive chips for PCs and data centers"),
        Company("NFLX", "Netflix, Inc.", "NASDAQ", "Communication Services", "Entertainment", 112.64, 4250, 45.0, 0.15,
           0.47, 0.29, 0.35, 0.022, 1.30, 14000, "2002-05-23", "https://www.netflix.com", 0.0,
           "streams films and series to subscribers worldwide"),
        Company("JPM", "JPMorgan Chase & Co.", "NYSE", "Financial Services", "Banks - Diversified", 303.55, 2750, 280.0,
           0.05, 0.60, 0.42, 0.05, 0.014, 1.05, 317000, "1980-03-17", "https://www.jpmorganchase.com", 5.80,
           "provides investment banking, consumer banking and asset management"),
        Company("BAC", "Bank of America Corporation", "NYSE", "Financial Services", "Banks - Diversified", 52.18, 7500,
           190.0, 0.04, 0.55, 0.30, 0.05, 0.016, 1.30, 213000, "1973-01-02", "https://www.bankofamerica.com",
           1.08, "provides consumer banking, wealth management and global markets services"),
        Company("V", "Visa Inc.", "NYSE", "Financial Services", "Credit Services", 331.84, 1930, 40.0, 0.11, 0.80,
           0.67, 0.10, 0.013, 0.95, 31600, "2008-03-19", "https://www.visa.com", 2.36,
           "runs a global electronic payments network"),
        Company("UNH", "UnitedHealth Group Incorporated", "NYSE", "Healthcare", "Medical - Healthcare Plans", 327.73,
           905, 430.0, 0.08, 0.20, 0.05, 0.05, 0.018, 0.60, 400000, "1984-10-17",
           "https://www.unitedhealthgroup.com", 8.84, "offers health insurance (UnitedHealthcare) and Optum services"),
        Company("JNJ", "Johnson & Johnson", "NYSE", "Healthcare", "Drug Manufacturers - General", 196.58, 2410, 92.0,
           0.05, 0.68, 0.27, 0.45, 0.011, 0.45, 138000, "1944-09-25", "https://www.jnj.com", 5.20,
           "develops pharmaceuticals and medical technology"),
        Company("PFE", "Pfizer Inc.", "NYSE", "Healthcare", "Drug Manufacturers - General", 25.12, 5690, 63.0, 0.00,
           0.72, 0.25, 0.45, 0.015, 0.55, 81000, "1942-06-22", "https://www.pfizer.com", 1.72,
           "discovers and makes medicines and vaccines"),
        Company("XOM", "Exxon Mobil Corporation", "NYSE", "Energy", "Oil & Gas Integrated", 117.43, 4260, 340.0, 0.01,
           0.30, 0.12, 0.05, 0.015, 0.80, 61000, "1978-01-13", "https://corporate.exxonmobil.com", 4.12,
           "explores for, produces and refines oil and natural gas"),
        Company("WMT", "Walmart Inc.", "NASDAQ", "Consumer Defensive", "Discount Stores", 105.21, 7970, 695.0, 0.05,
           0.25, 0.042, 0.05, 0.011, 0.55, 2100000, "1972-08-25", "https://corporate.walmart.com", 0.94,
           "operates supercenters, discount stores and e-commerce worldwide"),
        Company("KO", "The Coca-Cola Company", "NYSE", "Consumer Defensive", "Beverages - Non-Alcoholic", 70.86, 4300,
           47.5, 0.03, 0.61, 0.30, 0.05, 0.009, 0.45, 69700, "1919-09-05", "https://www.coca-colacompany.com",
           2.04, "makes and markets non-alcoholic beverages"),
        Company("DIS", "The Walt Disney Company", "NYSE", "Communication Services", "Entertainment", 112.37, 1800, 94.0,
           0.04, 0.37, 0.15, 0.10, 0.017, 1.05, 233000, "1957-11-12", "https://thewaltdisneycompany.com", 1.00,
           "runs theme parks, studios, streaming (Disney+) and media networks"),
    )
}  # fmt: skip


def lookup(ticker: str) -> Company | None:
    return COMPANIES.get(ticker.strip().upper())


def unknown_ticker(ticker: str, field: str = "ticker") -> str:
    """The message for a symbol outside the universe: names it and a few valid ones."""
    return f"{field} {ticker!r} is not a known symbol; known symbols include {', '.join(list(COMPANIES)[:8])}, ..."


# --------------------------------------------------------------------------- deterministic draws


def _uniforms(*parts: object) -> list[float]:
    """Five independent uniforms in (0, 1) from one SHA-256 of the parts."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()
    return [(int(digest[i : i + 12], 16) + 0.5) / 16**12 for i in range(0, 60, 12)]


_N = NormalDist()


def _normal(*parts: object) -> float:
    return _N.inv_cdf(_uniforms(*parts)[0])


# --------------------------------------------------------------------------- prices


@dataclass(frozen=True)
class Bar:
    """One daily bar. `t` is the start of the day in New York, in ms since the epoch (like Polygon)."""

    day: date
    o: float
    h: float
    low: float
    c: float
    v: int
    vw: float
    n: int

    @property
    def t(self) -> int:
        return ny_midnight_ms(self.day)


def ny_midnight_ms(day: date) -> int:
    """Midnight America/New_York in epoch ms (US DST rule since 2007; no tz database needed)."""
    march_1, nov_1 = date(day.year, 3, 1), date(day.year, 11, 1)
    dst_start = march_1 + timedelta(days=(6 - march_1.weekday()) % 7 + 7)  # second Sunday of March
    dst_end = nov_1 + timedelta(days=(6 - nov_1.weekday()) % 7)  # first Sunday of November
    offset_h = 4 if dst_start <= day < dst_end else 5
    return int(datetime(day.year, day.month, day.day, offset_h, tzinfo=UTC).timestamp() * 1000)


def trading_days(start: date, end: date) -> list[date]:
    """Weekdays from start to end, both included."""
    return [start + timedelta(days=i) for i in range((end - start).days + 1) if (start + timedelta(i)).weekday() < 5]


@functools.cache
def _bars(ticker: str) -> tuple[Bar, ...]:
    c = COMPANIES[ticker]
    days = trading_days(HISTORY_START, REFERENCE_TODAY - timedelta(days=1))
    # Log price = a trend line ending at the anchor price + a mean-reverting (AR(1)) deviation that is
    # zero on the last day: daily moves of about `vol`, but no wandering off to implausible prices.
    trend = 0.04 + 0.5 * c.growth
    dev = [0.0] * len(days)
    for i in range(1, len(days)):
        dev[i] = 0.995 * dev[i - 1] + c.vol * _normal(ticker, "ret", days[i])
    n = len(days) - 1
    closes = [c.price * math.exp(dev[i] - dev[n] - trend * (n - i) / 252) for i in range(len(days))]
    bars = []
    for i, day in enumerate(days):
        u = _uniforms(ticker, "bar", day)
        prev = closes[i - 1] if i else closes[0]
        o, cl = round(prev * math.exp(0.3 * c.vol * _N.inv_cdf(u[0])), 2), round(closes[i], 2)
        h = round(max(o, cl) * (1 + 0.6 * c.vol * u[1]), 2)
        lo = round(min(o, cl) * (1 - 0.6 * c.vol * u[2]), 2)
        v = int(c.shares_m * 1e6 * 0.004 * math.exp(0.3 * _N.inv_cdf(u[3])))
        bars.append(Bar(day, o, h, lo, cl, v, round((o + h + lo + cl) / 4, 4), max(1, int(v / (60 + 80 * u[4])))))
    return tuple(bars)


def daily_bars(ticker: str, start: date, end: date) -> list[Bar]:
    """Bars with start <= day <= end (empty outside the simulated history)."""
    return [b for b in _bars(ticker) if start <= b.day <= end]


def last_bar(ticker: str) -> Bar:
    """The newest bar: the previous trading day's close as of REFERENCE_TODAY."""
    return _bars(ticker)[-1]


def close_on_or_before(ticker: str, day: date) -> float:
    bars = _bars(ticker)
    best = bars[0]
    for b in bars:
        if b.day > day:
            break
        best = b
    return best.c


def market_cap(ticker: str) -> float:
    c = COMPANIES[ticker]
    return round(last_bar(ticker).c * c.shares_m * 1e6, 2)


# --------------------------------------------------------------------------- fundamentals


@dataclass(frozen=True)
class Period:
    """One fiscal period's simulated filing: income statement lines plus the few balance items ratios need."""

    symbol: str
    fiscal_year: int
    period: str  # "Q1".."Q4" or "FY"
    end: date
    filed: date
    revenue: int
    cost_of_revenue: int
    gross_profit: int
    research_and_development: int
    selling_general_admin: int
    operating_income: int
    interest_expense: int
    pretax_income: int
    income_tax: int
    net_income: int
    ebitda: int
    shares: int  # weighted average diluted shares
    total_equity: int
    current_ratio: float
    debt_to_equity: float
    dividends_per_share: float

    @property
    def operating_expenses(self) -> int:
        return self.research_and_development + self.selling_general_admin

    @property
    def eps(self) -> float:
        return round(self.net_income / self.shares, 2)


_QUARTER_END = {1: (3, 31), 2: (6, 30), 3: (9, 30), 4: (12, 31)}


def _quarter(ticker: str, year: int, q: int) -> Period:
    c = COMPANIES[ticker]
    end = date(year, *_QUARTER_END[q])
    years = (end - date(2025, 6, 30)).days / 365.25  # distance from mid fiscal 2025
    u = [_N.inv_cdf(x) for x in _uniforms(ticker, "quarter", year, q)]
    revenue = int(c.revenue_b * 1e9 / 4 * (1 + c.growth) ** years * (1 + 0.03 * u[0]))
    gm = min(0.95, max(0.05, c.gross_margin + 0.01 * u[1]))
    om = min(gm - 0.02, c.op_margin + 0.015 * u[2])
    gross, operating = round(revenue * gm), round(revenue * om)
    rnd = round((gross - operating) * c.rd_share)
    interest = round(revenue * 0.005)
    pretax = operating - interest
    tax = round(max(pretax, 0) * (0.17 + 0.02 * u[3]))
    shares = int(c.shares_m * 1e6 * (1 - 0.01 * years))  # steady buybacks: more shares in the past
    k = _uniforms(ticker, "balance")  # per-company balance-sheet profile
    ku = _uniforms(ticker, "balance", year, q)
    return Period(
        symbol=ticker, fiscal_year=year, period=f"Q{q}", end=end,
        filed=end + timedelta(days=30 + int(10 * ku[0])),
        revenue=revenue, cost_of_revenue=revenue - gross, gross_profit=gross,
        research_and_development=rnd, selling_general_admin=gross - operating - rnd,
        operating_income=operating, interest_expense=interest, pretax_income=pretax, income_tax=tax,
        net_income=pretax - tax, ebitda=operating + round(revenue * 0.04), shares=shares,
        total_equity=int(4 * revenue * (0.3 + 1.2 * k[0]) * (1 + 0.05 * _N.inv_cdf(ku[1]))),
        current_ratio=round((0.8 + 1.7 * k[1]) * (1 + 0.05 * _N.inv_cdf(ku[2])), 4),
        debt_to_equity=round((0.1 + 1.9 * k[2]) * (1 + 0.05 * _N.inv_cdf(ku[3])), 4),
        dividends_per_share=round(c.dividend / 4 * 1.05**years, 4),
    )  # fmt: skip


def _year(ticker: str, year: int) -> Period:
    qs = [_quarter(ticker, year, q) for q in range(1, 5)]
    q4 = qs[-1]
    total = {f: sum(getattr(p, f) for p in qs) for f in _SUMMED}
    return Period(
        symbol=ticker, fiscal_year=year, period="FY", end=q4.end,
        filed=q4.end + timedelta(days=45 + int(10 * _uniforms(ticker, "10-K", year)[0])),
        shares=round(sum(p.shares for p in qs) / 4), total_equity=q4.total_equity,
        current_ratio=q4.current_ratio, debt_to_equity=q4.debt_to_equity,
        dividends_per_share=round(sum(p.dividends_per_share for p in qs), 4), **total,
    )  # fmt: skip


_SUMMED = (
    "revenue", "cost_of_revenue", "gross_profit", "research_and_development", "selling_general_admin",
    "operating_income", "interest_expense", "pretax_income", "income_tax", "net_income", "ebitda",
)  # fmt: skip


@functools.cache
def _periods(ticker: str, annual: bool) -> tuple[Period, ...]:
    """Filed periods (filed before REFERENCE_TODAY), newest first."""
    last_year = REFERENCE_TODAY.year
    if annual:
        found = [_year(ticker, y) for y in range(FIRST_FISCAL_YEAR, last_year + 1)]
    else:
        found = [_quarter(ticker, y, q) for y in range(FIRST_FISCAL_YEAR, last_year + 1) for q in range(1, 5)]
    return tuple(sorted((p for p in found if p.filed < REFERENCE_TODAY), key=lambda p: p.end, reverse=True))


def statements(ticker: str, period: PeriodName, limit: int) -> list[Period]:
    """The newest `limit` filed periods, newest first."""
    return list(_periods(ticker, period == "annual")[:limit])
