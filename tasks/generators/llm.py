"""The `llm` generator: an OpenAI-compatible model writes tasks for the tool inventory.

One request per sample, through strict structured outputs (`tasks.openai_client.StructuredClient`).
Each sample is planned before it is asked, deterministically from the seed:

- its complexity: the wanted complexities in turn (simple, medium, hard, simple, ...), leaving out
  those whose call count cannot fit `max_turns`;
- its focus tool, which must be the task's first call: drawn from the catalog by
  `Random(f"{seed}|{method}|{index}")` here; the `mcp` generator takes the tools in turn instead, so
  each of a server's tools gets tasks.

The prompt lists the tools (`server.tool`, one line of description, one line per parameter with its
type, constraints and description) and the constraints. The answer's JSON schema (`task_schema`) has
fixed object shapes, as strict mode requires: `server` and `tool` are enums of the catalog, the
complexity is the planned one, the call count is bounded, and each step's `params` is a JSON object
*encoded as a string* (its shape differs per tool), which is decoded here.

An answer becomes a row (data_source `mcprl/<method>`, extra_info method/model/sample/seed/template)
when its calls name catalog tools, its params decode to objects, its first call is the focus tool,
its call count fits the complexity and `max_turns`, and it uses at most `max_tools` distinct tools.
Anything else is skipped and counted by reason (`GenerationReport.skipped`); so are answers that are
not the JSON asked for (`output_<reason>`) and requests that failed after the retries
(`request_<kind>`). A bad key or an unknown model stops the run (`GenerationError`).

`final_answer` (optional): when the model names where the answer is (`answer_path`, a dotted path into
the last call's JSON result, e.g. `results.0.c`), the plan is run against the pool (offline backends)
and, when every call succeeds and the path leads to a number (or a numeric string, e.g. a program's
stdout), that number becomes `final_answer.value` with a tolerance of 0.1% (at least 0.01). With no
path, or when a call fails, the row has no final answer: admission runs every call again and judges.

Knobs in `opts.extra` (all optional): `context` (text appended to the prompt, e.g. which entities the
offline data knows), `max_output_tokens` (cap on each answer), `max_string_chars` (adds `maxLength` to
the schema's strings; for local engines that honor it, not for OpenAI's strict mode).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from configs.schema import Complexity, Config
from tasks.generators.options import GenerateOptions, GenerationError
from tasks.inventory import ToolListing, local_name
from tasks.openai_client import MissingAPIKey, RequestFailed, StructuredClient, StructuredOutputError
from tasks.schema import COMPLEXITY_CALLS, TaskRow

log = logging.getLogger(__name__)

SCHEMA_NAME = "mcprl_task"
COMPLEXITY_ORDER: tuple[Complexity, ...] = ("simple", "medium", "hard")

WRITER_SYSTEM_PROMPT = (
    "You design evaluation tasks for AI agents that work by calling tools on MCP servers. A task is a "
    "realistic request from a user plus the exact tool calls that complete it. Answer only with JSON that "
    "matches the given schema."
)
AGENT_SYSTEM_PROMPT = (
    "You are an assistant that completes tasks by calling tools on MCP servers ({servers}). Call one tool at "
    "a time and build on what the tools return; never guess a value you can look up. When the task is done, "
    "reply with a short final answer that states what was asked for."
)


# --------------------------------------------------------------------------- the catalog


@dataclass(frozen=True)
class ToolInfo:
    """One tool as a task names it: `server` and `tool` as `pool.call_tool(server, tool, ...)` takes them."""

    server: str
    tool: str
    description: str
    input_schema: dict[str, Any]

    @property
    def qualified(self) -> str:
        return f"{self.server}.{self.tool}"


def tool_catalog(listing: ToolListing, servers: Sequence[str] | None = None) -> list[ToolInfo]:
    """The tools of `servers` (None = all), in listing order; external tools lose their `server.` prefix."""
    wanted = None if servers is None else set(servers)
    return [
        ToolInfo(
            server,
            local_name(server, t["name"]),
            (t.get("description") or "").strip(),
            t.get("inputSchema") or {"type": "object", "properties": {}},
        )
        for server, tools in listing.items()
        if wanted is None or server in wanted
        for t in tools
    ]


def _type_of(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    kind = prop.get("type")
    if isinstance(kind, list):
        kind = " or ".join(str(k) for k in kind)
    if kind is None:
        for key in ("anyOf", "oneOf"):
            if key in prop:  # optional values come as anyOf [X, null]
                return " or ".join(_type_of(p) for p in prop[key])
        return json.dumps(prop, sort_keys=True)
    if kind == "array":
        items = prop.get("items") or {}
        text = f"array of {_type_of(items)}" if items else "array"
        if "minItems" in prop or "maxItems" in prop:
            text += f" ({prop.get('minItems', 0)}-{prop.get('maxItems', '…')} items)"
        return text
    if kind == "object" and prop.get("properties"):
        return "object " + json.dumps(prop["properties"], sort_keys=True)
    bounds = [prop[k] for k in ("minimum", "maximum") if k in prop]
    if len(bounds) == 2:
        return f"{kind} {bounds[0]}..{bounds[1]}"
    if "pattern" in prop:
        return f"{kind} matching {prop['pattern']}"
    return str(kind)


def describe_tool(tool: ToolInfo) -> str:
    """The tool for a prompt: name and description, then one line per parameter."""
    first = tool.description.split("\n\n")[0].replace("\n", " ").strip()
    lines = [f"- {tool.qualified}: {first}" if first else f"- {tool.qualified}"]
    props = tool.input_schema.get("properties") or {}
    required = set(tool.input_schema.get("required") or ())
    if not props:
        lines.append("    (no parameters)")
    for name, prop in props.items():
        notes = [_type_of(prop)]
        if name in required:
            notes.append("required")
        elif "default" in prop:
            notes.append(f"default {json.dumps(prop['default'])}")
        desc = (prop.get("description") or "").replace("\n", " ").strip()
        lines.append(f"    {name} ({', '.join(notes)}){': ' + desc if desc else ''}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- one sample's request


@dataclass(frozen=True)
class SampleSpec:
    """What one request asks for."""

    index: int
    complexity: Complexity
    focus: ToolInfo  # the task's first call


def sample_id(seed: int, index: int) -> str:
    """A sample's identity in the response cache: another seed asks again, a rerun does not."""
    return f"{seed}/{index}"


def call_bounds(complexity: Complexity, max_turns: int) -> tuple[int, int]:
    """How many calls a task of this complexity may have under `max_turns` (lo > hi: impossible)."""
    lo, hi = COMPLEXITY_CALLS[complexity]
    return lo, min(hi, max_turns)


def task_schema(
    catalog: Sequence[ToolInfo], complexity: Complexity, max_turns: int, max_string_chars: int | None = None
) -> dict[str, Any]:
    """The JSON schema of one answer (strict mode: every property required, no extra properties)."""
    lo, hi = call_bounds(complexity, max_turns)

    def text(description: str) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "string", "description": description}
        if max_string_chars:
            out["maxLength"] = max_string_chars
        return out

    step = {
        "type": "object",
        "additionalProperties": False,
        "required": ["server", "tool", "params"],
        "properties": {
            "server": {"type": "string", "enum": sorted({t.server for t in catalog})},
            "tool": {"type": "string", "enum": sorted({t.tool for t in catalog})},
            "params": text('The call\'s arguments as a JSON-encoded object, e.g. "{\\"ticker\\": \\"AAPL\\"}".'),
        },
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["user_prompt", "complexity", "tool_sequence", "answer_path", "final_answer_hint"],
        "properties": {
            "user_prompt": text("The user's request, self-contained, without naming tools."),
            "complexity": {"type": "string", "enum": [complexity]},
            "tool_sequence": {"type": "array", "minItems": lo, "maxItems": hi, "items": step},
            "answer_path": text(
                "Dotted path of the answer's number in the last call's JSON result (e.g. results.0.c); "
                "empty when the answer is not one number there."
            ),
            "final_answer_hint": text("One sentence: what a correct final answer contains."),
        },
    }


def build_request(
    catalog: Sequence[ToolInfo], spec: SampleSpec, opts: GenerateOptions
) -> tuple[str, str, dict[str, Any]]:
    """(system, user, json_schema) of one sample's request."""
    lo, hi = call_bounds(spec.complexity, opts.max_turns)
    calls = f"exactly {lo} tool call" + ("" if lo == 1 else "s") if lo == hi else f"{lo} to {hi} tool calls"
    tools = "\n".join(describe_tool(t) for t in catalog)
    parts = [
        "Write one task for an AI agent that can call these tools (name: description, then its parameters):",
        tools,
        "",
        "Constraints:",
        f"- Complexity {spec.complexity}: tool_sequence has {calls}"
        + (", in the order the agent should make them." if hi > 1 else "."),
        f"- The first call is {spec.focus.qualified}.",
        f"- At most {opts.max_tools} distinct tools, only from the list above.",
        "- params: the call's arguments as a JSON object encoded in a string, with concrete values that are "
        "valid for the tool's parameters; no placeholders. A value that comes from an earlier call's result "
        "is written as the value that result will give.",
        "- user_prompt: what a user would ask: natural, specific and self-contained (it states every name, "
        "symbol, date or channel the calls need) and does not mention tools, servers or JSON.",
        "- answer_path: when the answer is one number in the last call's JSON result, its dotted path there "
        "(list positions as numbers, e.g. results.0.c); otherwise an empty string.",
        "- final_answer_hint: one sentence saying what a correct final answer contains.",
    ]
    context = str(opts.extra.get("context") or "").strip()
    if context:
        parts += ["", "About the data behind the tools:", context]
    max_chars = opts.extra.get("max_string_chars")
    schema = task_schema(catalog, spec.complexity, opts.max_turns, int(max_chars) if max_chars else None)
    return WRITER_SYSTEM_PROMPT, "\n".join(parts), schema


# --------------------------------------------------------------------------- answer → row


class Unusable(Exception):
    """An answer that cannot become a task; `reason` is what the report counts."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def decode_steps(
    answer: dict[str, Any], catalog: Sequence[ToolInfo], spec: SampleSpec, opts: GenerateOptions
) -> list[dict[str, Any]]:
    """The answer's tool_sequence as TaskRow steps; raises Unusable."""
    known = {(t.server, t.tool) for t in catalog}
    steps: list[dict[str, Any]] = []
    for i, item in enumerate(answer.get("tool_sequence") or [], start=1):
        server, tool, params = item.get("server"), item.get("tool"), item.get("params")
        if (server, tool) not in known:
            raise Unusable("unknown_tool", f"step {i}: {server}.{tool}")
        if isinstance(params, str):
            try:
                params = json.loads(params) if params.strip() else {}
            except json.JSONDecodeError as e:
                raise Unusable("params_not_json", f"step {i}: {e}") from None
        if not isinstance(params, dict):
            raise Unusable("params_not_object", f"step {i}: {type(params).__name__}")
        steps.append({"step": i, "server": server, "tool": tool, "params": params})
    complexity = answer.get("complexity", spec.complexity)
    if complexity not in COMPLEXITY_CALLS:
        raise Unusable("bad_complexity", str(complexity))
    lo, hi = call_bounds(complexity, opts.max_turns)
    if not lo <= len(steps) <= hi:
        raise Unusable("wrong_call_count", f"{len(steps)} calls for {complexity} (allowed {lo}-{hi})")
    if (steps[0]["server"], steps[0]["tool"]) != (spec.focus.server, spec.focus.tool):
        raise Unusable("first_call_not_focus", f"{steps[0]['server']}.{steps[0]['tool']} != {spec.focus.qualified}")
    if len({(s["server"], s["tool"]) for s in steps}) > opts.max_tools:
        raise Unusable("too_many_tools", f"more than {opts.max_tools} distinct tools")
    return steps


_INDEX = re.compile(r"\[(\d+)\]")


def lookup_path(data: Any, path: str) -> Any:
    """`results.0.c` (or `results[0].c`) in a JSON value; KeyError when it leads nowhere."""
    node = data
    for part in filter(None, _INDEX.sub(r".\1", path.strip()).split(".")):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(path)
    return node


def as_number(value: Any) -> float | int | None:
    """A JSON number, or a string that is exactly one (a program's stdout); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            value = float(value.strip().replace(",", ""))
        except ValueError:
            return None
    if isinstance(value, float):
        return value if math.isfinite(value) else None  # nan/inf are no answer (and not JSON)
    return None


async def compute_final_answer(pool: Any, steps: list[dict[str, Any]], answer_path: str, hint: str) -> dict | None:
    """Run the plan; the number at `answer_path` in the last result as a FinalAnswer dict, or None."""
    if not answer_path.strip():
        return None
    result = None
    for s in steps:
        result = await pool.call_tool(s["server"], s["tool"], s["params"])
        if not result.ok:
            return None
    data = result.structured
    if data is None:
        try:
            data = json.loads(result.text)
        except (json.JSONDecodeError, TypeError):
            data = result.text
    value = None
    for root in (data, data.get("result") if isinstance(data, dict) else None):  # FastMCP wraps scalars
        try:
            value = as_number(lookup_path(root, answer_path))
        except KeyError:
            continue
        if value is not None:
            break
    if value is None:
        return None
    last = steps[-1]
    return {
        "value": value,
        "tolerance": max(0.01, round(abs(value) * 1e-3, 6)),
        "description": hint.strip() or f"{answer_path} of {last['server']}.{last['tool']}",
    }


def build_row(
    method: str,
    model: str,
    spec: SampleSpec,
    answer: dict[str, Any],
    steps: list[dict[str, Any]],
    final_answer: dict | None,
    opts: GenerateOptions,
    servers: Sequence[str],
) -> dict[str, Any]:
    """The TaskRow dict (validated) for a decoded answer."""
    user_prompt = str(answer.get("user_prompt") or "").strip()
    if not user_prompt:
        raise Unusable("empty_prompt")
    content = json.dumps([user_prompt, steps], sort_keys=True)
    pattern = ">".join(dict.fromkeys(f"{s['server']}.{s['tool']}" for s in steps))
    hint = str(answer.get("final_answer_hint") or "").strip()
    extra: dict[str, Any] = {
        "method": method,
        "model": model,
        "sample": spec.index,
        "seed": opts.seed,
        "template": f"{method}:{pattern}",  # splits keep one tool pattern in one split
        "focus_tool": spec.focus.qualified,
    }
    if hint:
        extra["final_answer_hint"] = hint
    if answer.get("answer_path"):
        extra["answer_path"] = answer["answer_path"]
    ground_truth: dict[str, Any] = {
        "task_id": f"{method}-{hashlib.sha256(content.encode()).hexdigest()[:12]}",
        "complexity": answer.get("complexity", spec.complexity),
        "max_turns": opts.max_turns,
        "success": {"must_call_tool": f"{steps[0]['server']}.{steps[0]['tool']}"},
        "tool_sequence": steps,
        "limits": {"max_servers": len({s["server"] for s in steps}), "max_tools": opts.max_tools},
    }
    if final_answer is not None:
        ground_truth["final_answer"] = final_answer
    try:
        row = TaskRow.model_validate(
            {
                "data_source": f"mcprl/{method}",
                "prompt": [
                    {"role": "system", "content": AGENT_SYSTEM_PROMPT.format(servers=", ".join(servers))},
                    {"role": "user", "content": user_prompt},
                ],
                "reward_spec": {"method": "rule", "ground_truth": ground_truth},
                "extra_info": extra,
            }
        )
    except ValidationError as e:
        raise Unusable("invalid_row", str(e).splitlines()[0]) from None
    return row.model_dump(mode="json")


# --------------------------------------------------------------------------- the run


@dataclass
class GenerationReport:
    """What a run asked for and what came of it."""

    method: str
    requested: int = 0
    produced: int = 0
    with_final_answer: int = 0
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> samples
    usage: dict[str, int] = field(default_factory=dict)  # the client's token count

    def summary(self) -> str:
        skipped = ", ".join(f"{k} ×{v}" for k, v in sorted(self.skipped.items())) or "none"
        u = self.usage
        return (
            f"{self.method}: {self.produced}/{self.requested} samples made rows "
            f"({self.with_final_answer} with a computed final answer); skipped: {skipped}; "
            f"tokens: {u.get('total_tokens', 0)} (prompt {u.get('prompt_tokens', 0)}, "
            f"completion {u.get('completion_tokens', 0)}) in {u.get('requests', 0)} requests, "
            f"{u.get('cache_hits', 0)} from the cache, {u.get('retries', 0)} retries"
        )


def plan_samples(
    catalog: Sequence[ToolInfo], opts: GenerateOptions, method: str, focus: Literal["random", "round_robin"]
) -> list[SampleSpec]:
    """The `opts.n` samples' complexity and focus tool (deterministic for a seed)."""

    def fits(c: Complexity) -> bool:
        lo, hi = call_bounds(c, opts.max_turns)
        return lo <= hi

    kinds = [c for c in COMPLEXITY_ORDER if c in opts.complexities and fits(c)]
    if not kinds:
        raise GenerationError(
            f"no complexity in {list(opts.complexities)} fits max_turns={opts.max_turns} "
            f"(calls per complexity: {COMPLEXITY_CALLS})"
        )
    specs = []
    for i in range(opts.n):
        if focus == "round_robin":
            tool = catalog[i % len(catalog)]
        else:
            tool = random.Random(f"{opts.seed}|{method}|{i}").choice(list(catalog))
        specs.append(SampleSpec(i, kinds[i % len(kinds)], tool))
    return specs


async def _listing_with(cfg: Config, pool: Any, servers: Sequence[str]) -> tuple[Any, ToolListing, bool]:
    """(pool, its tool listing, whether we own the pool): the given pool, or one built from `cfg.tools`
    when there is none or it lacks a wanted server (an external one the caller left out)."""
    owned = False
    listing = await pool.list_tools() if pool is not None else {}
    if pool is None or not set(servers) <= set(listing):
        from serve_apps.tool_pool import LocalToolPool

        pool, owned = await LocalToolPool.create(cfg.tools), True
        listing = await pool.list_tools()
    missing = sorted(set(servers) - set(listing))
    if missing:
        if owned:
            await pool.close()
        raise GenerationError(
            f"no MCP server {missing} in the pool; servers: {', '.join(listing) or 'none'} "
            "(add your own under tools.external)"
        )
    return pool, listing, owned


async def propose_tasks(
    cfg: Config,
    opts: GenerateOptions,
    pool: Any,
    *,
    method: str,
    servers: Sequence[str] = (),
    focus: Literal["random", "round_robin"] = "random",
    client: StructuredClient | None = None,
) -> tuple[list[dict[str, Any]], GenerationReport]:
    """The shared machinery of `llm` and `mcp`: plan `opts.n` samples over `servers`' tools (() = all in
    the pool), ask the model once per sample, turn usable answers into rows, count the rest."""
    pool, listing, owned_pool = await _listing_with(cfg, pool, servers)
    own_client = client is None
    try:
        wanted = list(servers) or list(listing)
        catalog = tool_catalog(listing, wanted)
        if not catalog:
            raise GenerationError(f"the servers {wanted} list no tools")
        specs = plan_samples(catalog, opts, method, focus)
        if client is None:
            max_tokens = opts.extra.get("max_output_tokens")
            try:
                client = StructuredClient(
                    cfg.generation.openai, max_output_tokens=int(max_tokens) if max_tokens else None
                )
            except MissingAPIKey as e:  # say so and stop, no traceback
                raise GenerationError(str(e)) from e
        report = GenerationReport(method, requested=len(specs))
        done = 0
        opts.report(0, len(specs))

        async def one(spec: SampleSpec) -> dict[str, Any] | None:
            nonlocal done
            try:
                return await _one_sample(client, pool, catalog, spec, opts, method, wanted, report)
            finally:
                done += 1
                opts.report(done, len(specs))

        tasks = [asyncio.ensure_future(one(s)) for s in specs]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # a fatal error: stop the other samples before the client and pool close
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        rows = [r for r in results if r is not None]
        report.produced = len(rows)
        report.usage = client.usage()
        return rows, report
    finally:
        if own_client and client is not None:
            await client.aclose()
        if owned_pool:
            await pool.close()


async def _one_sample(
    client: StructuredClient,
    pool: Any,
    catalog: Sequence[ToolInfo],
    spec: SampleSpec,
    opts: GenerateOptions,
    method: str,
    servers: Sequence[str],
    report: GenerationReport,
) -> dict[str, Any] | None:
    system, user, schema = build_request(catalog, spec, opts)
    try:
        answer = await client.complete(system, user, SCHEMA_NAME, schema, sample=sample_id(opts.seed, spec.index))
        steps = decode_steps(answer, catalog, spec, opts)
        final = await compute_final_answer(
            pool, steps, str(answer.get("answer_path") or ""), str(answer.get("final_answer_hint") or "")
        )
        row = build_row(method, client.cfg.model, spec, answer, steps, final, opts, servers)
    except StructuredOutputError as e:
        report.skipped[f"output_{e.reason}"] += 1
        log.debug("%s sample %d: %s", method, spec.index, e)
        return None
    except RequestFailed as e:
        if e.fatal:  # every other request would fail the same way
            raise GenerationError(str(e)) from e
        report.skipped[f"request_{e.kind}"] += 1
        log.debug("%s sample %d: %s", method, spec.index, e)
        return None
    except Unusable as e:
        report.skipped[e.reason] += 1
        log.debug("%s sample %d: %s", method, spec.index, e)
        return None
    if final is not None:
        report.with_final_answer += 1
    return row


@dataclass(frozen=True)
class ModelGenerator:
    """A generator whose tasks the model writes (`llm`, `mcp`): its method name, the option naming the
    servers it asks about, and how each sample's focus tool is picked (see `plan_samples`)."""

    method: str
    servers: Callable[[GenerateOptions], Sequence[str]]
    focus: Literal["random", "round_robin"]

    async def generate_with_report(
        self, cfg: Config, opts: GenerateOptions, pool: Any
    ) -> tuple[list[dict[str, Any]], GenerationReport]:
        """`generate`, with the report of what was skipped and the tokens spent."""
        return await propose_tasks(cfg, opts, pool, method=self.method, servers=self.servers(opts), focus=self.focus)

    async def generate(self, cfg: Config, opts: GenerateOptions, pool: Any) -> list[dict[str, Any]]:
        """Up to `opts.n` candidate rows written by the model for the tools of the chosen servers
        (() = all in the pool); what was skipped is logged."""
        rows, report = await self.generate_with_report(cfg, opts, pool)
        log_report(report)
        return rows


# `llm`: the tools of `opts.domains`, each sample's focus tool drawn at random.
LLM = ModelGenerator("llm", lambda opts: opts.domains, "random")
generate_with_report = LLM.generate_with_report
generate = LLM.generate


def log_report(report: GenerationReport) -> None:
    (log.warning if report.skipped else log.info)("%s", report.summary())
