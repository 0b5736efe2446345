"""The one retry helper: bounded attempts, exponential backoff with jitter and a cap (built on tenacity).

Every retry loop of mcprl goes through `retry_async`: tool calls in a replica (`ToolHost`), Serve
handle calls whose replica died (`ServeToolPool`, `JudgeHandle`), OpenAI-compatible requests
(`StructuredClient`) and the rule generator's transient tool failures. Each caller says what is
worth another try (an exception, or a result such as a failed `ToolCallResult`); everything else
comes back at once.

    policy = RetryPolicy(retries=2, first_wait_s=0.2)
    result = await retry_async(lambda attempt: call(attempt), policy, retry_exc=lambda e: isinstance(e, OSError))

The wait before retry n (1-based) is `min(max_wait_s, first_wait_s * 2**(n-1))`, scaled by a random
factor in `[1 - jitter, 1]` (so replicas that failed together do not all come back together), and
never less than what the server asked for (`at_least_s`, e.g. an HTTP Retry-After), itself capped
at `max_wait_s`. `sleep` and `rng` are injectable: tests run without waiting.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tenacity import AsyncRetrying, RetryCallState, stop_after_attempt

T = TypeVar("T")

# First wait after a Serve replica died under a call: Serve routes the retry to another (or a new) replica.
REPLICA_RETRY_WAIT_S = 0.2

# Jitter draws from its own generator: retries never shift a seeded global `random` stream.
_JITTER = random.Random()


@dataclass(frozen=True)
class RetryPolicy:
    """How many retries, and how long to wait before each.

    `retries`: attempts after the first (0 = a single attempt). `first_wait_s`: the wait before the first
    retry; it doubles for each one after, up to `max_wait_s`. `jitter`: the fraction of each wait that is
    random (0 = none, 1 = anywhere between 0 and the full wait)."""

    retries: int
    first_wait_s: float
    max_wait_s: float = 30.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"RetryPolicy.retries must be >= 0, got {self.retries}")
        if self.first_wait_s < 0 or self.max_wait_s < 0:
            raise ValueError(f"RetryPolicy waits must be >= 0, got {self.first_wait_s}, {self.max_wait_s}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"RetryPolicy.jitter must be within [0, 1], got {self.jitter}")

    @property
    def attempts(self) -> int:
        """Attempts in all: the first one and the retries."""
        return self.retries + 1

    def wait_s(self, retry: int, rand: float, at_least_s: float | None = None) -> float:
        """The wait before retry number `retry` (1-based), for `rand` uniform in [0, 1)."""
        base = min(self.max_wait_s, self.first_wait_s * 2 ** (retry - 1))
        wait = base * (1 - self.jitter * rand)
        if at_least_s is not None:
            wait = max(wait, min(at_least_s, self.max_wait_s))
        return wait


def _never(_: Any) -> bool:
    return False


async def retry_async(
    fn: Callable[[int], Awaitable[T]],
    policy: RetryPolicy,
    *,
    retry_exc: Callable[[BaseException], bool] = _never,
    retry_result: Callable[[T], bool] = _never,
    at_least_s: Callable[[BaseException], float | None] | None = None,
    on_retry: Callable[[int, float, Any], None] | None = None,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    rng: random.Random | None = None,
) -> T:
    """`await fn(attempt)` (attempt = 1, 2, ...) until it succeeds or the retries are spent.

    `retry_exc(e)`: whether an exception `fn` raised is worth another try; any other exception propagates
    at once. `retry_result(r)`: whether a returned value is a failure worth another try. When the retries
    are spent the last result is returned, or the last exception re-raised, as it came: `fn` receives
    its attempt number, so what it returns or raises can say how many attempts were made.
    `at_least_s(e)`: the least wait the failure asks for (a server's Retry-After), or None.
    `on_retry(attempt, wait_s, failure)`: called before each wait, with the failed attempt's number and
    its exception or result (to log or count retries)."""
    uniform = (rng or _JITTER).random

    def should_retry(state: RetryCallState) -> bool:
        outcome = state.outcome
        assert outcome is not None  # tenacity asks only after an attempt
        if outcome.failed:
            exc = outcome.exception()
            return exc is not None and retry_exc(exc)
        return retry_result(outcome.result())

    def failure(state: RetryCallState) -> Any:
        assert state.outcome is not None
        return state.outcome.exception() if state.outcome.failed else state.outcome.result()

    def failure_or_result(state: RetryCallState) -> Any:
        assert state.outcome is not None
        return state.outcome.result()  # raises the last exception, if that is how the last attempt ended

    def wait(state: RetryCallState) -> float:
        floor = None
        if at_least_s is not None and state.outcome is not None and state.outcome.failed:
            exc = state.outcome.exception()
            floor = at_least_s(exc) if exc is not None else None
        return policy.wait_s(state.attempt_number, uniform(), floor)

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None:
            delay = state.next_action.sleep if state.next_action is not None else 0.0
            on_retry(state.attempt_number, delay, failure(state))

    attempt = 0

    async def once() -> T:
        nonlocal attempt
        attempt += 1
        return await fn(attempt)

    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.attempts),
        wait=wait,
        retry=should_retry,
        before_sleep=before_sleep,
        sleep=sleep,
        # Spent: hand back the last outcome as it was (its result, or its exception raised again).
        retry_error_callback=failure_or_result,
    )
    return await retrying(once)
