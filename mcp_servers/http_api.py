"""The HTTP plumbing the live backends share: one JSON call to an outside API, with a timeout, the
key taken from the environment at call time, failures mapped to `ToolFault` kinds, and secrets
redacted from every message.

Mapping: no key → Unavailable; network error or timeout → UpstreamError(retryable); 429 and 5xx →
UpstreamError(retryable); 401/403 (key rejected, plan too small) → Unavailable; other 4xx →
UpstreamError (not retryable), or InvalidArguments for a 404 the API itself answered when the caller
says what a 404 means (an unknown ticker, say). Messages carry the method and path, never the query
string or headers, and pass through `redact`; exceptions are raised `from None`, so no logged
traceback chains the httpx error (whose text can hold the full URL with `apiKey=`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import Any

import httpx

from mcp_servers.errors import InvalidArguments, Unavailable, UpstreamError

_SECRET_PARAM = re.compile(r"(?i)((?:api[_-]?key|apikey|access[_-]?token|token|key)=)[^&\s\"']+")
_SECRET_HEADER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")
_known_secrets: set[str] = set()  # key values seen by any HttpApi in this process


def redact(text: str) -> str:
    """Remove every key this process has used, and anything that looks like `apiKey=...` or `Bearer ...`."""
    for secret in _known_secrets:
        text = text.replace(secret, "***")
    return _SECRET_HEADER.sub(r"\1***", _SECRET_PARAM.sub(r"\1***", text))


class _RedactingFilter(logging.Filter):
    """httpx logs every request URL at INFO; FMP's key travels in that URL."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


for _name in ("httpx", "httpcore"):
    logging.getLogger(_name).addFilter(_RedactingFilter())


class HttpApi:
    """One outside JSON API (base URL, key variable, timeout), called by one live backend.

    `key_param` sends the key as that query parameter (FMP's `apikey`); None sends
    `Authorization: Bearer <key>` (Polygon, Tavily, Slack), which keeps it out of URLs and logs.
    """

    def __init__(
        self, service: str, base_url: str, key_env: str, timeout_s: float, key_param: str | None = None
    ) -> None:
        self.service, self.base_url, self.key_env = service, base_url.rstrip("/"), key_env
        self.timeout_s, self.key_param = timeout_s, key_param
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def key(self) -> str:
        key = os.environ.get(self.key_env, "").strip()
        if not key:
            raise Unavailable(f"{self.key_env} is not set: the live {self.service} backend needs it (or use offline)")
        _known_secrets.add(key)
        return key

    def _http(self) -> httpx.AsyncClient:
        # One pooled client per event loop: a client is bound to the loop that opened its connections.
        loop = asyncio.get_running_loop()
        if self._client is None or self._client.is_closed or self._loop is not loop:
            self._client = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s)
            self._loop = loop
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json: Any = None,
        not_found: str | None = None,
        expect: type = dict,
    ) -> Any:
        """Send one request and return the parsed JSON body (of type `expect`); raise a ToolFault otherwise."""
        key = self.key()
        params, headers = dict(params or {}), {"Accept": "application/json"}
        if self.key_param:
            params[self.key_param] = key
        else:
            headers["Authorization"] = f"Bearer {key}"
        where = f"{self.service}: {method} {path}"
        try:
            response = await self._http().request(method, path, params=params, json=json, headers=headers)
        except httpx.TimeoutException:
            raise UpstreamError(f"{where} timed out after {self.timeout_s:g} s", retryable=True) from None
        except httpx.HTTPError as e:
            raise UpstreamError(redact(f"{where} failed: {type(e).__name__}: {e}"), retryable=True) from None
        status = response.status_code
        if status >= 400:
            detail = _detail(response)
            if status == 404 and not_found and _is_json(response):
                raise InvalidArguments(not_found)
            if status in (401, 403):
                raise Unavailable(f"{where} refused the key in {self.key_env} (HTTP {status}): {detail}")
            retryable = status == 429 or status >= 500
            raise UpstreamError(f"{where} answered HTTP {status}: {detail}", retryable=retryable)
        try:
            body = response.json()
        except ValueError:
            raise UpstreamError(f"{where} answered HTTP {status} with a body that is not JSON") from None
        if not isinstance(body, expect):  # e.g. FMP's {"Error Message": ...} where a list belongs
            raise UpstreamError(
                f"{where} answered a JSON {type(body).__name__}, not a {expect.__name__}: {_detail(response)}"
            )
        return body


def _detail(response: httpx.Response) -> str:
    """The start of an error body, for the message (redacted before cutting: a cut key would not match)."""
    return redact(response.text)[:300].strip()


def _is_json(response: httpx.Response) -> bool:
    try:
        response.json()
    except ValueError:
        return False
    return True
