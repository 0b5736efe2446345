"""MCPToolEnv: a skyrl-gym text environment whose actions are MCP tool calls.

Built as SkyRL builds envs, `MCPToolEnv(env_config, extras)` (or `skyrl_gym.make("MCPToolEnv",
env_config=..., extras=row)` once `envs` is imported):

- `env_config`: our config — a dict `{"env": {...EnvConfig}, "reward": {...RewardConfig}}` (either key
  optional, values dicts or the pydantic objects), an OmegaConf DictConfig of that shape, the root
  `Config`, or None for defaults.
- `extras`: the task row (SkyRL format), or any dict with `reward_spec.ground_truth` and `prompt`.
- Tools and judge: given as `tool_client=` / `judge=` (mcprl's runners pass the Serve pool and the judge
  deployment), else built from `env_config` alone (`env.tools`, `reward.judge.source`; see
  envs/tool_client.py), so any trainer can build the env from configuration. `env_config["tools"]` (a
  tools section, as in an mcprl config) names the servers of the default in-process pool.
- Each env is one episode with its own id: its tool calls carry it, so stateful servers (the offline
  Slack, externals marked stateful) keep state per episode, dropped by `close()`.

One episode: `init(prompt)` returns the prompt and {task_id, max_turns, tools, tool_definitions}. The
tool definitions (the servers of the task's tool_sequence) are shown as `env.tool_prompt` says:
`system` puts our tool block in the system message, one line per tool in `env.tool_format` (what a
trainer that renders the messages without `tools=` needs, SkyRL's included); `template` leaves them
to the caller, who passes `tool_definitions` as the chat template's `tools=` (mcprl's runners pick
this for templates that render tools, see envs/prompting.py). Then `step(action)`/`astep(action)` per model turn:
parse → run each call (at most `max_calls_per_turn`) → one observation message per tool result or
parse error (role `observation_role`, each cut at `max_observation_chars` with a note) → reward.

The episode is done when
- the turn gave a final answer (`<answer>...</answer>`, or with final_answer=no_call a turn without
  a call), or
- `max_turns` turns were played (ground truth `max_turns`), or
- every step of tool_sequence was done (called in order, returning ok) and the task has no
  `final_answer` to check; a task with one stays open so the model can state it.

`step` never raises for anything the model writes or any fault of the tool client: bad output is a
penalised step with a readable observation; a client that raises is an infrastructure fault (0
reward, flagged). Rewards by `RewardConfig.backend`: heuristic (envs/rewards.py); llm_judge and
hybrid call envs/judge.py from `astep`; group_judge scores whole groups after the episodes, so each
step returns 0 and the env keeps what the judge needs (`conversation`, `ground_truth`, heuristic
components in the metadata).

`step` is the synchronous twin of `astep`: with no event loop running in this thread it runs `astep`
on a private event loop kept per thread (not `asyncio.run`, whose fresh loop per call would cost
time and break clients bound to a loop); called from inside a running loop it runs it on a helper
thread's private loop and waits.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

from configs.schema import Config, EnvConfig, RewardConfig
from envs.parsing import MAX_TURN_CHARS, ParseError, ToolCall, ToolIndex, parse_turn, sanitize
from envs.prompting import TOOL_CALL_FORMAT, prompt_messages
from envs.rewards import COMPONENTS, RewardState, clip_step, reward_heuristic, zero_components
from envs.tool_client import ToolClient, judge_from_config, resolve_tool_client
from tasks.inventory import ToolListing, inventory_from_listing, inventory_tools_for_prompt
from tasks.observation import cut, result_text
from tasks.schema import GroundTruth

if TYPE_CHECKING:
    from envs.judge import JudgeLike

log = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT_HINT = f"Call a tool like this: {TOOL_CALL_FORMAT}"


# --------------------------------------------------------------------------- config


def resolve_configs(env_config: Any) -> tuple[EnvConfig, RewardConfig]:
    """(EnvConfig, RewardConfig) from whatever SkyRL or a caller hands the env (see module docstring)."""
    if env_config is None:
        return EnvConfig(), RewardConfig()
    if isinstance(env_config, Config):
        return env_config.env, env_config.reward
    if isinstance(env_config, EnvConfig):
        return env_config, RewardConfig()
    if not isinstance(env_config, Mapping):
        try:  # OmegaConf DictConfig and friends
            from omegaconf import OmegaConf

            env_config = OmegaConf.to_container(env_config, resolve=True)
        except Exception as e:
            raise TypeError(
                f"env_config must be a mapping with keys env/reward, got {type(env_config).__name__}"
            ) from e
    env = env_config.get("env") or {}
    reward = env_config.get("reward") or {}
    env = env if isinstance(env, EnvConfig) else EnvConfig.model_validate(dict(env))
    reward = reward if isinstance(reward, RewardConfig) else RewardConfig.model_validate(dict(reward))
    return env, reward


# --------------------------------------------------------------------------- sync <-> async

_local = threading.local()
_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from synchronous code, on this thread's private loop.

    Inside a running loop (sync code called from async code) it runs on a helper thread's private
    loop instead, since a running loop cannot be re-entered.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = getattr(_local, "loop", None)
        if loop is None or loop.is_closed():
            loop = _local.loop = asyncio.new_event_loop()
        return loop.run_until_complete(coro)
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mcptoolenv-sync")
    return _helper.submit(run_sync, coro).result()


# --------------------------------------------------------------------------- tools of a client

# id(client) -> (client, listing, index), most recently used last. Bounded: a process that makes clients over
# and over (a test session, a long-lived SkyRL worker) keeps the newest few, not every client it ever made.
_listings: OrderedDict[int, tuple[Any, ToolListing, ToolIndex]] = OrderedDict()
_listings_lock = threading.Lock()  # envs step on several threads and loops
MAX_LISTINGS = 16


async def tools_of(client: ToolClient) -> tuple[ToolListing, ToolIndex]:
    """The client's tool listing and parser index, listed once per client and cached (the newest
    MAX_LISTINGS clients)."""
    with _listings_lock:
        hit = _listings.get(id(client))
        if hit is not None and hit[0] is client:
            _listings.move_to_end(id(client))
            return hit[1], hit[2]
    listing = await client.list_tools()
    index = ToolIndex(inventory_from_listing(listing))
    with _listings_lock:
        _listings[id(client)] = (client, listing, index)
        _listings.move_to_end(id(client))
        while len(_listings) > MAX_LISTINGS:
            _listings.popitem(last=False)
    return listing, index


@dataclass
class _ClientFault:
    """The result of a call whose client raised: an infrastructure fault, never the policy's."""

    error: str
    ok: bool = False
    text: str = ""
    structured: Any = None
    error_kind: str = "unavailable"
    latency_ms: float = 0.0
    infra_fault: bool = True


# --------------------------------------------------------------------------- the env


class MCPToolEnv(BaseTextEnv):
    """Multi-turn MCP tool use with a step-wise reward (see the module docstring)."""

    def __init__(
        self,
        env_config: Any = None,
        extras: Mapping[str, Any] | None = None,
        *,
        tool_client: ToolClient | None = None,
        judge: JudgeLike | None = None,
    ) -> None:
        super().__init__()
        self.env_cfg, self.reward_cfg = resolve_configs(env_config)
        extras = dict(extras or {})
        spec = extras.get("reward_spec") or {}
        gt = spec.get("ground_truth") if isinstance(spec, Mapping) else getattr(spec, "ground_truth", None)
        if gt is None:
            raise ValueError("MCPToolEnv needs extras['reward_spec']['ground_truth'] (a task row)")
        if isinstance(gt, Mapping) and "max_turns" not in gt:
            gt = {**gt, "max_turns": extras.get("max_turns", self.env_cfg.default_max_turns)}
        self.ground_truth = gt if isinstance(gt, GroundTruth) else GroundTruth.model_validate(dict(gt))
        self.task_id = self.ground_truth.task_id
        self.max_turns = self.ground_truth.max_turns
        self.row_prompt = [dict(m) if isinstance(m, Mapping) else m.model_dump() for m in extras.get("prompt") or []]
        self.client = tool_client or resolve_tool_client(self.env_cfg.tools, _tools_key(env_config))
        self._judge = judge  # built from reward.judge on first use when not given
        self.episode_id = f"{self.task_id}:{uuid.uuid4().hex[:12]}"
        self.index: ToolIndex | None = None
        self.conversation: ConversationType = []
        self.state = RewardState()
        self.done = False
        self._m = {"tool_calls": 0, "tool_ok": 0, "timeouts": 0, "parse_failures": 0, "infra_faults": 0}
        self._components = zero_components()
        self._reward_total = 0.0
        self._complete = False
        self._calls_right = False  # every expected call ran (reported beside success, never as it)

    # ------------------------------------------------------------------ init

    def init(self, prompt: ConversationType | None = None) -> tuple[ConversationType, dict[str, Any]]:
        """The prompt as the model is shown it, and {task_id, max_turns, tools, tool_definitions}.

        With `env.tool_prompt` "system" the tool block is in the system message and `tool_definitions`
        is empty; with "template" the system message says only how to answer, and the caller renders
        with the chat template's `tools=tool_definitions` (`envs.prompting.render`). `tools`: the names.
        """
        return run_sync(self.ainit(prompt))

    async def ainit(self, prompt: ConversationType | None = None) -> tuple[ConversationType, dict[str, Any]]:
        """`init` for async callers (no thread hop)."""
        tools: list[dict[str, Any]] = []
        try:
            listing, self.index = await tools_of(self.client)
            servers = {s.server for s in self.ground_truth.tool_sequence}
            tools = inventory_tools_for_prompt(listing, servers)
        except Exception as e:  # the episode can still run; names are then checked by the pool only
            log.warning("could not list tools (%s: %s); prompt without tool definitions", type(e).__name__, e)
        cfg = self.env_cfg
        source = prompt if prompt is not None else self.row_prompt
        messages = prompt_messages(source, tools, cfg.tool_prompt, cfg.final_answer, cfg.tool_format)
        self.conversation = [dict(m) for m in messages]
        info = {
            "task_id": self.task_id,
            "max_turns": self.max_turns,
            "tools": [t["name"] for t in tools],
            "tool_definitions": tools if cfg.tool_prompt == "template" else [],
        }
        return messages, info

    # ------------------------------------------------------------------ step

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Synchronous `astep` (see the module docstring for which loop runs it)."""
        return run_sync(self.astep(action))

    async def astep(self, action: str) -> BaseTextEnvStepOutput:
        """One model turn. Never raises (except cancellation)."""
        try:
            return await self._astep(action)
        except Exception as e:  # our own bug or a judge failure: not the policy's fault
            log.exception("MCPToolEnv step failed")
            self.done = self.done or self.turns >= self.max_turns
            self._m["infra_faults"] += 1
            meta = {
                "task_id": self.task_id,
                "turn": self.turns,
                "infra_fault": True,
                "error": f"{type(e).__name__}: {e}",
            }
            return _out([], 0.0, self.done, meta)

    async def _astep(self, action: Any) -> BaseTextEnvStepOutput:
        if self.done:
            return _out([], 0.0, True, {"task_id": self.task_id, "turn": self.turns, "note": "episode already done"})
        self.turns += 1
        if isinstance(action, bytes | bytearray):
            action = bytes(action).decode("utf-8", "replace")
        text = action if isinstance(action, str) else ("" if action is None else str(action))
        if self.index is None:  # step before init: the names still get checked
            try:
                self.index = (await tools_of(self.client))[1]
            except Exception as e:
                log.debug("no tool index (%s); names go to the pool unchecked", e)
        self.conversation.append({"role": "assistant", "content": sanitize(text[:MAX_TURN_CHARS])})
        history = list(self.conversation)  # what a judge sees: everything up to this action
        cfg = self.env_cfg
        parsed = parse_turn(
            text,
            self.index,
            aliases=cfg.argument_aliases,
            final_answer=cfg.final_answer,
            max_calls=cfg.max_calls_per_turn,
        )
        weights = self.reward_cfg.heuristic
        components = zero_components()
        observations: ConversationType = []
        calls_meta: list[dict[str, Any]] = []
        infra = False

        def add(scored: dict[str, Any]) -> None:
            for k, v in scored["components"].items():
                components[k] += v

        for call in parsed.calls:
            call.arguments = _clean(call.arguments)  # JSON escapes can still make lone surrogates
            result = await self._call(call)
            scored = reward_heuristic(call, call.name, result, self.ground_truth, self.state, weights)
            add(scored)
            infra = infra or scored["infra_fault"]
            calls_meta.append(self._count_call(call, result, scored))
            observations.append(self._message(result_text(call.name, result)))
        for err in parsed.errors:
            self._m["parse_failures"] += 1
            add(reward_heuristic(err, None, None, self.ground_truth, self.state, weights))
            observations.append(self._message(_error_text(err)))
        if parsed.answer is not None:
            add(reward_heuristic(parsed.answer, None, None, self.ground_truth, self.state, weights))

        heuristic = clip_step(math.fsum(components.values()))
        seq_done = self.state.sequence_done(self.ground_truth)
        # Success is a right answer; a task without final_answer is done when its calls are.
        no_answer_needed = self.ground_truth.final_answer is None
        self._complete = self._complete or components["outcome"] > 0 or (no_answer_needed and seq_done)
        self._calls_right = self._calls_right or seq_done
        done_reason = None
        if parsed.answer is not None:
            done_reason = "answer"
        elif seq_done and self.ground_truth.final_answer is None:
            done_reason = "sequence_complete"
        elif self.turns >= self.max_turns:
            done_reason = "max_turns"
        self.done = done_reason is not None
        if self.done:
            observations = []  # nothing more for the model to read
        self.conversation.extend(observations)

        meta: dict[str, Any] = {
            "task_id": self.task_id,
            "turn": self.turns,
            "calls": calls_meta,
            "parse_errors": [{"kind": e.kind, "message": e.message} for e in parsed.errors],
            "answer": parsed.answer,
            "infra_fault": infra,
            "reward_backend": self.reward_cfg.backend,
            "reward_components": components,
            "heuristic_reward": heuristic,
            "task_complete": self._complete,
            "sequence_done": seq_done,  # every tool_sequence step done, as of this turn
            "done_reason": done_reason,
        }
        reward = await self._reward(heuristic, meta, history)
        for k, v in components.items():
            self._components[k] += v
        self._reward_total += reward
        return _out(observations, reward, self.done, meta)

    async def _call(self, call: ToolCall) -> Any:
        try:
            return await self.client.call_tool(call.server, call.tool, call.arguments, episode_id=self.episode_id)
        except Exception as e:  # the client, not the model, failed
            return _ClientFault(error=f"tool client raised {type(e).__name__}: {e}")

    async def _reward(self, heuristic: float, meta: dict[str, Any], history: ConversationType) -> float:
        """The step's reward by backend; `history`: the conversation up to and with this turn's action."""
        backend = self.reward_cfg.backend
        if backend == "heuristic":
            return heuristic
        if backend == "group_judge":
            meta["group_judge_pending"] = True  # scored per group after the episodes
            return 0.0
        from envs import judge  # lazy: only judge-backed runs need it (and its client)

        judged = await judge.reward_llm_judge(
            history,
            history[-1]["content"],
            self.ground_truth.model_dump(),
            self.reward_cfg.judge.rubric,
            judge=self.judge,
        )
        if backend == "hybrid":
            mine = {"total_reward": heuristic, "components": meta["reward_components"], "infra_fault": False}
            mine["task_complete"] = self._complete
            judged = judge.hybrid(mine, judged, self.reward_cfg.hybrid_judge_weight)
        meta["judge"] = judged
        if judged.get("infra_fault"):  # the judge failed, not the policy: 0 and flagged
            meta["infra_fault"] = True
            self._m["infra_faults"] += 1
        return float(judged.get("total_reward", 0.0))

    def _count_call(self, call: ToolCall, result: Any, scored: dict[str, Any]) -> dict[str, Any]:
        ok = bool(getattr(result, "ok", False))
        kind = getattr(result, "error_kind", None)
        infra = bool(scored["infra_fault"])
        self._m["tool_calls"] += 1
        self._m["tool_ok"] += ok
        self._m["timeouts"] += kind == "timeout"
        self._m["infra_faults"] += infra
        return {
            "name": call.name,
            "arguments": call.arguments,
            "aliased": call.aliased,
            "ok": ok,
            "error_kind": kind,
            "infra_fault": infra,
            "latency_ms": float(getattr(result, "latency_ms", 0.0) or 0.0),
        }

    def _message(self, content: str) -> dict[str, str]:
        content = cut(sanitize(content), self.env_cfg.max_observation_chars)
        return {"role": self.env_cfg.observation_role, "content": content}

    @property
    def judge(self) -> JudgeLike:
        if self._judge is None:
            self._judge = judge_from_config(self.reward_cfg)
        return self._judge

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Drop this episode's tool state (see `aclose`)."""
        run_sync(self.aclose())

    async def aclose(self) -> None:
        """Drop this episode's state on the stateful servers; never raises (the episode is over)."""
        if not self._m["tool_calls"]:
            return
        try:
            await self.client.end_episode(self.episode_id)
        except Exception as e:  # state left behind is bounded by the server; the episode's result stands
            log.warning("could not end episode %s on the tool pool: %s: %s", self.episode_id, type(e).__name__, e)

    # ------------------------------------------------------------------ metrics

    def get_metrics(self) -> dict[str, Any]:
        m = self._m
        calls = m["tool_calls"]
        return {
            "turns": self.turns,
            **m,
            "tool_success_rate": m["tool_ok"] / calls if calls else 0.0,
            "timeout_rate": m["timeouts"] / calls if calls else 0.0,
            "task_complete": float(self._complete),
            "calls_right": float(self._calls_right),
            "reward_total": self._reward_total,
            **{f"reward/{k}": v for k, v in self._components.items()},
        }

    @staticmethod
    def aggregate_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
        """Means over episodes; the rates pooled over all calls (not a mean of per-episode rates)."""
        if not metrics:
            return {}
        keys = ["turns", "tool_calls", "tool_ok", "timeouts", "parse_failures", "infra_faults", "task_complete"]
        keys += ["calls_right"]
        keys += ["reward_total", *(f"reward/{k}" for k in COMPONENTS)]
        n = len(metrics)
        out: dict[str, Any] = {"episodes": n}
        for k in keys:
            out[k] = sum(float(m.get(k, 0.0)) for m in metrics) / n
        calls = sum(m.get("tool_calls", 0) for m in metrics)
        out["tool_success_rate"] = sum(m.get("tool_ok", 0) for m in metrics) / calls if calls else 0.0
        out["timeout_rate"] = sum(m.get("timeouts", 0) for m in metrics) / calls if calls else 0.0
        return out


# --------------------------------------------------------------------------- helpers


def _tools_key(env_config: Any) -> Any:
    """The `tools` section env_config carries, if any (the root Config's, or a mapping's `tools` key)."""
    if isinstance(env_config, Config):
        return env_config.tools
    return env_config.get("tools") if isinstance(env_config, Mapping) else None


def _out(observations: ConversationType, reward: float, done: bool, metadata: dict[str, Any]) -> BaseTextEnvStepOutput:
    return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata=metadata)


def _error_text(err: ParseError) -> str:
    if err.kind in ("malformed", "no_action", "empty"):
        return f"Your tool call could not be run: {err.message}. {FORMAT_HINT}"
    return f"Your tool call could not be run: {err.message}."


def _clean(value: Any) -> Any:
    """Arguments with lone surrogates replaced (they cannot cross JSON/HTTP to a tool)."""
    if isinstance(value, str):
        return sanitize(value)
    if isinstance(value, dict):
        return {sanitize(str(k)): _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


__all__ = ["MCPToolEnv", "resolve_configs", "run_sync", "tools_of"]
