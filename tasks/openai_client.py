"""A structured-outputs client for any OpenAI-compatible endpoint (OpenAI itself, vLLM, a local stand-in).

One call, `await client.complete(system, user, schema_name, json_schema)`, returns the model's answer
as a dict that matches `json_schema`, through either API:

- Chat Completions: `response_format={"type": "json_schema", "json_schema": {name, schema, strict}}`
- Responses: `text={"format": {"type": "json_schema", name, schema, strict}}`

What it adds around the `openai` SDK:
- bounded concurrency: at most `cfg.concurrency` requests in flight;
- retries (`cluster.retry`: exponential backoff with jitter, at least a server's Retry-After) on 429,
  5xx, timeouts and connection errors only (the SDK's own retries are off, so there is one policy and
  it is counted here);
- a disk cache: one file per (model, backend, messages, schema, temperature, sample index), written
  atomically, so a rerun of the same generation sends no request and costs nothing;
- a running count of the tokens spent (cache hits cost 0), `usage()`;
- named errors: `MissingAPIKey`, `RequestFailed` (the API call), `StructuredOutputError` (the answer
  is not the JSON asked for). A caller that makes many samples counts the last two per sample.

The API key is read from the variable `cfg.api_key_env` and never logged; a loopback endpoint needs
none (a placeholder is sent).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlparse

from cluster.retry import RetryPolicy, retry_async
from configs.schema import OpenAIConfig

log = logging.getLogger(__name__)

OPENAI_BASE_URL = "https://api.openai.com/v1"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
LOCAL_PLACEHOLDER_KEY = "not-needed"  # the SDK insists on some key; local servers ignore it
CACHE_VERSION = 1  # bump when the cache's key or file layout changes
BACKOFF_CAP_S = 30.0


# --------------------------------------------------------------------------- errors


class OpenAIClientError(RuntimeError):
    """Base of this module's errors."""


class MissingAPIKey(OpenAIClientError):
    """A non-local endpoint and no key in the environment."""


class RequestFailed(OpenAIClientError):
    """The API call failed: not retryable, or still failing after the retries.

    `kind`: rate_limit | server | timeout | connection | auth | bad_request | other. `attempts`: how many
    requests were made; `retryable`: whether the last failure was of a kind worth another try.
    """

    def __init__(
        self,
        message: str,
        kind: str,
        status: int | None = None,
        attempts: int = 1,
        *,
        retryable: bool = False,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.attempts = attempts
        self.retryable = retryable  # another try may succeed (429, 5xx, timeout, connection)
        self.retry_after_s = retry_after_s  # the server's Retry-After, when it sent one

    @property
    def fatal(self) -> bool:
        """True when no other request can succeed either (bad key, no such model): stop the run."""
        return self.kind == "auth" or self.status == 404


class StructuredOutputError(OpenAIClientError):
    """The answer came back but is not the JSON asked for.

    `reason`: not_json | not_object | schema_mismatch | refusal | truncated | empty.
    `text`: the raw answer (for reports).
    """

    def __init__(self, message: str, reason: str, text: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.text = text


# --------------------------------------------------------------------------- helpers


@dataclass
class Usage:
    """Tokens spent through one client (cache hits count as cache_hits and spend nothing)."""

    requests: int = 0  # HTTP requests that returned an answer (retried failures not included)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cache_hits: int = 0
    retries: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def is_local_url(url: str | None) -> bool:
    """Whether `url` points at this machine (no key needed, nothing leaves the box)."""
    if not url:
        return False
    return (urlparse(url).hostname or "") in LOOPBACK_HOSTS


def default_cache_dir(cfg: OpenAIConfig) -> Path:
    """`cfg.cache_dir`, else $MCPRL_CACHE/openai, else ~/.cache/mcprl/openai."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return Path(os.environ.get("MCPRL_CACHE") or "~/.cache/mcprl").expanduser() / "openai"


def cache_key(
    model: str,
    backend: str,
    messages: list[dict[str, str]],
    schema_name: str,
    json_schema: dict[str, Any],
    temperature: float,
    sample: int | str,
    max_output_tokens: int | None = None,
) -> str:
    """sha256 of everything that shapes the answer; `sample` tells apart repeated draws of one prompt."""
    payload = {
        "v": CACHE_VERSION,
        "model": model,
        "backend": backend,
        "messages": messages,
        "schema_name": schema_name,
        "schema": json_schema,
        "temperature": temperature,
        "sample": sample,
        "max_output_tokens": max_output_tokens,
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def parse_structured(text: str | None, json_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """The answer text as a dict, checked against `json_schema` when given; StructuredOutputError if not."""
    if text is None or not text.strip():
        raise StructuredOutputError("the model returned no text", "empty", text or "")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise StructuredOutputError(f"the answer is not JSON: {e}", "not_json", text) from None
    if not isinstance(value, dict):
        raise StructuredOutputError(f"the answer is JSON {type(value).__name__}, not an object", "not_object", text)
    if json_schema is not None:
        import jsonschema

        try:
            jsonschema.validate(value, json_schema)
        except jsonschema.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "<root>"
            raise StructuredOutputError(
                f"the answer does not match the schema at {where}: {e.message}", "schema_mismatch", text
            ) from None
    return value


# --------------------------------------------------------------------------- the client


@dataclass
class _Answer:
    text: str | None
    refusal: str | None
    truncated: bool
    usage: dict[str, int]


class StructuredClient:
    """Structured outputs from an OpenAI-compatible endpoint, with concurrency, retries, cache and token count.

    `backoff_s`: the first retry's wait (doubling, capped at 30 s, with jitter); `max_output_tokens`:
    an optional cap on the answer's length (part of the cache key); `use_cache`: False = always ask.
    """

    def __init__(
        self,
        cfg: OpenAIConfig,
        *,
        backoff_s: float = 1.0,
        max_output_tokens: int | None = None,
        use_cache: bool = True,
    ) -> None:
        self.cfg = cfg
        self.base_url = cfg.base_url or OPENAI_BASE_URL
        self.backoff_s = backoff_s
        self.retry_policy = RetryPolicy(cfg.max_retries, backoff_s, max_wait_s=BACKOFF_CAP_S)
        self.max_output_tokens = max_output_tokens
        self.cache_dir = default_cache_dir(cfg) if use_cache else None
        self._usage = Usage()
        self._slots = asyncio.Semaphore(cfg.concurrency)
        key = os.environ.get(cfg.api_key_env, "").strip()
        if not key:
            if not is_local_url(self.base_url):
                raise MissingAPIKey(
                    f"{cfg.api_key_env} is not set, and {self.base_url} needs an API key. Set it in the environment "
                    "(or .env), or point generation.openai.base_url / OPENAI_BASE_URL at a local server."
                )
            key = LOCAL_PLACEHOLDER_KEY
        self._secret = key if key != LOCAL_PLACEHOLDER_KEY else ""
        from openai import AsyncOpenAI

        # max_retries=0: retries happen here, where they are bounded, logged and counted.
        self._client = AsyncOpenAI(api_key=key, base_url=self.base_url, timeout=cfg.timeout_s, max_retries=0)

    def __repr__(self) -> str:  # never show the key
        return f"StructuredClient(model={self.cfg.model!r}, backend={self.cfg.backend!r}, base_url={self.base_url!r})"

    # ---- public

    def usage(self) -> dict[str, int]:
        """Tokens spent so far: requests, prompt/completion/total tokens, cache hits, retries."""
        return self._usage.as_dict()

    async def complete(
        self, system: str, user: str, schema_name: str, json_schema: dict[str, Any], *, sample: int | str = 0
    ) -> dict[str, Any]:
        """The model's answer to (system, user) as a dict matching `json_schema` (strict structured outputs).

        `sample`: which draw of this prompt (0, 1, ...): each has its own cache entry.
        Raises RequestFailed or StructuredOutputError.
        """
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        key = cache_key(
            self.cfg.model, self.cfg.backend, messages, schema_name, json_schema,
            self.cfg.temperature, sample, self.max_output_tokens,
        )  # fmt: skip
        cached = self._cache_read(key)
        if cached is not None:
            self._usage.cache_hits += 1
            answer = _Answer(cached.get("text"), cached.get("refusal"), bool(cached.get("truncated")), {})
        else:
            answer = await self._request_with_retries(system, user, schema_name, json_schema)
            self._count(answer.usage)
            self._cache_write(key, answer)
        if answer.refusal:
            raise StructuredOutputError(f"the model refused: {answer.refusal}", "refusal", answer.refusal)
        if answer.truncated:
            raise StructuredOutputError("the answer was cut off (length limit)", "truncated", answer.text or "")
        return parse_structured(answer.text, json_schema)

    async def aclose(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> StructuredClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ---- requests

    async def _request_with_retries(
        self, system: str, user: str, schema_name: str, json_schema: dict[str, Any]
    ) -> _Answer:
        async def once(attempt: int) -> _Answer:
            try:
                async with self._slots:
                    return await self._request(system, user, schema_name, json_schema)
            except Exception as e:  # classified right here; anything not from the API is re-raised
                kind, status, retryable, retry_after = _classify(e)
                if kind is None:
                    raise
                tries = f" after {attempt} attempts" if attempt > 1 else ""
                raise RequestFailed(
                    f"{self.cfg.backend} request to {self.base_url} failed{tries}: {kind}"
                    f"{f' (HTTP {status})' if status else ''}: {_short(e, self._secret)}",
                    kind, status, attempt, retryable=retryable, retry_after_s=retry_after,
                ) from None  # fmt: skip

        def counted(attempt: int, wait: float, failure: RequestFailed) -> None:
            self._usage.retries += 1
            log.info(
                "openai %s (%s), retry %d/%d in %.2fs",
                failure.kind, failure.status or "-", attempt, self.cfg.max_retries, wait,
            )  # fmt: skip

        return await retry_async(
            once,
            self.retry_policy,
            retry_exc=lambda e: isinstance(e, RequestFailed) and e.retryable,
            at_least_s=lambda e: getattr(e, "retry_after_s", None),
            on_retry=counted,
        )

    async def _request(self, system: str, user: str, schema_name: str, json_schema: dict[str, Any]) -> _Answer:
        cfg = self.cfg
        if cfg.backend == "chat":
            extra: dict[str, Any] = {}
            if self.max_output_tokens is not None:
                extra["max_completion_tokens"] = self.max_output_tokens
            resp = await self._client.chat.completions.create(
                model=cfg.model,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                temperature=cfg.temperature,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": schema_name, "schema": json_schema, "strict": True},
                },
                **extra,
            )
            if not resp.choices:
                return _Answer(None, None, False, _usage_of(resp.usage, "chat"))
            choice = resp.choices[0]
            msg = choice.message
            return _Answer(
                msg.content,
                getattr(msg, "refusal", None),
                choice.finish_reason == "length",
                _usage_of(resp.usage, "chat"),
            )
        extra = {}
        if self.max_output_tokens is not None:
            extra["max_output_tokens"] = self.max_output_tokens
        resp = await self._client.responses.create(
            model=cfg.model,
            instructions=system,
            input=[{"role": "user", "content": user}],
            temperature=cfg.temperature,
            text={"format": {"type": "json_schema", "name": schema_name, "schema": json_schema, "strict": True}},
            store=False,  # nothing to keep on the provider's side
            **extra,
        )
        refusal = None
        for item in resp.output or []:
            for part in getattr(item, "content", None) or []:
                if getattr(part, "type", None) == "refusal":
                    refusal = getattr(part, "refusal", None) or "refused"
        details = getattr(resp, "incomplete_details", None)
        truncated = resp.status == "incomplete" and getattr(details, "reason", None) == "max_output_tokens"
        return _Answer(resp.output_text, refusal, truncated, _usage_of(resp.usage, "responses"))

    # ---- accounting and cache

    def _count(self, usage: dict[str, int]) -> None:
        self._usage.requests += 1
        self._usage.prompt_tokens += usage.get("prompt_tokens", 0)
        self._usage.completion_tokens += usage.get("completion_tokens", 0)
        self._usage.total_tokens += usage.get("total_tokens", 0)

    def _cache_path(self, key: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / key[:2] / f"{key}.json"

    def _cache_read(self, key: str) -> dict[str, Any] | None:
        path = self._cache_path(key)
        if path is None or not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:  # a damaged entry is asked again, not fatal
            log.warning("ignoring unreadable cache entry %s: %s", path, e)
            return None

    def _cache_write(self, key: str, answer: _Answer) -> None:
        """Store the raw answer (parsed or not): a rerun then reproduces the same outcome for free."""
        path = self._cache_path(key)
        if path is None:
            return
        entry = {
            "model": self.cfg.model,
            "backend": self.cfg.backend,
            "text": answer.text,
            "refusal": answer.refusal,
            "truncated": answer.truncated,
            "usage": answer.usage,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _usage_of(usage: Any, backend: Literal["chat", "responses"]) -> dict[str, int]:
    if usage is None:
        return {}
    if backend == "chat":
        prompt, completion = usage.prompt_tokens or 0, usage.completion_tokens or 0
    else:
        prompt, completion = usage.input_tokens or 0, usage.output_tokens or 0
    total = getattr(usage, "total_tokens", None) or prompt + completion
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


def _classify(exc: BaseException) -> tuple[str | None, int | None, bool, float | None]:
    """(kind, HTTP status, retryable, retry-after seconds) of an SDK error; kind None = not an API error."""
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return "timeout", None, True, None
    if isinstance(exc, openai.APIConnectionError):
        return "connection", None, True, None
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        retry_after = _retry_after(exc)
        if status == 429:
            return "rate_limit", status, True, retry_after
        if status >= 500:
            return "server", status, True, retry_after
        if status in (401, 403):
            return "auth", status, False, None
        return "bad_request", status, False, None
    if isinstance(exc, openai.OpenAIError):
        return "other", None, False, None
    return None, None, False, None


def _retry_after(exc: Any) -> float | None:
    try:
        value = exc.response.headers.get("retry-after")
        return float(value) if value is not None else None
    except (AttributeError, ValueError):
        return None


SECRET_LIKE = re.compile(r"\b(sk-[A-Za-z0-9_*-]{6,})")  # servers echo (parts of) bad keys in 401 messages


def _short(exc: BaseException, secret: str = "", limit: int = 300) -> str:
    """The error's text on one line, without the key or anything shaped like one."""
    text = str(exc).replace("\n", " ")
    if secret:
        text = text.replace(secret, "[redacted]")
    text = SECRET_LIKE.sub("[redacted]", text)
    return text if len(text) <= limit else text[:limit] + "…"
