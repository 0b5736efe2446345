"""Admission: the filter every generator's rows go through (check, replay offline, de-duplicate)."""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from configs.schema import ToolsConfig
from serve_apps.tool_pool import LocalToolPool
from tasks import admission as a
from tasks.inventory import Inventory, inventory_from_listing
from tasks.io import read_rows
from tests.conftest import library_logs

FIXTURE = Path(__file__).parent / "fixtures" / "gate_rows.jsonl"


@pytest.fixture
async def pool() -> AsyncIterator[LocalToolPool]:
    pool = await LocalToolPool.create(ToolsConfig())  # a fresh offline workspace per test
    yield pool
    await pool.close()


@pytest.fixture
async def inventory(pool: LocalToolPool) -> Inventory:
    return inventory_from_listing(await pool.list_tools())


def fixture_rows() -> list[dict[str, Any]]:
    return read_rows(FIXTURE)


def variant(row: dict[str, Any], task_id: str, user: str, ticker: str | None = None) -> dict[str, Any]:
    row = copy.deepcopy(row)
    row["reward_spec"]["ground_truth"]["task_id"] = task_id
    row["prompt"][-1]["content"] = user
    if ticker:
        row["reward_spec"]["ground_truth"]["tool_sequence"][0]["params"]["ticker"] = ticker
    return row


def ids(rows: list[dict[str, Any]]) -> list[str]:
    return [r["reward_spec"]["ground_truth"]["task_id"] for r in rows]


async def test_a_call_that_fails_offline_rejects_the_row(pool: LocalToolPool, inventory: Inventory) -> None:
    rows = fixture_rows()
    good, simple = rows[0], rows[22]
    unknown_ticker = variant(good, "zzzz", "Look up the ZZZZ company's last close and tell the team on Slack.", "ZZZZ")
    result = await a.admit([good, unknown_ticker, simple], pool, inventory, near_duplicate_threshold=0.9)
    assert ids(result.kept) == ["gate-good-1", "gate-good-2"]
    (rejection,) = result.rejected
    assert (rejection.task_id, rejection.reason) == ("zzzz", a.CALL_FAILED)
    assert rejection.detail.startswith("step 1 polygon.previous_close: invalid_arguments: ")
    assert "'ZZZZ' is not a known symbol" in rejection.detail
    assert result.summary() == "kept 2 of 3; rejected: 1 a tool call failed offline"


async def test_a_later_step_that_fails_is_named(pool: LocalToolPool, inventory: Inventory) -> None:
    row = fixture_rows()[0]
    row["reward_spec"]["ground_truth"]["tool_sequence"][1]["params"]["channel"] = "no-such-channel"
    result = await a.admit([row], pool, inventory, near_duplicate_threshold=0.9)
    assert result.kept == []
    assert result.rejected[0].detail.startswith("step 2 slack.post_message: ")


async def test_near_duplicates_are_dropped_keeping_the_first(pool: LocalToolPool, inventory: Inventory) -> None:
    good = fixture_rows()[0]
    twin = variant(good, "twin", good["prompt"][-1]["content"].upper())
    other = variant(good, "other", "Fetch the latest daily close of Nvidia and share the number with #markets.")
    result = await a.admit([good, twin, other], pool, inventory, near_duplicate_threshold=0.9)
    assert ids(result.kept) == ["gate-good-1", "other"]
    assert [(r.task_id, r.reason) for r in result.rejected] == [("twin", a.NEAR_DUPLICATES)]
    assert "near-duplicate of 'gate-good-1'" in result.rejected[0].detail
    # a row turned away for another reason does not keep its near-duplicates out
    broken = variant(good, "broken", "Say hi", "ZZZZ")
    twin_of_broken = variant(good, "fine", "say HI!")
    result = await a.admit([broken, twin_of_broken], pool, inventory, near_duplicate_threshold=0.9)
    assert ids(result.kept) == ["fine"]


async def test_duplicate_task_ids_keep_the_first(pool: LocalToolPool, inventory: Inventory) -> None:
    good = fixture_rows()[0]
    again = variant(good, "gate-good-1", "Something else entirely: Apple's closing price, posted to Slack.", "AAPL")
    result = await a.admit([good, again], pool, inventory, near_duplicate_threshold=0.9)
    assert ids(result.kept) == ["gate-good-1"]
    assert result.kept[0] is good
    assert [r.reason for r in result.rejected] == [a.DUPLICATE]


async def test_the_whole_fixture(pool: LocalToolPool, inventory: Inventory) -> None:
    rows = fixture_rows()
    result = await a.admit(rows, pool, inventory, near_duplicate_threshold=0.9)
    assert ids(result.kept) == ["gate-good-1", "gate-good-2"]
    assert result.counts() == {
        a.FAILS_SCHEMA: 14,
        a.BAD_PARAMS: 3,  # rows 8, 9, 17
        a.UNKNOWN: 2,  # rows 6, 7
        a.DUPLICATE: 1,  # row 10
        a.NEAR_DUPLICATES: 1,  # row 22
    }
    assert result.summary() == (
        "kept 2 of 23; rejected: 14 fail the schema, 3 params do not validate, "
        "2 name an unknown server or tool, 1 duplicate task_ids, 1 near-duplicates"
    )
    by_id = {r.task_id: r for r in result.rejected}
    assert "tool_sequence[1].params.limit" in by_id["gate-bad-params"].detail
    assert "unknown server 'bloomberg'" in by_id["gate-unknown-server"].detail


async def test_nothing_in_nothing_out(pool: LocalToolPool, inventory: Inventory) -> None:
    result = await a.admit([], pool, inventory, near_duplicate_threshold=0.9)
    assert (result.kept, result.rejected, result.summary()) == ([], [], "kept 0 of 0")


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_failed_calls_are_not_logged_as_errors(pool: LocalToolPool, inventory: Inventory) -> None:
    """FastMCP logs a failing call with a traceback; during admission that is an expected verdict."""
    row = variant(fixture_rows()[0], "zzzz", "ZZZZ close to Slack", "ZZZZ")
    logger = logging.getLogger("fastmcp")
    handler = Records()
    logger.addHandler(handler)
    try:
        with library_logs("fastmcp"):  # an earlier test in the process may have quieted it
            result = await a.admit([row], pool, inventory, near_duplicate_threshold=0.9)
            assert result.rejected[0].reason == a.CALL_FAILED
            assert handler.records == []
            assert logger.level == logging.DEBUG  # restored
            await pool.call_tool("polygon", "previous_close", {"ticker": "ZZZZ"})  # outside admission: logged
            assert handler.records
    finally:
        logger.removeHandler(handler)
