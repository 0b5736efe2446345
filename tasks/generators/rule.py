"""The `rule` generator: tasks from hand-written templates over the built-in tools.

A template draws its choices (ticker, fiscal year, date range, channel, phrasing) from a seeded
random generator, then *runs* its tool calls against the pool (offline backends) in order. A later
call's arguments are built from earlier results (a ratio read from fmp goes into the python code
that computes a P/E; that P/E goes into the Slack message), and the task's true answer is computed
from what the calls returned. The user prompt is written last, from one of several phrasings.

Two kinds of split (splits.py). A split by template holds whole templates no other split has
(transfer to a new tool pattern). A split by instance (`instance_splits`, e.g. validation) redraws
the train split's templates from choices training never shows: the tickers of `HELD_OUT_TICKERS`
and the last phrasing of each `say` list (`Ctx.held_out`); training, and the by-template splits
beside it, draw from the other 14 tickers and the other phrasings. Leads, closers and date formats
are shared. Without an instance split every draw has every choice (the rows are as before).

How rows are made: `n` is shared evenly by the complexities asked for (and, with a split, first by
the splits), and each (split, complexity) bucket goes round-robin over its templates in a seeded
order. A draw that repeats an earlier task, or whose prompt the gate would call a
near-duplicate (tasks/similarity.py, same threshold), is replaced by the next draw; so is one whose
data does not fit (a search that misses the page), and one with a tool result the env would cut
(longer than `env.max_observation_chars`): its expert would work from values the model is never shown.
So the templates ask for what fits: the fiscal ones for just the years they need (at most 3), and
`range_return` for one to two weeks of bars. A template with few distinct tasks (research_pe
has 6) runs out at large n and the others of its bucket fill in.

Deterministic: the same seed and options give the same rows. Draw i of a bucket uses its own
`Random(f"{seed}|{split}/{complexity}|{i}")`, so draws run concurrently without changing the outcome;
calls that fail for the machine's sake (timeout, sandbox) are repeated, not redrawn; and the Slack
workspace's posts change no answer (reads only ever look at #research, which no template posts to).

Each row: the system prompt below, the user prompt, `limits.max_servers` = the servers the calls
use, `limits.max_tools` = `opts.max_tools`, `max_turns` = `opts.max_turns` (templates that need more
calls or distinct tools than those allow are left out), `final_answer` with a tolerance, and
`extra_info` {method: rule, template, seed, split?, held_out? (true in an instance split), and what the
draw chose (ticker, year, ...)}.

The templates (id: complexity, calls):
    close_simple      simple  polygon.previous_close
    bar_field         simple  polygon.previous_close (open/high/low/volume)
    company_facts     simple  polygon.ticker_details
    profile_field     simple  fmp.company_profile
    fiscal_ratio      simple  fmp.key_ratios
    news_revenue      simple  tavily.search
    channel_info      simple  slack.list_channels
    research_note     simple  slack.read_history
    python_calc       simple  python.run_python
    range_return      medium  polygon.daily_aggregates → python.run_python
    fiscal_metric     medium  fmp.income_statement → python.run_python (USD → billions)
    pe_now            medium  polygon.previous_close → fmp.key_ratios → python.run_python
    cap_compare       medium  fmp.company_profile ×2
    quote_page        medium  tavily.search → tavily.extract
    post_close        medium  polygon.previous_close → slack.post_message
    yoy_growth        medium  fmp.income_statement → python.run_python
    pe_report         hard    polygon.previous_close → fmp.key_ratios → python.run_python → slack.post_message
    momentum_duel     hard    polygon.daily_aggregates ×2 → python.run_python → slack.post_message
    research_pe       hard    slack.read_history → polygon.previous_close → python.run_python → slack.post_message
    ttm_sales         hard    fmp.company_profile → fmp.income_statement → python.run_python → slack.post_message
                              (P/S, P/E or price/gross profit on the trailing four quarters)
    web_average       hard    tavily.search → tavily.extract → python.run_python → slack.post_message
                              (average, highest, lowest or range of the closes a quote page lists)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import date, timedelta
from typing import Any

from cluster.retry import RetryPolicy, retry_async
from configs.schema import Complexity, Config
from tasks.generators.options import GenerateOptions, GenerationError
from tasks.generators.splits import (
    assign_templates,
    check_instance_splits,
    check_splits,
    row_quotas,
    template_splits,
)
from tasks.observation import result_text
from tasks.schema import TaskRow
from tasks.similarity import jaccard, shingles

log = logging.getLogger(__name__)

DATA_SOURCE = "mcprl/rule"
SYSTEM_PROMPT = (
    "You are a financial research assistant that works by calling tools: market data (polygon), company "
    "fundamentals (fmp), web search (tavily), a Slack workspace (slack) and a Python sandbox (python). Call one "
    "tool at a time and build on what the tools return; never guess a number you can look up. When the task is "
    "done, reply with a short final answer that states the requested value."
)
# The offline universe's symbols (the backends reject others); names, prices and dates come from the tools.
TICKERS = (
    "AAPL", "MSFT", "NVDA", "GOOGL", "AMZN", "META", "TSLA", "AVGO", "AMD", "NFLX",
    "JPM", "BAC", "V", "UNH", "JNJ", "PFE", "XOM", "WMT", "KO", "DIS",
)  # fmt: skip
# Held out from training when a split is by instance: no training task names them, so the instance splits
# ask about companies the model never saw. One or two per sector, in proportion (half the universe is tech);
# KO is also the one #research note ticker held out (AAPL and NVDA stay for training). AAPL, the one
# `World` looks at, stays in training.
HELD_OUT_TICKERS = ("GOOGL", "AMD", "NFLX", "BAC", "PFE", "KO")
TRAIN_TICKERS = tuple(t for t in TICKERS if t not in HELD_OUT_TICKERS)
POST_CHANNELS = ("markets", "general")  # templates post here and never read these
READ_CHANNEL = "research"  # templates read here and never post here
CONCURRENCY = 8  # rows built at once (the python sandbox serializes its own calls)
MAX_ATTEMPTS_PER_ROW = 6  # draws per wanted row before a split stops short (small template spaces)
# Failures of the machine, not of the task: the call is repeated, so a busy machine does not change the rows.
TRANSIENT = frozenset({"timeout", "sandbox", "unavailable", "upstream"})
TRANSIENT_RETRY = RetryPolicy(retries=3, first_wait_s=0.2)


class Skip(Exception):
    """This draw cannot make a task (a call failed, a search missed the page): draw again."""


# --------------------------------------------------------------------------- building blocks


@dataclass
class Answer:
    value: float | str
    tolerance: float
    description: str


@dataclass
class Draft:
    question: str
    answer: Answer
    facts: dict[str, Any] = field(default_factory=dict)  # what the draw chose (kept in extra_info)


class World:
    """Facts shared by all rows of one run, looked up once with calls that are not part of any task."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._names: dict[str, str] = {}
        self._last_day: date | None = None
        self._lock = asyncio.Lock()
        self.python_slot = asyncio.Semaphore(1)

    async def _peek(self, server: str, tool: str, params: dict[str, Any]) -> Any:
        res = await self.pool.call_tool(server, tool, params)
        if not res.ok:
            raise Skip(f"lookup {server}.{tool} failed: {res.error}")
        return res.structured

    async def last_day(self) -> date:
        """The newest trading day the market data has (the offline backends' fixed 'yesterday')."""
        async with self._lock:
            if self._last_day is None:
                out = await self._peek("polygon", "previous_close", {"ticker": TICKERS[0]})
                self._last_day = date.fromisoformat(out["results"][0]["date"])
            return self._last_day

    async def name(self, ticker: str) -> str:
        """A company's everyday name (Apple, not Apple Inc.) for prompts and search queries."""
        if ticker not in self._names:
            out = await self._peek("polygon", "ticker_details", {"ticker": ticker})
            self._names[ticker] = short_name(out["results"]["name"])
        return self._names[ticker]


def short_name(name: str) -> str:
    for suffix in (", Inc.", " Inc.", " Corporation", " Incorporated", " & Co.", " Company"):
        name = name.removesuffix(suffix)
    return name.removeprefix("The ").strip()


class Ctx:
    """One draw: its random generator, and the calls it runs (recorded as the task's tool sequence)."""

    def __init__(
        self,
        rng: random.Random,
        pool: Any,
        world: World,
        max_observation_chars: int = 0,
        held_out: bool | None = None,
    ) -> None:
        self.rng = rng
        self.pool = pool
        self.world = world
        self.max_observation_chars = max_observation_chars  # the env's cut (env.max_observation_chars); 0: none
        # Which part of the choices (tickers, phrasings) this draw takes: True the held-out part (an instance
        # split), False the training part (the train split, and the by-template splits beside an instance
        # split), None all of them (no instance split asked for: the rows are as before there were any).
        self.held_out = held_out
        self.steps: list[dict[str, Any]] = []

    async def call(self, server: str, tool: str, **params: Any) -> Any:

        async def once(_: int) -> Any:
            # One python program at a time: queued calls would spend their timeout waiting for the sandbox.
            async with self.world.python_slot if server == "python" else contextlib.nullcontext():
                return await self.pool.call_tool(server, tool, dict(params))

        # A loaded machine, not a bad task: the same call again.
        res = await retry_async(once, TRANSIENT_RETRY, retry_result=lambda r: not r.ok and r.error_kind in TRANSIENT)
        if not res.ok:
            raise Skip(f"{server}.{tool} failed: {res.error_kind}: {res.error}")
        # A task whose expert works from a value the model is never shown teaches it to make that value up.
        shown = len(result_text(f"{server}.{tool}", res))
        if self.max_observation_chars and shown > self.max_observation_chars:
            raise Skip(f"{server}.{tool}'s result ({shown} characters) would be cut at env.max_observation_chars")
        self.steps.append({"step": len(self.steps) + 1, "server": server, "tool": tool, "params": dict(params)})
        return res.structured

    async def python(self, code: str) -> str:
        """Run code with the python tool; its stdout, stripped."""
        out = await self.call("python", "run_python", code=code)
        if out.get("exit_code") != 0:
            raise Skip(f"python exited {out.get('exit_code')}: {out.get('stderr', '')[-300:]}")
        return str(out["stdout"]).strip()

    async def python_number(self, code: str) -> float:
        text = await self.python(code)
        try:
            return float(text.splitlines()[-1])
        except (ValueError, IndexError):
            raise Skip(f"python printed {text!r}, not a number") from None

    def pick(self, options: Sequence[Any]) -> Any:
        return self.rng.choice(list(options))

    def tickers(self) -> tuple[str, ...]:
        """The tickers this draw may name (its part of `TICKERS`)."""
        return TICKERS if self.held_out is None else HELD_OUT_TICKERS if self.held_out else TRAIN_TICKERS

    def ticker(self) -> str:
        return self.pick(self.tickers())

    def ticker_pair(self) -> list[str]:
        """Two distinct tickers, both from this draw's part."""
        return self.rng.sample(self.tickers(), 2)

    def phrasings(self, phrasings: Sequence[str]) -> Sequence[str]:
        """This draw's part of a list of phrasings: the last one is held out (a list of one is shared)."""
        if self.held_out is None or len(phrasings) < 2:
            return phrasings
        return phrasings[-1:] if self.held_out else phrasings[:-1]

    def say(self, phrasings: Sequence[str], **fields: Any) -> str:
        """One phrasing of this draw's part, filled in, sometimes with a lead-in and a closing remark (shared)."""
        text = self.pick(self.phrasings(phrasings)).format(**fields)
        lead = self.pick(LEADS)
        first = text.split(" ", 1)[0]
        if lead.endswith((": ", ", ")) and not (
            (first.isupper() and len(first) > 1) or first.startswith("I'") or first == "I"
        ):
            text = text[0].lower() + text[1:]  # "Quick question: what was ..."
        return lead + text + self.pick(CLOSERS)

    def day(self, d: date) -> str:
        """A date as a person might write it."""
        return self.pick((d.isoformat(), f"{d:%B} {d.day}, {d.year}", f"{d:%b} {d.day}, {d.year}", d.isoformat()))


LEADS = ("", "", "", "Quick question: ", "Hi! ", "For a report I'm writing: ", "I need your help. ", "Hey, ")
CLOSERS = ("", "", "", " Thanks!", " Keep the answer short.", " Please be precise.", " I need this for a meeting.")


def weekday_on_or_before(d: date) -> date:
    while d.weekday() >= 5:
        d -= timedelta(days=1)
    return d


def weekday_on_or_after(d: date) -> date:
    while d.weekday() >= 5:
        d += timedelta(days=1)
    return d


# --------------------------------------------------------------------------- templates


@dataclass(frozen=True)
class Template:
    id: str
    complexity: Complexity
    calls: tuple[str, ...]  # `server.tool` of each call, in order (repeats included)
    build: Callable[[Ctx], Awaitable[Draft]]

    @property
    def servers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.split(".", 1)[0] for c in self.calls))

    @property
    def tools(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.calls))


TEMPLATES: dict[str, Template] = {}


def template(tid: str, complexity: Complexity, *calls: str) -> Callable[[Callable[[Ctx], Awaitable[Draft]]], Any]:
    def register(fn: Callable[[Ctx], Awaitable[Draft]]) -> Callable[[Ctx], Awaitable[Draft]]:
        TEMPLATES[tid] = Template(tid, complexity, calls, fn)
        return fn

    return register


# ---- simple: one call


@template("close_simple", "simple", "polygon.previous_close")
async def close_simple(c: Ctx) -> Draft:
    t = c.ticker()
    bar = (await c.call("polygon", "previous_close", ticker=t))["results"][0]
    q = c.say(
        (
            "What was {t}'s closing price on the most recent trading day?",
            "Look up the previous close for {t}.",
            "How did {t} finish in the last session? I need the closing price.",
            "Give me the latest closing price of {t} stock in USD.",
            "Can you check what {t} closed at in the last trading session?",
            "What is the most recent close for ticker {t}?",
        ),
        t=t,
    )
    return Draft(q, Answer(bar["c"], 0.01, f"{t} close on {bar['date']} in USD"), {"ticker": t})


@template("bar_field", "simple", "polygon.previous_close")
async def bar_field(c: Ctx) -> Draft:
    t = c.ticker()
    key, label = c.pick((("o", "opening price"), ("h", "intraday high"), ("l", "intraday low"), ("v", "volume")))
    bar = (await c.call("polygon", "previous_close", ticker=t))["results"][0]
    q = c.say(
        (
            "What was the {label} of {t} in the previous trading session?",
            "In {t}'s latest daily bar, what's the {label}?",
            "Tell me {t}'s {label} for the last session.",
            "Pull the previous day's {label} for {t}.",
        ),
        t=t,
        label=label,
    )
    tol = 0.0 if key == "v" else 0.01
    return Draft(q, Answer(bar[key], tol, f"{t} {label} on {bar['date']}"), {"ticker": t, "field": key})


@template("company_facts", "simple", "polygon.ticker_details")
async def company_facts(c: Ctx) -> Draft:
    t = c.ticker()
    info = (await c.call("polygon", "ticker_details", ticker=t))["results"]
    key, label = c.pick(
        (("total_employees", "number of employees"), ("list_date", "listing date"), ("homepage_url", "website"))
    )
    q = c.say(
        (
            "What is the {label} of the company behind ticker {t}?",
            "According to Polygon's reference data, what's {t}'s {label}?",
            "Find the {label} for {t}.",
            "I'd like to know {t}'s {label}.",
        ),
        t=t,
        label=label,
    )
    return Draft(q, Answer(info[key], 0.0, f"{t} {label}"), {"ticker": t, "field": key})


@template("profile_field", "simple", "fmp.company_profile")
async def profile_field(c: Ctx) -> Draft:
    t = c.ticker()
    prof = await c.call("fmp", "company_profile", symbol=t)
    key, label, tol = c.pick((("sector", "sector", 0.0), ("industry", "industry", 0.0), ("beta", "beta", 0.01)))
    q = c.say(
        (
            "Which {label} does {t} belong to, according to its company profile?",
            "Check {t}'s profile on FMP: what's its {label}?",
            "What {label} is listed for {t}?",
            "Get me the {label} from {t}'s company profile.",
        )
        if key != "beta"
        else (
            "What is {t}'s beta?",
            "How volatile is {t} relative to the market? Give me its beta from the company profile.",
            "Look up the beta of {t} stock.",
        ),
        t=t,
        label=label,
    )
    return Draft(q, Answer(prof[key], tol, f"{t} {label} (company profile)"), {"ticker": t, "field": key})


STATEMENT_METRICS = (
    ("revenue", "revenue"),
    ("netIncome", "net income"),
    ("operatingIncome", "operating income"),
    ("grossProfit", "gross profit"),
)


FISCAL_YEARS = 3  # how far back the fiscal templates reach: 3 annual statements are ~1,900 characters


async def annual_rows(c: Ctx, tool: str, t: str, years: int) -> list[dict[str, Any]]:
    """The newest `years` annual rows of fmp `tool` (income_statement or key_ratios), newest first: just the
    years a task needs, so that what the model is shown stays short."""
    got = await c.call("fmp", tool, symbol=t, period="annual", limit=years)
    rows = got["statements" if tool == "income_statement" else "ratios"]
    if len(rows) < years:
        raise Skip(f"{t} has {len(rows)} annual {tool} rows, not {years}")
    return rows


# The expert converts with the python tool: dividing a 12-digit number by 1e9 in its head, the demo's model
# answered 0 of 12 held-out tasks right after its warm start (docs/results/learning.md), so the template's
# groups carried no signal; with the program it answers some (4 of 20), and a right answer is reachable.
@template("fiscal_metric", "medium", "fmp.income_statement", "python.run_python")
async def fiscal_metric(c: Ctx) -> Draft:
    t = c.ticker()
    key, label = c.pick(STATEMENT_METRICS)
    row = (await annual_rows(c, "income_statement", t, c.rng.randrange(FISCAL_YEARS) + 1))[-1]
    year = row["fiscalYear"]
    value = await c.python_number(f"usd = {row[key]}\nprint(round(usd / 1e9, 2))\n")
    q = c.say(
        (
            "What was {t}'s {label} (in billions of USD) in fiscal year {year}?",
            "From {t}'s annual income statement, give me {label} for FY{year} in billions of USD.",
            "How much {label} did {t} report for fiscal {year}? Answer in billions of USD.",
            "I need {t}'s fiscal {year} {label}, in billions of USD.",
        ),
        t=t,
        label=label,
        year=year,
    )
    return Draft(q, Answer(value, 0.01, f"{t} FY{year} {label} in billions of USD"),
                 {"ticker": t, "field": key, "year": year})  # fmt: skip


RATIO_METRICS = (
    ("grossProfitMargin", "gross margin", True),
    ("netProfitMargin", "net profit margin", True),
    ("operatingProfitMargin", "operating margin", True),
    ("currentRatio", "current ratio", False),
    ("debtToEquityRatio", "debt-to-equity ratio", False),
    ("priceToEarningsRatio", "P/E ratio", False),
)


@template("fiscal_ratio", "simple", "fmp.key_ratios")
async def fiscal_ratio(c: Ctx) -> Draft:
    t = c.ticker()
    key, label, pct = c.pick(RATIO_METRICS)
    row = (await annual_rows(c, "key_ratios", t, c.rng.randrange(FISCAL_YEARS) + 1))[-1]
    year = row["fiscalYear"]
    q = c.say(
        (
            "What was {t}'s {label} in fiscal {year}?{how}",
            "Using FMP's annual ratios, find {t}'s {label} for FY{year}.{how}",
            "Tell me the {label} {t} had in fiscal year {year}.{how}",
            "Look up {t}'s fiscal {year} {label}.{how}",
        ),
        t=t,
        label=label,
        year=year,
        how=" Give it as a percentage." if pct else "",
    )
    value, tol = (round(row[key] * 100, 2), 0.05) if pct else (row[key], 0.01)
    desc = f"{t} FY{year} {label}" + (" in percent" if pct else "")
    return Draft(q, Answer(value, tol, desc), {"ticker": t, "field": key, "year": year})


REVENUE_IN_TEXT = re.compile(r"revenue of \$([\d,]+\.\d+) billion for (Q\d \d{4})")


@template("news_revenue", "simple", "tavily.search")
async def news_revenue(c: Ctx) -> Draft:
    t = c.ticker()
    name = await c.world.name(t)
    found = await c.call("tavily", "search", query=f"{name} quarterly earnings results", topic="news", max_results=5)
    for r in found["results"]:
        m = REVENUE_IN_TEXT.search(r["content"])
        if m and f"/{t.lower()}-q" in r["url"]:
            break
    else:
        raise Skip(f"news search missed {t}'s earnings story")
    q = c.say(
        (
            "Search the news: how much revenue did {name} report for its latest quarter?",
            "What quarterly revenue did {name} announce in its most recent earnings release? Check the news.",
            "Find recent news on {name}'s earnings. What was the quarter's revenue, in billions of USD?",
            "According to the latest earnings news, how much did {name} bring in last quarter?",
        ),
        name=name,
    )
    value = float(m.group(1).replace(",", ""))
    return Draft(q, Answer(value, 0.01, f"{t} {m.group(2)} revenue in billions of USD"), {"ticker": t})


@template("channel_info", "simple", "slack.list_channels")
async def channel_info(c: Ctx) -> Draft:
    channels = (await c.call("slack", "list_channels"))["channels"]
    ch = c.pick(channels)
    key, label = c.pick((("num_members", "member count"), ("purpose", "purpose"), ("topic", "topic")))
    q = c.say(
        (
            "What's the {label} of the #{ch} channel in our Slack?",
            "In Slack, look up #{ch}: what is its {label}?",
            "Check the Slack workspace and tell me the {label} of #{ch}.",
        )
        if key != "num_members"
        else (
            "How many members does the #{ch} Slack channel have?",
            "How many people are in #{ch} on Slack?",
            "Give me the member count of our #{ch} channel.",
        ),
        ch=ch["name"],
        label=label,
    )
    return Draft(q, Answer(ch[key], 0.0, f"#{ch['name']} {label}"), {"channel": ch["name"], "field": key})


NOTE = re.compile(
    r"^(?P<t>[A-Z.]+) (?P<q>Q\d \d{4}): revenue \$(?P<rev>[\d,.]+)B, net income \$(?P<ni>[-\d,.]+)B, "
    r"EPS \$(?P<eps>-?[\d.]+)\.$"
)


async def research_notes(c: Ctx) -> list[re.Match[str]]:
    """The research notes in #research (a recorded call): ticker, quarter, revenue, net income, EPS."""
    history = await c.call("slack", "read_history", channel=READ_CHANNEL, limit=20)
    notes = [m for m in (NOTE.match(msg["text"]) for msg in history["messages"]) if m and m["t"] in c.tickers()]
    if not notes:
        raise Skip("no research notes in #research on this draw's tickers")
    return notes


@template("research_note", "simple", "slack.read_history")
async def research_note(c: Ctx) -> Draft:
    note = c.pick(await research_notes(c))
    key, label, unit = c.pick(
        (("eps", "EPS", "USD"), ("rev", "revenue", "billions of USD"), ("ni", "net income", "billions of USD"))
    )
    q = c.say(
        (
            "Someone posted {t}'s quarterly numbers in #research on Slack. What {label} did they report?",
            "Read #research in Slack and tell me the {label} noted for {t}.",
            "What {label} figure for {t} was shared in the #research channel?",
        ),
        t=note["t"],
        label=label,
    )
    value = float(note[key].replace(",", ""))
    return Draft(q, Answer(value, 0.01, f"{note['t']} {note['q']} {label} in {unit}, as noted in #research"),
                 {"ticker": note["t"], "field": key})  # fmt: skip


@template("python_calc", "simple", "python.run_python")
async def python_calc(c: Ctx) -> Draft:
    kind = c.pick(("stats", "stats", "compound"))
    if kind == "stats":
        xs = [round(c.rng.uniform(10, 500), 2) for _ in range(c.rng.randint(6, 10))]
        fn, label = c.pick((("mean", "mean"), ("median", "median"), ("pstdev", "population standard deviation"),
                            ("stdev", "sample standard deviation")))  # fmt: skip
        code = f"import statistics\nxs = {xs}\nprint(round(statistics.{fn}(xs), 4))\n"
        value = await c.python_number(code)
        nums = ", ".join(f"{x:g}" for x in xs)
        q = c.say(
            (
                "Use Python to compute the {label} of these prices: {nums}.",
                "With the Python tool, what is the {label} of {nums}?",
                "Run some Python and give me the {label} of the following values: {nums}.",
            ),
            label=label,
            nums=nums,
        )
        return Draft(q, Answer(value, 0.001, f"{label} of the given numbers, 4 decimals"), {"kind": fn})
    principal = c.rng.randrange(1_000, 50_000, 500)
    rate = c.pick((2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8))
    years = c.rng.randint(2, 30)
    code = f"p, r, y = {principal}, {rate} / 100, {years}\nprint(round(p * (1 + r / 12) ** (12 * y), 2))\n"
    value = await c.python_number(code)
    q = c.say(
        (
            "Use Python: if I invest ${p:,} at {r}% a year, compounded monthly, what is it worth after {y} years?",
            "Compute with the Python tool the value of ${p:,} after {y} years at {r}% annual interest compounded "
            "monthly.",
            "How much will ${p:,} grow to in {y} years at {r}% per year, compounded monthly? Work it out in Python.",
        ),
        p=principal,
        r=rate,
        y=years,
    )
    return Draft(q, Answer(value, 0.01, "future value in USD, monthly compounding"), {"kind": "compound"})


# ---- medium: 2-3 calls


async def date_range(c: Ctx, min_days: int = 7, max_days: int = 60) -> tuple[date, date]:
    last = await c.world.last_day()
    end = weekday_on_or_before(last - timedelta(days=c.rng.randint(0, 60)))
    start = weekday_on_or_after(end - timedelta(days=c.rng.randint(min_days, max_days)))
    return start, end


async def closes(c: Ctx, t: str, start: date, end: date) -> list[dict[str, Any]]:
    bars = (
        await c.call("polygon", "daily_aggregates", ticker=t, from_date=start.isoformat(), to_date=end.isoformat())
    )["results"]
    if len(bars) < 2 or bars[0]["date"] != start.isoformat() or bars[-1]["date"] != end.isoformat():
        raise Skip(f"{t} has no bars on both {start} and {end}")
    return bars


@template("range_return", "medium", "polygon.daily_aggregates", "python.run_python")
async def range_return(c: Ctx) -> Draft:
    t = c.ticker()
    start, end = await date_range(c, 5, 14)  # one to two weeks of bars: ~1,400 characters at most
    bars = await closes(c, t, start, end)
    first, last = bars[0]["c"], bars[-1]["c"]
    value = await c.python_number(f"start, end = {first}, {last}\nprint(round((end / start - 1) * 100, 2))\n")
    q = c.say(
        (
            "By what percentage did {t} move from the close on {d1} to the close on {d2}? Get the daily bars and "
            "compute it with Python.",
            "Compute {t}'s close-to-close return between {d1} and {d2}, in percent, using the Python tool.",
            "How much did {t} gain or lose from {d1} to {d2} (closing prices)? Use Python for the math.",
            "Pull {t}'s daily prices for {d1} through {d2} and work out the percent change in Python.",
        ),
        t=t,
        d1=c.day(start),
        d2=c.day(end),
    )
    return Draft(q, Answer(value, 0.05, f"{t} % change in close {start}..{end}"),
                 {"ticker": t, "from": start.isoformat(), "to": end.isoformat()})  # fmt: skip


# Divided with the python tool, as fiscal_metric converts: in its head the model never got one right.
@template("pe_now", "medium", "polygon.previous_close", "fmp.key_ratios", "python.run_python")
async def pe_now(c: Ctx) -> Draft:
    t = c.ticker()
    bar = (await c.call("polygon", "previous_close", ticker=t))["results"][0]
    ratio = (await c.call("fmp", "key_ratios", symbol=t, period="annual", limit=1))["ratios"][0]
    eps = ratio["netIncomePerShare"]
    if eps <= 0:
        raise Skip(f"{t} has no earnings")
    q = c.say(
        (
            "Take {t}'s latest close and divide it by its net income per share from the most recent fiscal year's "
            "ratios. What P/E does that give?",
            "What's {t}'s P/E at the previous close, using last fiscal year's net income per share from FMP?",
            "Compute {t}'s current price-to-earnings ratio: the last closing price over the latest annual net "
            "income per share.",
        ),
        t=t,
    )
    value = await c.python_number(f"close, eps = {bar['c']}, {eps}\nprint(round(close / eps, 2))\n")
    return Draft(q, Answer(value, 0.05, f"{t} close {bar['date']} / FY{ratio['fiscalYear']} net income per share"),
                 {"ticker": t})  # fmt: skip


@template("cap_compare", "medium", "fmp.company_profile", "fmp.company_profile")
async def cap_compare(c: Ctx) -> Draft:
    a, b = c.ticker_pair()
    ca = (await c.call("fmp", "company_profile", symbol=a))["marketCap"]
    cb = (await c.call("fmp", "company_profile", symbol=b))["marketCap"]
    big, small = (a, b) if ca >= cb else (b, a)
    q = c.say(
        (
            "Which is worth more by market cap, {a} or {b}, and by what factor?",
            "Compare the market capitalizations of {a} and {b}: how many times bigger is the larger one?",
            "Between {a} and {b}, which company has the larger market cap? Give the ratio of the two.",
        ),
        a=a,
        b=b,
    )
    value = round(max(ca, cb) / min(ca, cb), 2)
    return Draft(q, Answer(value, 0.02, f"market cap of {big} / market cap of {small}"), {"tickers": [a, b]})


VOLUME_IN_TEXT = re.compile(r"on volume of ([\d,]+) shares")
CLOSE_LINE = re.compile(r"^(\d{4}-\d{2}-\d{2})\s+close \$([\d,.]+)", re.M)


async def quote_page(c: Ctx, t: str) -> str:
    """Search for a company's quote page, then extract it (two recorded calls); the page's text."""
    name = await c.world.name(t)
    found = await c.call("tavily", "search", query=f"{name} stock price quote", max_results=3)
    url = next((r["url"] for r in found["results"] if r["url"].endswith(f"/quote/{t}")), None)
    if url is None:
        raise Skip(f"search missed {t}'s quote page")
    page = await c.call("tavily", "extract", urls=[url])
    if not page["results"]:
        raise Skip(f"extract failed for {url}")
    return page["results"][0]["raw_content"]


@template("quote_page", "medium", "tavily.search", "tavily.extract")
async def quote_page_facts(c: Ctx) -> Draft:
    t = c.ticker()
    name = await c.world.name(t)
    text = await quote_page(c, t)
    if c.rng.random() < 0.5:
        m = VOLUME_IN_TEXT.search(text)
        if not m:
            raise Skip("no volume on the quote page")
        q = c.say(
            (
                "Find {name}'s stock quote page on the web and tell me the trading volume of the latest session.",
                "Search the web for a {name} quote page and read it: how many shares traded in the last session?",
            ),
            name=name,
        )
        return Draft(q, Answer(int(m.group(1).replace(",", "")), 0.0, f"{t} latest volume (quote page)"),
                     {"ticker": t, "field": "volume"})  # fmt: skip
    day, close = c.pick(CLOSE_LINE.findall(text))
    q = c.say(
        (
            "Look up {name}'s quote page on the web and read its recent closes: what did it close at on {d}?",
            "Search the web for {name}'s stock quote, open the page and tell me the closing price on {d}.",
        ),
        name=name,
        d=c.day(date.fromisoformat(day)),
    )
    return Draft(q, Answer(float(close.replace(",", "")), 0.01, f"{t} close on {day} (quote page)"),
                 {"ticker": t, "field": "close", "day": day})  # fmt: skip


@template("post_close", "medium", "polygon.previous_close", "slack.post_message")
async def post_close(c: Ctx) -> Draft:
    t = c.ticker()
    ch = c.pick(POST_CHANNELS)
    bar = (await c.call("polygon", "previous_close", ticker=t))["results"][0]
    await c.call("slack", "post_message", channel=ch, text=f"{t} closed at ${bar['c']:.2f} on {bar['date']}.")
    q = c.say(
        (
            "Post {t}'s latest closing price to #{ch} on Slack.",
            "Look up where {t} closed in the last session and share it in the #{ch} channel.",
            "Let the team in #{ch} know {t}'s previous close.",
            "Get {t}'s most recent close and drop it into Slack #{ch}.",
        ),
        t=t,
        ch=ch,
    )
    return Draft(q, Answer(bar["c"], 0.01, f"{t} close on {bar['date']} in USD, posted to #{ch}"),
                 {"ticker": t, "channel": ch})  # fmt: skip


@template("yoy_growth", "medium", "fmp.income_statement", "python.run_python")
async def yoy_growth(c: Ctx) -> Draft:
    t = c.ticker()
    key, label = c.pick(STATEMENT_METRICS)
    cur, prev = (await annual_rows(c, "income_statement", t, c.rng.randrange(FISCAL_YEARS - 1) + 2))[-2:]
    if prev[key] <= 0:
        raise Skip(f"{t} {key} not positive in {prev['fiscalYear']}")
    value = await c.python_number(f"cur, prev = {cur[key]}, {prev[key]}\nprint(round((cur / prev - 1) * 100, 2))\n")
    q = c.say(
        (
            "How much did {t}'s {label} grow from fiscal {y0} to fiscal {y1}, in percent? Use Python for the math.",
            "Compute the year-over-year change in {t}'s annual {label} between FY{y0} and FY{y1} with the Python tool.",
            "Get {t}'s income statements and work out in Python the percent change in {label} from {y0} to {y1}.",
        ),
        t=t,
        label=label,
        y0=prev["fiscalYear"],
        y1=cur["fiscalYear"],
    )
    return Draft(q, Answer(value, 0.05, f"{t} {label} growth FY{prev['fiscalYear']}→FY{cur['fiscalYear']} in %"),
                 {"ticker": t, "field": key, "year": cur["fiscalYear"]})  # fmt: skip


# ---- hard: 4+ calls, later arguments computed from earlier results


@template("pe_report", "hard", "polygon.previous_close", "fmp.key_ratios", "python.run_python", "slack.post_message")
async def pe_report(c: Ctx) -> Draft:
    t = c.ticker()
    ch = c.pick(POST_CHANNELS)
    years = c.pick((1, 1, 2, 3))  # P/E on the last year's earnings, or on their average over 2-3 years
    bar = (await c.call("polygon", "previous_close", ticker=t))["results"][0]
    ratios = (await c.call("fmp", "key_ratios", symbol=t, period="annual", limit=years))["ratios"]
    eps = [r["netIncomePerShare"] for r in ratios]
    if len(eps) < years or sum(eps) <= 0:
        raise Skip(f"{t} has no earnings over {years} years")
    pe = await c.python_number(f"close = {bar['c']}\neps = {eps}\nprint(round(close / (sum(eps) / len(eps)), 2))\n")
    span = f"FY{ratios[0]['fiscalYear']}" if years == 1 else f"FY{ratios[-1]['fiscalYear']}-{ratios[0]['fiscalYear']}"
    text = f"{t} trades at {pe:.2f}x {span} earnings per share (close ${bar['c']:.2f})."
    await c.call("slack", "post_message", channel=ch, text=text)
    basis = (
        "the most recent fiscal year's net income per share"
        if years == 1
        else f"the average net income per share of the last {years} fiscal years"
    )
    q = c.say(
        (
            "Get {t}'s previous close, then from FMP's annual ratios {basis}; compute the P/E in Python and post a "
            "one-line summary to #{ch}.",
            "I want {t}'s P/E at the last close based on {basis}. Calculate it with the Python tool and share the "
            "result in Slack #{ch}.",
            "Work out {t}'s price-to-earnings ratio (last close over {basis}) using Python, then tell #{ch} about it.",
        ),
        t=t,
        ch=ch,
        basis=basis,
    )
    return Draft(q, Answer(pe, 0.05, f"{t} P/E: close {bar['date']} / mean {span} net income per share"),
                 {"ticker": t, "channel": ch, "years": years})  # fmt: skip


@template(
    "momentum_duel",
    "hard",
    "polygon.daily_aggregates",
    "polygon.daily_aggregates",
    "python.run_python",
    "slack.post_message",
)
async def momentum_duel(c: Ctx) -> Draft:
    a, b = c.ticker_pair()
    ch = c.pick(POST_CHANNELS)
    start, end = await date_range(c, 10, 90)
    ba, bb = await closes(c, a, start, end), await closes(c, b, start, end)
    code = (
        f"a0, a1 = {ba[0]['c']}, {ba[-1]['c']}\nb0, b1 = {bb[0]['c']}, {bb[-1]['c']}\n"
        f"ra, rb = (a1 / a0 - 1) * 100, (b1 / b0 - 1) * 100\n"
        f"print('{a}' if ra >= rb else '{b}', round(ra, 2), round(rb, 2))\n"
    )
    out = (await c.python(code)).split()
    winner, ra, rb = out[0], float(out[1]), float(out[2])
    (best, worst), loser = ((ra, rb), b) if winner == a else ((rb, ra), a)
    text = f"{winner} beat {loser} from {start} to {end}: {best:+.2f}% vs {worst:+.2f}%."
    await c.call("slack", "post_message", channel=ch, text=text)
    q = c.say(
        (
            "Which did better from {d1} to {d2}, {a} or {b}? Get both price histories, compute each return in "
            "Python, and post the winner with its return to #{ch}.",
            "Compare the close-to-close returns of {a} and {b} between {d1} and {d2} (use Python), then announce "
            "the better performer and its return in #{ch}.",
            "Run a momentum check: {a} vs {b}, {d1} through {d2}. Compute the percent returns with Python and share "
            "the stronger one's return on Slack in #{ch}.",
        ),
        a=a,
        b=b,
        d1=c.day(start),
        d2=c.day(end),
        ch=ch,
    )
    return Draft(q, Answer(best, 0.05, f"return in % of {winner}, the better of {a} and {b}, {start}..{end}"),
                 {"tickers": [a, b], "channel": ch, "from": start.isoformat(), "to": end.isoformat()})  # fmt: skip


@template(
    "research_pe", "hard", "slack.read_history", "polygon.previous_close", "python.run_python", "slack.post_message"
)
async def research_pe(c: Ctx) -> Draft:
    note = c.pick(await research_notes(c))
    t, eps = note["t"], float(note["eps"])
    if eps <= 0:
        raise Skip(f"{t} quarterly EPS not positive")
    ch = c.pick(POST_CHANNELS)
    bar = (await c.call("polygon", "previous_close", ticker=t))["results"][0]
    pe = await c.python_number(f"close, q_eps = {bar['c']}, {eps}\nprint(round(close / (4 * q_eps), 2))\n")
    await c.call("slack", "post_message", channel=ch, text=f"{t} run-rate P/E: {pe:.2f} (close ${bar['c']:.2f}, "
                 f"{note['q']} EPS ${eps:.2f} x4).")  # fmt: skip
    q = c.say(
        (
            "A colleague posted {t}'s latest quarterly results in #research. Take the EPS from that note, get {t}'s "
            "previous close, compute a run-rate P/E (price / (4 × quarterly EPS)) in Python and post it to #{ch}.",
            "Read the {t} note in #research, combine its quarterly EPS with the stock's latest close to get a "
            "run-rate P/E (close divided by four times EPS) using Python, and share it in #{ch}.",
        ),
        t=t,
        ch=ch,
    )
    return Draft(q, Answer(pe, 0.05, f"{t} close {bar['date']} / (4 x {note['q']} EPS from #research)"),
                 {"ticker": t, "channel": ch})  # fmt: skip


TTM_MULTIPLES = (("revenue", "price-to-sales", "sales"), ("netIncome", "price-to-earnings", "earnings"),
                 ("grossProfit", "price-to-gross-profit", "gross profit"))  # fmt: skip


@template("ttm_sales", "hard", "fmp.company_profile", "fmp.income_statement", "python.run_python", "slack.post_message")
async def ttm_sales(c: Ctx) -> Draft:
    t = c.ticker()
    ch = c.pick(POST_CHANNELS)
    key, multiple, what = c.pick(TTM_MULTIPLES)
    cap = (await c.call("fmp", "company_profile", symbol=t))["marketCap"]
    qs = (await c.call("fmp", "income_statement", symbol=t, period="quarter", limit=4))["statements"]
    values = [r[key] for r in qs]
    if sum(values) <= 0:
        raise Skip(f"{t} has no trailing {what}")
    ratio = await c.python_number(f"cap = {cap}\nquarters = {values}\nprint(round(cap / sum(quarters), 2))\n")
    await c.call("slack", "post_message", channel=ch, text=f"{t} trades at {ratio:.2f}x trailing-twelve-month "
                 f"{what} (market cap ${cap / 1e9:,.1f}B).")  # fmt: skip
    q = c.say(
        (
            "What's {t}'s {multiple} ratio on trailing twelve months? Get its market cap from the profile and the "
            "last four quarters of {what}, compute the ratio in Python, and post it to #{ch}.",
            "Compute {t}'s TTM {multiple} multiple: market cap divided by the sum of its last 4 quarters of {what} "
            "(use Python), then share the number with #{ch}.",
        ),
        t=t,
        ch=ch,
        multiple=multiple,
        what=what,
    )
    return Draft(q, Answer(ratio, 0.02, f"{t} market cap / sum of last 4 quarters of {what}"),
                 {"ticker": t, "channel": ch, "field": key})  # fmt: skip


CLOSE_STATS = (
    ("average", "round(sum(closes) / len(closes), 2)"),
    ("highest", "max(closes)"),
    ("lowest", "min(closes)"),
    ("range (highest minus lowest)", "round(max(closes) - min(closes), 2)"),
)


@template("web_average", "hard", "tavily.search", "tavily.extract", "python.run_python", "slack.post_message")
async def web_average(c: Ctx) -> Draft:
    t = c.ticker()
    ch = c.pick(POST_CHANNELS)
    stat, expr = c.pick(CLOSE_STATS)
    name = await c.world.name(t)
    rows = CLOSE_LINE.findall(await quote_page(c, t))
    if len(rows) < 3:
        raise Skip(f"too few closes on {t}'s quote page")
    values = [float(v.replace(",", "")) for _, v in rows]
    value = await c.python_number(f"closes = {values}\nprint({expr})\n")
    await c.call("slack", "post_message", channel=ch, text=f"{t}: the {stat} close over the last {len(values)} "
                 f"sessions ({rows[0][0]} to {rows[-1][0]}) was ${value:.2f}.")  # fmt: skip
    q = c.say(
        (
            "Find {name}'s stock quote page on the web, read the recent closing prices listed there, compute their "
            "{stat} in Python and post it to #{ch}.",
            "Search for {name}'s quote page, extract it, and work out the {stat} of the recent daily closes it shows "
            "with Python. Share the result in Slack #{ch}.",
        ),
        name=name,
        ch=ch,
        stat=stat,
    )
    return Draft(q, Answer(value, 0.01, f"{t} {stat} close over {rows[0][0]}..{rows[-1][0]} (quote page)"),
                 {"ticker": t, "channel": ch, "stat": stat})  # fmt: skip


# --------------------------------------------------------------------------- generation


def eligible_templates(opts: GenerateOptions, available: set[str] | None = None) -> list[Template]:
    """The templates that fit the options: complexity, domains, max tools, max turns and the pool's tools.

    `available`: the pool's `server.tool` names (None = assume all built-ins are there).
    """
    out = []
    for t in TEMPLATES.values():
        if t.complexity not in opts.complexities:
            continue
        if opts.domains and not set(t.servers) <= set(opts.domains):
            continue
        if len(t.tools) > opts.max_tools or len(t.calls) > opts.max_turns:
            continue
        if available is not None and not set(t.tools) <= available:
            continue
        out.append(t)
    if not out:
        raise GenerationError(
            f"no rule template fits complexities={list(opts.complexities)}, domains={list(opts.domains) or 'all'}, "
            f"max_tools={opts.max_tools}, max_turns={opts.max_turns}; templates: "
            + ", ".join(f"{t.id} ({t.complexity}: {'+'.join(t.servers)})" for t in TEMPLATES.values())
        )
    return out


def to_row(
    tpl: Template,
    draft: Draft,
    steps: list[dict[str, Any]],
    opts: GenerateOptions,
    split: str | None,
    held_out: bool = False,
) -> dict:
    """The TaskRow (validated) for a built draft; `held_out`: drawn from the held-out instances."""
    content = json.dumps([tpl.id, steps, draft.answer.description], sort_keys=True, default=str)
    task_id = f"rule-{tpl.id}-{hashlib.sha256(content.encode()).hexdigest()[:12]}"
    first = steps[0]
    extra: dict[str, Any] = {"method": "rule", "template": tpl.id, "seed": opts.seed, **draft.facts}
    if split:
        extra["split"] = split
    if held_out:
        extra["held_out"] = True
    row = TaskRow.model_validate(
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": draft.question}],
            "reward_spec": {
                "method": "rule",
                "ground_truth": {
                    "task_id": task_id,
                    "complexity": tpl.complexity,
                    "max_turns": opts.max_turns,
                    "success": {"must_call_tool": f"{first['server']}.{first['tool']}"},
                    "tool_sequence": steps,
                    "limits": {"max_servers": len(tpl.servers), "max_tools": opts.max_tools},
                    "final_answer": {
                        "value": draft.answer.value,
                        "tolerance": draft.answer.tolerance,
                        "description": draft.answer.description,
                    },
                },
            },
            "extra_info": extra,
        }
    )
    return row.model_dump(mode="json")


class _Builder:
    def __init__(
        self, pool: Any, opts: GenerateOptions, near_duplicate_threshold: float, max_observation_chars: int = 0
    ) -> None:
        self.pool = pool
        self.max_observation_chars = max_observation_chars
        self.opts = opts
        self.threshold = near_duplicate_threshold
        self.prompts: list[frozenset[str]] = []  # accepted user prompts, as the gate compares them
        self.world = World(pool)
        self.slots = asyncio.Semaphore(CONCURRENCY)
        self.skipped: dict[str, int] = {}  # draws that could not make a task, by template
        self.reasons: dict[str, str] = {}  # the first such reason of each template
        self.done = 0

    async def one(self, key: str, index: int, tpl: Template, held_out: bool | None) -> tuple[str, dict] | None:
        """Draw number `index` of a bucket: its own random generator, its calls, its row (None when skipped)."""
        rng = random.Random(f"{self.opts.seed}|{key}|{index}")
        ctx = Ctx(rng, self.pool, self.world, self.max_observation_chars, held_out)
        async with self.slots:
            try:
                draft = await tpl.build(ctx)
            except Skip as e:
                self.skipped[tpl.id] = self.skipped.get(tpl.id, 0) + 1
                self.reasons.setdefault(tpl.id, str(e))
                log.debug("skip %s #%d: %s", tpl.id, index, e)
                return None
        row = to_row(tpl, draft, ctx.steps, self.opts, key.split("/")[0] or None, bool(held_out))
        return row["reward_spec"]["ground_truth"]["task_id"], row

    async def fill(
        self, split: str | None, templates: list[Template], quota: int, held_out: bool | None = None
    ) -> list[dict]:
        """`quota` distinct rows from `templates`, shared evenly by their complexities (fewer if a space runs out);
        `held_out` picks the part of the choices they draw from (see `Ctx`)."""
        kinds = [k for k in self.opts.complexities if any(t.complexity == k for t in templates)]
        rows: list[dict] = []
        for kind, want in row_quotas(quota, {k: 1 / len(kinds) for k in kinds}).items():
            mine = [t for t in templates if t.complexity == kind]
            rows += await self._bucket(f"{split or ''}/{kind}", mine, want, held_out)
        return rows

    async def _bucket(self, key: str, templates: list[Template], want: int, held_out: bool | None) -> list[dict]:
        rows: dict[str, dict] = {}
        order = sorted(templates, key=lambda t: t.id)
        random.Random(f"{self.opts.seed}|{key}|order").shuffle(order)  # round-robin: templates share evenly
        index, budget = 0, want * MAX_ATTEMPTS_PER_ROW + 20
        while len(rows) < want and index < budget:
            batch = range(index, index + min(want - len(rows), budget - index))
            index += len(batch)
            for got in await asyncio.gather(*(self.one(key, i, order[i % len(order)], held_out) for i in batch)):
                # The same task drawn twice counts once; a prompt the gate would call a near-duplicate is
                # redrawn here, so admission keeps what we make.
                if got and got[0] not in rows and len(rows) < want and self._novel(got[1]):
                    rows[got[0]] = got[1]
                    self.done += 1
                    self.opts.report(self.done, self.opts.n)
        if len(rows) < want:
            log.warning(
                "rule: %s got %d of %d rows: its templates (%s) ran out of distinct tasks",
                key, len(rows), want, ", ".join(t.id for t in templates),
            )  # fmt: skip
        return list(rows.values())

    def _novel(self, row: dict) -> bool:
        words = shingles(row["prompt"][-1]["content"])
        if any(jaccard(words, seen) >= self.threshold for seen in self.prompts):
            return False
        self.prompts.append(words)
        return True


async def available_tools(pool: Any) -> set[str]:
    listing = await pool.list_tools()
    return {f"{server}.{t['name']}" for server, tools in listing.items() for t in tools}


async def generate(cfg: Config, opts: GenerateOptions, pool: Any) -> list[dict[str, Any]]:
    """`opts.n` candidate rows from the templates that fit `opts` (split by template when `opts.splits`, and by
    instance for `opts.instance_splits`: see splits.py)."""
    templates = eligible_templates(opts, await available_tools(pool))
    instance = check_instance_splits(opts.splits, opts.instance_splits)
    splits = check_splits(opts.splits) if opts.splits else {}
    builder = _Builder(pool, opts, cfg.generation.near_duplicate_threshold, cfg.env.max_observation_chars)
    opts.report(0, opts.n)
    if not splits:
        rows = await builder.fill(None, templates, opts.n)
    else:
        by_id = {t.id: t for t in templates}
        by_template = template_splits(splits, instance)
        if len(by_template) > 1:
            where = assign_templates(list(by_id), by_template, opts.seed, {t.id: t.complexity for t in templates})
        else:  # train alone: it has every template, the instance splits redraw them all
            where = dict.fromkeys(by_id, "train")
        # With an instance split the choices are partitioned; the by-template splits (train and e.g. transfer)
        # all take the training part, so a transfer task differs from training by its template alone.
        part = False if instance else None
        rows = []
        quotas = {k: opts.split_rows[k] for k in splits} if opts.split_rows else row_quotas(opts.n, splits)
        for split, quota in quotas.items():
            home, held_out = ("train", True) if split in instance else (split, part)
            mine = [by_id[tid] for tid, s in sorted(where.items()) if s == home]
            rows += await builder.fill(split, mine, quota, held_out)
    for tid, count in sorted(builder.skipped.items()):
        log.info("rule: redrew %s ×%d (first: %s)", tid, count, builder.reasons[tid])
    return rows
