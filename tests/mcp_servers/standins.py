"""Local stand-ins of the Polygon, FMP, Tavily and Slack HTTP APIs, and helpers for the server tests.

One `StandIn` serves all four on 127.0.0.1 (ephemeral port) from a thread; the paths do not collide
(`/v2`, `/v3` Polygon; `/stable` FMP; `/search`, `/extract` Tavily; `/api/...` Slack). It records every
request, answers with canned bodies shaped like the real APIs (with extra fields the servers must trim),
and can be told to fail: `fail_next(500)` answers the next request with that status and a body that
echoes the full URL and Authorization header, so tests can check that keys are redacted.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
from fastmcp import FastMCP

from cluster.ports import free_port
from mcp_servers.errors import ToolFault, Unavailable, UpstreamError

UNKNOWN = "NOPE"  # the symbol every stand-in treats as unknown


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: Any  # parsed JSON, or None
    url: str  # path with the raw query string


Reply = tuple[int, Any]


# --------------------------------------------------------------------------- canned answers


def _bar(t: int, c: float) -> dict[str, Any]:
    return {"v": 1000.0, "vw": c, "o": c - 1, "c": c, "h": c + 1, "l": c - 2, "t": t, "n": 10}


def polygon(req: Request, parts: list[str]) -> Reply:
    if parts[:3] == ["v2", "aggs", "ticker"]:
        ticker = parts[3]
        if parts[4] == "prev":
            results = [] if ticker == UNKNOWN else [{"T": ticker, **_bar(1795064400000, 271.35)}]
            return 200, {"ticker": ticker, "queryCount": len(results), "resultsCount": len(results),
                         "adjusted": True, "results": results, "status": "OK", "request_id": "req-1"}  # fmt: skip
        bars = [_bar(1794978000000, 266.61), _bar(1795064400000, 271.35)]
        return 200, {"ticker": ticker, "queryCount": 2, "resultsCount": 2, "adjusted": True, "results": bars,
                     "status": "OK", "request_id": "req-2", "count": 2}  # fmt: skip
    ticker = parts[3]
    if ticker == UNKNOWN:
        return 404, {"status": "NOT_FOUND", "request_id": "req-3", "message": "Ticker not found."}
    return 200, {"request_id": "req-4", "status": "OK", "results": {
        "ticker": ticker, "name": "Apple Inc.", "market": "stocks", "locale": "us", "primary_exchange": "XNAS",
        "type": "CS", "active": True, "currency_name": "usd", "cik": "0000320193", "market_cap": 4.0e12,
        "description": "Apple designs phones.", "homepage_url": "https://www.apple.com", "list_date": "1980-12-12",
        "total_employees": 166000, "share_class_shares_outstanding": 14800000000,
        "weighted_shares_outstanding": 14800000000, "branding": {"logo_url": "https://x/logo.svg"},
        "address": {"city": "Cupertino"}, "sic_code": "3571"}}  # fmt: skip


def fmp(req: Request, parts: list[str]) -> Reply:
    symbol = req.query.get("symbol", "")
    if symbol == UNKNOWN:
        return 200, []
    if parts[1] == "profile":
        return 200, [{"symbol": symbol, "companyName": "Apple Inc.", "price": 271.35, "marketCap": 4.0e12,
                      "beta": 1.1, "sector": "Technology", "industry": "Consumer Electronics", "cik": "0000320193",
                      "isin": "US0378331005", "image": "https://x/AAPL.png", "phone": "1-408"}]  # fmt: skip
    rows = [{"date": f"{2025 - i}-12-31", "symbol": symbol, "fiscalYear": str(2025 - i), "period": "FY",
             "revenue": 400 - i, "netIncome": 100 - i, "grossProfitMargin": 0.47, "priceToEarningsRatio": 30.0,
             "link": "https://sec.gov/x", "finalLink": "https://sec.gov/y", "cik": "0000320193"}
            for i in range(int(req.query.get("limit", "5")) + 2)]  # fmt: skip
    return 200, rows  # two rows more than asked for: the server must cut them


def tavily(req: Request, parts: list[str]) -> Reply:
    body = req.body or {}
    if parts == ["search"]:
        results = [{"title": "Apple stock", "url": "https://news.example/aapl", "content": "AAPL rose.",
                    "score": 0.91, "raw_content": None, "favicon": "https://news.example/f.ico"}]  # fmt: skip
        if body.get("topic") == "news":
            results[0]["published_date"] = "Thu, 19 Nov 2026 21:00:00 GMT"
        return 200, {"query": body.get("query"), "answer": None, "images": [], "results": results,
                     "response_time": 1.2, "request_id": "req-5"}  # fmt: skip
    urls = body.get("urls", [])
    ok = [u for u in urls if "fail" not in u]
    return 200, {"results": [{"url": u, "raw_content": "x" * 9000, "images": []} for u in ok],
                 "failed_results": [{"url": u, "error": "timeout"} for u in urls if u not in ok],
                 "response_time": 0.5}  # fmt: skip


SLACK_CHANNELS = [
    {"id": "C01GENERAL", "name": "general", "is_channel": True, "is_private": False, "is_archived": False,
     "is_member": True, "num_members": 4, "created": 1600000000, "creator": "U1",
     "topic": {"value": "hello", "creator": "U1", "last_set": 0}, "purpose": {"value": "all", "creator": "U1"}},
    {"id": "C02MARKETS", "name": "markets", "is_channel": True, "is_private": False, "is_archived": False,
     "is_member": True, "num_members": 3, "created": 1600000001, "creator": "U1",
     "topic": {"value": "prices", "creator": "U1"}, "purpose": {"value": "moves", "creator": "U1"}},
]  # fmt: skip


def slack(req: Request, parts: list[str]) -> Reply:
    method = parts[1]
    if method == "conversations.list":
        return 200, {"ok": True, "channels": SLACK_CHANNELS, "response_metadata": {"next_cursor": ""}}
    channel = req.query.get("channel") or (req.body or {}).get("channel")
    if channel not in {c["id"] for c in SLACK_CHANNELS}:
        return 200, {"ok": False, "error": "channel_not_found"}
    if method == "conversations.history":
        messages = [{"type": "message", "user": "U1", "text": f"m{i}", "ts": f"17951{i}.000100", "team": "T1",
                     "blocks": []} for i in range(3)]  # fmt: skip
        return 200, {"ok": True, "messages": messages, "has_more": True, "pin_count": 0}
    text = req.body["text"]
    return 200, {"ok": True, "channel": channel, "ts": "1795185001.000200",
                 "message": {"type": "message", "bot_id": "B1", "user": "UBOT", "text": text,
                             "ts": "1795185001.000200", "app_id": "A1"}}  # fmt: skip


ROUTES: dict[str, Callable[[Request, list[str]], Reply]] = {
    "v2": polygon, "v3": polygon, "stable": fmp, "search": tavily, "extract": tavily, "api": slack,
}  # fmt: skip


# --------------------------------------------------------------------------- the server


class StandIn:
    """All four stand-ins on one loopback port; use as a context manager."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.delay_s = 0.0
        self._failures: deque[tuple[int, str | None]] = deque()
        self._replies: deque[Reply] = deque()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                split = urlsplit(self.path)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                req = Request(self.command, split.path, dict(parse_qsl(split.query)),
                              {k.lower(): v for k, v in self.headers.items()},
                              json.loads(raw) if raw else None, self.path)  # fmt: skip
                status, body = standin._answer(req)
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
                    pass

            do_GET = do_POST = _serve

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _answer(self, req: Request) -> Reply:
        self.requests.append(req)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self._failures:
            status, body = self._failures.popleft()
            auth = req.headers.get("authorization", "")
            return status, body if body is not None else f"stand-in failure for {req.url} (auth: {auth})"
        if self._replies:
            return self._replies.popleft()
        parts = req.path.strip("/").split("/")
        return ROUTES[parts[0]](req, parts)

    def fail_next(self, status: int, body: str | None = None, times: int = 1) -> None:
        """Answer the next `times` requests with `status` (default body: echoes the URL and auth header)."""
        self._failures.extend([(status, body)] * times)

    def reply_next(self, status: int, body: Any) -> None:
        """Answer the next request with exactly this status and (JSON) body."""
        self._replies.append((status, body))

    def reset(self) -> None:
        self.requests.clear()
        self._failures.clear()
        self._replies.clear()
        self.delay_s = 0.0

    @property
    def last(self) -> Request:
        return self.requests[-1]

    def __enter__(self) -> StandIn:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


# --------------------------------------------------------------------------- helpers for the tests


async def call(server: FastMCP, tool: str, **args: Any) -> dict[str, Any]:
    """Call a tool in-process and return its structured result."""
    result = await server.call_tool(tool, args)
    assert result.structured_content is not None
    return result.structured_content


async def fault(server: FastMCP, tool: str, **args: Any) -> ToolFault:
    """Call a tool that must fail with a ToolFault; return that fault (FastMCP raises it as it is)."""
    with pytest.raises(ToolFault) as info:
        await server.call_tool(tool, args)
    return info.value


# HTTP failures every live backend must map the same way: (status, fault type, retryable).
HTTP_FAULTS = [
    (500, UpstreamError, True),
    (503, UpstreamError, True),
    (429, UpstreamError, True),
    (400, UpstreamError, False),
    (404, UpstreamError, False),
    (401, Unavailable, False),
]


async def assert_documented(server: FastMCP, names: set[str]) -> None:
    """The server has exactly these tools, each with a description and a description on every parameter."""
    tools = await server.list_tools()
    assert {t.name for t in tools} == names
    for tool in tools:
        assert tool.description, tool.name
        for param, schema in tool.parameters["properties"].items():
            assert schema.get("description"), f"{tool.name}.{param} has no description"


def closed_port_url() -> str:
    """A loopback URL where nothing listens (network errors)."""
    return f"http://127.0.0.1:{free_port()}"
