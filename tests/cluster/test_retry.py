"""The retry helper on its own: attempts, what is retried, what comes back when retries run out, and the
waits (recorded by an injected sleep: nothing here waits for real)."""

from __future__ import annotations

import random

import pytest

from cluster.retry import RetryPolicy, retry_async


class Recorder:
    """A sleep that only records what it was asked to wait."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


class Flaky:
    """Fails `failures` times with `exc`, then returns the attempt number it was given."""

    def __init__(self, failures: int, exc: BaseException | None = None) -> None:
        self.failures = failures
        self.exc = exc or ConnectionError("down")
        self.seen: list[int] = []

    async def __call__(self, attempt: int) -> int:
        self.seen.append(attempt)
        if len(self.seen) <= self.failures:
            raise self.exc
        return attempt


def is_conn(e: BaseException) -> bool:
    return isinstance(e, ConnectionError)


def test_waits_double_up_to_the_cap_and_jitter_only_shortens() -> None:
    p = RetryPolicy(retries=10, first_wait_s=0.5, max_wait_s=3.0, jitter=0.5)
    assert [p.wait_s(n, 0.0) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert [p.wait_s(n, 1.0) for n in range(1, 4)] == [0.25, 0.5, 1.0]  # at most half taken away
    assert RetryPolicy(3, 0.5, jitter=0.0).wait_s(2, 0.9) == 1.0
    # a server's Retry-After raises the wait, but never past the cap
    assert p.wait_s(1, 0.0, at_least_s=2.0) == 2.0 and p.wait_s(1, 0.0, at_least_s=100.0) == 3.0


@pytest.mark.parametrize(
    ("fields", "word"), [({"retries": -1}, "retries"), ({"jitter": 1.5}, "jitter"), ({"first_wait_s": -1}, "waits")]
)
def test_a_bad_policy_is_refused_naming_the_field(fields: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        RetryPolicy(**{"retries": 1, "first_wait_s": 0.1, **fields})


async def test_retries_until_success_and_tells_fn_its_attempt() -> None:
    sleep, fn = Recorder(), Flaky(failures=2)
    policy = RetryPolicy(retries=3, first_wait_s=0.1, jitter=0.0)
    assert await retry_async(fn, policy, retry_exc=is_conn, sleep=sleep) == 3
    assert fn.seen == [1, 2, 3]
    assert sleep.waits == pytest.approx([0.1, 0.2])


async def test_spent_retries_reraise_the_last_exception_itself() -> None:
    sleep, fn = Recorder(), Flaky(failures=10)
    with pytest.raises(ConnectionError, match="down"):
        await retry_async(fn, RetryPolicy(retries=2, first_wait_s=0.1), retry_exc=is_conn, sleep=sleep)
    assert fn.seen == [1, 2, 3] and len(sleep.waits) == 2  # no wait after the last attempt


async def test_an_error_not_retryable_propagates_at_once() -> None:
    sleep, fn = Recorder(), Flaky(failures=10, exc=KeyError("bad"))
    with pytest.raises(KeyError):
        await retry_async(fn, RetryPolicy(retries=5, first_wait_s=0.1), retry_exc=is_conn, sleep=sleep)
    assert fn.seen == [1] and sleep.waits == []


async def test_zero_retries_is_one_attempt() -> None:
    fn = Flaky(failures=1)
    with pytest.raises(ConnectionError):
        await retry_async(fn, RetryPolicy(retries=0, first_wait_s=0.1), retry_exc=is_conn, sleep=Recorder())
    assert fn.seen == [1]


async def test_results_can_be_retried_and_the_last_one_comes_back() -> None:
    sleep = Recorder()
    answers = iter(["busy", "busy", "busy", "never"])

    async def fn(attempt: int) -> tuple[int, str]:
        return attempt, next(answers)

    got = await retry_async(
        fn, RetryPolicy(retries=2, first_wait_s=0.1), retry_result=lambda r: r[1] == "busy", sleep=sleep
    )
    assert got == (3, "busy")  # spent: the last failed result, as it was
    assert len(sleep.waits) == 2


async def test_on_retry_sees_each_failure_and_its_wait_and_at_least_s_is_honoured() -> None:
    seen: list[tuple[int, float, str]] = []
    sleep, fn = Recorder(), Flaky(failures=2, exc=ConnectionError("429"))
    await retry_async(
        fn,
        RetryPolicy(retries=2, first_wait_s=0.1, max_wait_s=10.0),
        retry_exc=is_conn,
        at_least_s=lambda e: 4.0,
        on_retry=lambda n, wait, failure: seen.append((n, wait, str(failure))),
        sleep=sleep,
        rng=random.Random(0),
    )
    assert seen == [(1, 4.0, "429"), (2, 4.0, "429")]
    assert sleep.waits == [4.0, 4.0]


async def test_jitter_comes_from_the_given_rng() -> None:
    policy = RetryPolicy(retries=3, first_wait_s=1.0, jitter=1.0)
    runs = []
    for _ in range(2):
        sleep = Recorder()
        await retry_async(Flaky(failures=3), policy, retry_exc=is_conn, sleep=sleep, rng=random.Random(7))
        runs.append(sleep.waits)
    assert runs[0] == runs[1]
    assert all(0 <= w <= 2**i for i, w in enumerate(runs[0]))
    assert len(set(runs[0])) == 3  # not the same fraction each time
