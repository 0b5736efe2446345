"""Tavily web search and page extraction.

Live: `POST https://api.tavily.com/search` and `/extract` with a JSON body, key TAVILY_API_KEY sent as
a bearer token. Offline: a small fixed web of pages built from `market_data` (a quote page, a
profile page, an earnings story and a weekly market story per company, plus a few explainers),
ranked by word overlap with the query, so what a search finds agrees with polygon and fmp. Both
return Tavily's shape, trimmed: search → {query, results: [{title, url, content, score,
published_date?}]}; extract → {results: [{url, raw_content}], failed_results: [{url, error}]}.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Annotated, Any, Literal, Protocol

from fastmcp import FastMCP
from pydantic import Field

from configs.schema import LiveService
from mcp_servers import market_data as md
from mcp_servers.http_api import HttpApi
from mcp_servers.mirror import mirror_server

DEFAULT_BASE_URL = "https://api.tavily.com"
MAX_RAW_CONTENT = 6000  # characters of an extracted page kept (observations must stay short)
_SENTENCE_END = re.compile(r"(?<=[a-z0-9%)]\.)\s+(?=[A-Z])")  # not after "Inc." in "Apple Inc. (AAPL)"

Topic = Literal["general", "news"]
Depth = Literal["basic", "advanced"]
Url = Annotated[str, Field(pattern=r"^https?://\S+$", max_length=2048)]


class Backend(Protocol):
    async def search(self, query: str, max_results: int, topic: Topic, depth: Depth) -> dict[str, Any]: ...
    async def extract(self, urls: list[str]) -> dict[str, Any]: ...


# --------------------------------------------------------------------------- offline web


@dataclass(frozen=True)
class Page:
    url: str
    title: str
    content: str  # the summary search returns
    body: str  # the full text extract returns
    published: date | None = None  # news pages only


def _money(x: float) -> str:
    return f"${x / 1e9:,.2f} billion"


def _long(day: date) -> str:
    return f"{day:%B} {day.day}, {day.year}"


def _company_pages(c: md.Company) -> list[Page]:
    site, news = "https://www.simfinance.example", "https://news.simfinance.example"
    bars = md.daily_bars(c.ticker, md.REFERENCE_TODAY - timedelta(days=45), md.REFERENCE_TODAY)
    last, prev, week_ago = bars[-1], bars[-2], bars[-6]
    move = (last.c / prev.c - 1) * 100
    quote = (
        f"{c.name} ({c.ticker}) closed at ${last.c:.2f} on {_long(last.day)}, "
        f"{'up' if move >= 0 else 'down'} {abs(move):.2f}% from the previous close of ${prev.c:.2f}. "
        f"The day's range was ${last.low:.2f} to ${last.h:.2f} on volume of {last.v:,} shares. "
        f"Market capitalization: {_money(md.market_cap(c.ticker))}. {c.ticker} trades on the {c.exchange}."
    )
    history = "\n".join(f"{b.day.isoformat()}  close ${b.c:.2f}  volume {b.v:,}" for b in bars[-10:])
    profile = (
        f"{c.name} ({c.ticker}) {c.about}. It belongs to the {c.sector} sector ({c.industry} industry), "
        f"has about {c.employees:,} full-time employees and has been listed since {c.ipo}. Website: {c.website}."
    )
    q = md.statements(c.ticker, "quarter", 2)
    latest, before = q[0], q[1]
    growth = (latest.revenue / before.revenue - 1) * 100
    earnings = (
        f"{c.name} reported revenue of {_money(latest.revenue)} for {latest.period} {latest.fiscal_year} "
        f"(quarter ended {latest.end.isoformat()}), {growth:+.1f}% from the previous quarter. Net income was "
        f"{_money(latest.net_income)} and diluted EPS ${latest.eps:.2f}; operating income reached "
        f"{_money(latest.operating_income)}."
    )
    week = (last.c / week_ago.c - 1) * 100
    weekly = (
        f"{c.ticker} shares {'gained' if week >= 0 else 'lost'} {abs(week):.1f}% over the five sessions to "
        f"{_long(last.day)}, ending at ${last.c:.2f}. Analysts pointed to sector moves in {c.sector.lower()}."
    )
    return [
        Page(f"{site}/quote/{c.ticker}", f"{c.name} ({c.ticker}) Stock Price & Quote", quote,
             f"{quote}\n\nRecent closes:\n{history}"),
        Page(f"{site}/company/{c.ticker}", f"{c.name} ({c.ticker}) Company Profile", profile, profile),
        Page(f"{news}/{latest.filed.isoformat()}/{c.ticker.lower()}-{latest.period.lower()}-{latest.fiscal_year}"
             "-earnings", f"{c.name} reports {latest.period} {latest.fiscal_year} results", earnings,
             earnings, latest.filed),
        Page(f"{news}/{last.day.isoformat()}/{c.ticker.lower()}-weekly-stock-move",
             f"{c.name} stock {'rises' if week >= 0 else 'falls'} {abs(week):.1f}% this week", weekly, weekly,
             last.day),
    ]  # fmt: skip


_EXPLAINERS = {
    "price-to-earnings-ratio": (
        "What Is the Price-to-Earnings (P/E) Ratio?",
        "The price-to-earnings ratio divides a company's share price by its earnings per share (EPS). "
        "A higher P/E means investors pay more for each dollar of earnings.",
    ),
    "market-capitalization": (
        "Market Capitalization Explained",
        "Market capitalization is the share price multiplied by the number of shares outstanding. "
        "Large caps are usually companies worth more than $10 billion.",
    ),
    "gross-margin": (
        "Gross Margin: Definition and Formula",
        "Gross margin is gross profit (revenue minus cost of revenue) divided by revenue, "
        "the share of each sales dollar left after direct costs.",
    ),
    "earnings-per-share": (
        "Earnings Per Share (EPS)",
        "Earnings per share is net income divided by the weighted average number of shares outstanding. "
        "Diluted EPS also counts options and convertible securities.",
    ),
    "dividend-yield": (
        "How to Calculate Dividend Yield",
        "Dividend yield is the yearly dividend per share divided by the share price, shown as a percentage.",
    ),
    "previous-close": (
        "What Does Previous Close Mean?",
        "The previous close is a stock's price at the end of the last trading session. "
        "Daily price changes are measured from it.",
    ),
}


@functools.cache
def offline_web() -> dict[str, Page]:
    """Every page of the offline web, by URL."""
    pages = [p for c in md.COMPANIES.values() for p in _company_pages(c)]
    pages += [
        Page(f"https://learn.simfinance.example/{slug}", t, text, text) for slug, (t, text) in _EXPLAINERS.items()
    ]
    return {p.url: p for p in pages}


_STOP = frozenset(
    "a an and are as at be by for from how i in inc is it its me of on or the to what when which who why "
    "with corp corporation company co ltd plc stock stocks share shares".split()
)


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+(?:\.[a-z])?", text.lower()) if w not in _STOP}


class Offline:
    async def search(self, query: str, max_results: int, topic: Topic, depth: Depth) -> dict[str, Any]:
        wanted = _words(query)
        scored = []
        for page in offline_web().values():
            if topic == "news" and page.published is None:
                continue
            title, text = _words(page.title), _words(page.content + " " + page.url)
            hits = sum(2 if w in title else 1 for w in wanted if w in title or w in text)
            if hits:
                scored.append((round(min(0.99, hits / (2 * len(wanted))), 4), page))
        scored.sort(key=lambda sp: (-sp[0], sp[1].url))  # deterministic ties
        results = []
        for score, page in scored[:max_results]:
            # basic search gives the first sentence of a page's summary, advanced the whole summary
            content = page.content if depth == "advanced" else _SENTENCE_END.split(page.content, maxsplit=1)[0]
            result: dict[str, Any] = {"title": page.title, "url": page.url, "content": content, "score": score}
            if topic == "news" and page.published:
                result["published_date"] = page.published.isoformat()
            results.append(result)
        return {"query": query, "results": results}

    async def extract(self, urls: list[str]) -> dict[str, Any]:
        web = offline_web()
        found = [{"url": u, "raw_content": web[u].body[:MAX_RAW_CONTENT]} for u in urls if u in web]
        failed = [{"url": u, "error": "Failed to fetch url"} for u in urls if u not in web]
        return {"results": found, "failed_results": failed}


# --------------------------------------------------------------------------- live


def _search_json(payload: dict[str, Any], query: str) -> dict[str, Any]:
    keep = ("title", "url", "content", "score", "published_date")
    results = [{k: r[k] for k in keep if r.get(k) is not None} for r in payload.get("results") or []]
    return {"query": payload.get("query", query), "results": results}


class Live:
    def __init__(self, cfg: LiveService) -> None:
        self.api = HttpApi("tavily", cfg.base_url or DEFAULT_BASE_URL, "TAVILY_API_KEY", cfg.http_timeout_s)

    async def search(self, query: str, max_results: int, topic: Topic, depth: Depth) -> dict[str, Any]:
        body = {"query": query, "max_results": max_results, "topic": topic, "search_depth": depth}
        return _search_json(await self.api.call("POST", "/search", json=body), query)

    async def extract(self, urls: list[str]) -> dict[str, Any]:
        payload = await self.api.call("POST", "/extract", json={"urls": urls})
        return {
            "results": [
                {"url": r.get("url"), "raw_content": (r.get("raw_content") or "")[:MAX_RAW_CONTENT]}
                for r in payload.get("results") or []
            ],
            "failed_results": [
                {"url": r.get("url"), "error": r.get("error", "failed")} for r in payload.get("failed_results") or []
            ],
        }


def build(cfg: LiveService | None = None) -> FastMCP:
    mcp, backend, read_only = mirror_server(
        "tavily", "Web search and page extraction through Tavily.", cfg, Live, Offline
    )

    @mcp.tool(annotations=read_only)
    async def search(
        query: Annotated[str, Field(min_length=1, max_length=400, description="What to search the web for.")],
        max_results: Annotated[int, Field(ge=1, le=20, description="How many results to return (1-20).")] = 5,
        topic: Annotated[Topic, Field(description="general = any web page; news = recent news articles.")] = "general",
        search_depth: Annotated[
            Depth, Field(description="basic = fast, short snippets; advanced = slower, fuller content.")
        ] = "basic",
    ) -> dict[str, Any]:
        """Search the web. Returns results with title, url, a content snippet, a relevance score (0-1) and,
        for news, the published date."""
        return await backend.search(query, max_results, topic, search_depth)

    @mcp.tool(annotations=read_only)
    async def extract(
        urls: Annotated[list[Url], Field(min_length=1, max_length=5, description="1-5 page URLs (http or https).")],
    ) -> dict[str, Any]:
        """Fetch web pages and return their text (raw_content); pages that could not be fetched are listed in
        failed_results."""
        return await backend.extract(urls)

    return mcp
