"""The typed config tree. Every field is documented where it is declared.

One tree for the whole system; later steps add sections (rollout, algorithm, reward, ...).
Every model forbids unknown keys, so a typo fails at load time with the key's path.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger(__name__)


class Strict(BaseModel):
    """Base for every config section: unknown keys are errors, values are re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------- placement


class Resources(Strict):
    """What ONE actor or Serve replica of a role reserves on a node; every role (engines, runners, learner
    workers, tool deployments, the judge) takes one of these. Ray places the actor only on a node that has all of it;
    an autoscaling cluster adds a node of a type that does (see `python -m jobs.train` without --run)."""

    num_cpus: float = Field(1.0, gt=0, description="Logical CPUs (fractions allowed: 0.1 fits many on 2 cores).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs (fractions share one GPU).")
    accelerator_type: str | None = Field(
        None, description="The node's accelerator, as Ray names it (e.g. A100, H100, L4; ray.util.accelerators)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom resources, e.g. {gpu_node: 1}: only nodes (or node types) started with them qualify.",
    )

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory") or name.startswith("accelerator_type:"):
                raise ValueError(f"{name!r} is not a custom resource: use num_cpus / num_gpus / accelerator_type")
            if amount <= 0:
                raise ValueError(f"custom resource {name!r}: amount must be > 0, got {amount}")
        return value

    def actor_options(self) -> dict[str, Any]:
        """Ray actor options (also Serve's `ray_actor_options`)."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        if self.resources:
            options["resources"] = dict(self.resources)
        return options

    def bundle(self) -> dict[str, float]:
        """The same demand as one resource shape: a placement group bundle, or a `request_resources` bundle.
        An accelerator type is the node resource `accelerator_type:<T>`, asked as 0.001 (as Ray does)."""
        shape = {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {})}
        if self.accelerator_type:
            shape[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return {**shape, **self.resources}

    def describe(self) -> str:
        """E.g. `4 CPU, 1 GPU (A100), gpu_node: 1`."""
        parts = [f"{self.num_cpus:g} CPU"]
        if self.num_gpus or self.accelerator_type:
            parts.append(f"{self.num_gpus:g} GPU" + (f" ({self.accelerator_type})" if self.accelerator_type else ""))
        parts += [f"{k}: {v:g}" for k, v in sorted(self.resources.items())]
        return ", ".join(parts)


def _read_flat_resources(data: Any, field: str, flat: dict[str, str]) -> Any:
    """Read the older flat spelling (e.g. `num_cpus_per_engine: 2`) into the role's Resources `field`
    (`engine_resources.num_cpus`), so existing configs and --set overrides keep working."""
    if not isinstance(data, dict) or not any(k in data for k in flat):
        return data
    data = dict(data)
    nested = data.get(field)
    nested = dict(nested) if isinstance(nested, dict) else ({} if nested is None else nested)
    if not isinstance(nested, dict):
        return data  # not a mapping: let validation name it
    for old, new in flat.items():
        if old in data:
            if new in nested:
                raise ValueError(f"{field}.{new} is also given by its older spelling {old}: keep one (e.g. in --set)")
            nested[new] = data.pop(old)
    data[field] = nested
    return data


# --------------------------------------------------------------------------- tools


class Autoscaling(Strict):
    """Ray Serve autoscaling for one deployment (used instead of a fixed replica count). Serve adds replicas
    when requests per replica stay above the target and removes them when below; on an autoscaling cluster,
    replicas that fit no node make the cluster autoscaler add one."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0, description="Queue depth per replica Serve aims for.")
    upscale_delay_s: float = Field(30.0, ge=0, description="Load must stay high this long before Serve adds a replica.")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="Load must stay low this long before Serve removes a replica."
    )
    look_back_period_s: float = Field(30.0, gt=0, description="Window over which Serve averages the load.")
    metrics_interval_s: float = Field(10.0, gt=0, description="How often replicas and handles report their load.")

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} < min_replicas {self.min_replicas}")
        return self


class Deployment(Strict):
    """How one MCP server runs in the pool: Serve resources, timeouts, retries, rate limit."""

    enabled: bool = True
    replicas: int = Field(1, ge=1, description="Fixed replica count (ignored when autoscaling is set).")
    autoscaling: Autoscaling | None = None
    replica_resources: Resources = Field(
        default_factory=lambda: Resources(num_cpus=0.1),
        description="What each replica reserves (older spelling: `num_cpus`); fractions fit 2 cores.",
    )
    timeout_s: float = Field(10.0, gt=0, description="Default per-call timeout, enforced in the replica.")
    tool_timeouts: dict[str, float] = Field(default_factory=dict, description="Per-tool timeout overrides.")
    open_timeout_s: float = Field(
        30.0, gt=0, description="Connecting to the server: starting a stdio program and the MCP handshake."
    )
    list_timeout_s: float = Field(10.0, gt=0, description="Listing the server's tools.")
    close_timeout_s: float = Field(10.0, gt=0, description="Closing its sessions, or ending one episode's state.")
    max_live_episodes: int = Field(
        256, ge=1, description="Stateful servers: episodes whose state is kept at once; the oldest is dropped beyond."
    )
    max_retries: int = Field(2, ge=0, description="Retries for retryable faults (upstream 5xx/429, network).")
    retry_backoff_s: float = Field(
        0.2, ge=0, description="Wait before the first retry; doubles on each (cap 30 s, jittered: cluster/retry.py)."
    )
    rate_limit_per_s: float | None = Field(
        None,
        gt=0,
        description="Calls per second for the whole service, split evenly across the replicas running now "
        "(each replica re-reads the count every few seconds, so it follows autoscaling).",
    )
    health_check_period_s: float = Field(10.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _flat_resources(cls, data: Any) -> Any:
        return _read_flat_resources(data, "replica_resources", {"num_cpus": "num_cpus"})


class LiveService(Deployment):
    """A server that mirrors a paid outside API: `offline` simulates it, `live` calls it."""

    backend: Literal["offline", "live"] = "offline"
    base_url: str = Field("", description="API root for the live backend; empty means the service's own.")
    http_timeout_s: float = Field(8.0, gt=0, description="Timeout of one HTTP request to the live API.")


def _one_replica(cfg: Deployment, where: str) -> None:
    """Per-episode state lives in one replica's memory; Serve's routing by key (model multiplexing) is only
    best effort, so an episode's calls could reach a replica without its state: refuse more than one."""
    many = cfg.autoscaling.max_replicas > 1 if cfg.autoscaling else cfg.replicas > 1
    if many:
        raise ValueError(
            f"{where} keeps each episode's state in its replica's memory, so it runs one replica "
            "(replicas: 1 and no autoscaling beyond max_replicas: 1)"
        )


class SlackConfig(LiveService):
    db_path: str = Field(
        "", description="SQLite file of the offline workspace; empty = a fresh in-memory workspace per replica."
    )

    @model_validator(mode="after")
    def _stateful_one_replica(self) -> SlackConfig:
        if self.backend == "offline":
            _one_replica(self, "the offline slack workspace")
        return self


class SandboxConfig(Strict):
    """Limits for the python tool's sandbox (bubblewrap)."""

    cpu_time_s: int = Field(5, ge=1, description="RLIMIT_CPU of the program.")
    wall_time_s: float = Field(10.0, gt=0, description="Killed after this many seconds of wall time.")
    memory_mb: int = Field(256, ge=16, description="RLIMIT_AS of the program.")
    max_processes: int = Field(32, ge=1, description="RLIMIT_NPROC inside the sandbox.")
    max_output_bytes: int = Field(16_384, ge=256, description="stdout/stderr are each cut to this size.")
    tmp_size_mb: int = Field(64, ge=1, description="Size of the private tmpfs at /tmp.")
    max_concurrent: int = Field(
        1, ge=1, description="Programs one replica runs at once (CPU-bound: match its num_cpus; scale by replicas)."
    )
    queue_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest a program waits for a free slot; past it the call fails as `unavailable`, an "
        "infrastructure fault that never costs the model reward (add replicas for the load).",
    )
    allow_unsandboxed: bool = Field(
        False, description="Run code without bubblewrap when it is missing. Unsafe: for trusted code only."
    )


class PythonToolConfig(Deployment):
    timeout_s: float = Field(
        90.0,
        gt=0,
        description="Per-call timeout, enforced in the replica: above sandbox.queue_timeout_s + sandbox.wall_time_s, "
        "so that the sandbox, not this clock, stops a slow program, and a call that waited for a slot is not "
        "blamed on the model.",
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)

    @model_validator(mode="after")
    def _timeout_covers_the_sandbox(self) -> PythonToolConfig:
        # A "timeout" counts against the model, so the pool's clock must never stop a call the sandbox still
        # lets run, or one that is only waiting for a free slot (a busy machine is not the model's fault).
        need = self.sandbox.queue_timeout_s + self.sandbox.wall_time_s
        timeouts = {"timeout_s": self.timeout_s, "tool_timeouts.run_python": self.tool_timeouts.get("run_python")}
        for key, value in timeouts.items():
            if value is not None and value <= need:
                raise ValueError(
                    f"{key} ({value:g} s) must exceed sandbox.queue_timeout_s + sandbox.wall_time_s ({need:g} s): "
                    "the sandbox stops a slow program, and a call waiting for a free slot is the machine's fault"
                )
        return self


class BuiltinServers(Strict):
    """The built-in MCP servers; set `enabled: false` to leave one out of the pool."""

    polygon: LiveService = Field(default_factory=LiveService)
    fmp: LiveService = Field(default_factory=LiveService)
    tavily: LiveService = Field(default_factory=LiveService)
    slack: SlackConfig = Field(default_factory=SlackConfig)
    python: PythonToolConfig = Field(default_factory=PythonToolConfig)


class ExternalServer(Deployment):
    """Any MCP server, reached by a stdio command or a URL; its tools appear as `<name>.<tool>`."""

    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]*$")
    command: list[str] | None = Field(None, description="stdio: the program and its arguments.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the stdio program.")
    url: str | None = Field(None, description="Streamable-HTTP URL of the server.")
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP headers (values may be ${ENV}).")
    stateful: bool = Field(
        False,
        description="The server keeps state per session: each episode gets its own session (for stdio, its own "
        "process), closed when the episode ends. Runs one replica.",
    )

    @model_validator(mode="after")
    def _one_transport(self) -> ExternalServer:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of `command` (stdio) or `url` (HTTP)")
        if self.stateful:
            _one_replica(self, f"stateful external server {self.name!r}")
        return self


class HttpConfig(Strict):
    """The HTTP side of the pool (Serve's proxy)."""

    host: str = Field("127.0.0.1", description="Bind address; anything beyond loopback needs a bearer token.")
    port: int = Field(
        8000,
        ge=1,
        le=65535,
        description="Serve's proxy port. Left unset and taken (another run on this machine), a run that starts "
        "its own Ray serves on a free port and prints it; set, a taken port is an error. Fixed when Serve starts.",
    )
    bearer_token_env: str | None = Field(
        None, description="Environment variable holding the token that HTTP clients must send."
    )

    def port_is_explicit(self) -> bool:
        """The port was written (in the config or by --set), not left at the default: whoever chose it expects
        it, so a taken one is an error rather than a move (cluster.ray_env.listen_port)."""
        return "port" in self.model_fields_set


class ToolsConfig(Strict):
    servers: BuiltinServers = Field(default_factory=BuiltinServers)
    external: list[ExternalServer] = Field(default_factory=list)
    http: HttpConfig = Field(default_factory=HttpConfig)

    def offline(self) -> ToolsConfig:
        """A copy for play that must not reach out nor leave traces (task generation, the warm start's
        expert play): every built-in server that mirrors a paid API on its offline backend, Slack's
        workspace fresh in memory (never a shared db file)."""
        tools = self.model_copy(deep=True)
        for name in type(tools.servers).model_fields:
            server = getattr(tools.servers, name)
            if isinstance(server, LiveService) and server.backend != "offline":
                log.info("offline play uses %s's offline backend (the config says %s)", name, server.backend)
                server.backend = "offline"
            if isinstance(server, SlackConfig):
                server.db_path = ""
        return tools

    @model_validator(mode="after")
    def _unique_names(self) -> ToolsConfig:
        # A disabled built-in leaves its name free: e.g. `polygon` as a URL server reaching a pool elsewhere.
        names = [n for n in BuiltinServers.model_fields if getattr(self.servers, n).enabled]
        names += [e.name for e in self.external]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"server names must be unique among enabled servers; repeated: {sorted(dup)}")
        return self


# --------------------------------------------------------------------------- task generation

Complexity = Literal["simple", "medium", "hard"]


class OpenAIConfig(Strict):
    """An OpenAI-compatible endpoint (OpenAI itself, or any server that speaks its API)."""

    model: str = Field("gpt-4o-mini", description="Env OPENAI_MODEL overrides.")
    base_url: str | None = Field(None, description="Env OPENAI_BASE_URL overrides; None = OpenAI's own.")
    backend: Literal["chat", "responses"] = Field(
        "chat", description="Chat Completions or Responses API (env OPENAI_BACKEND)."
    )
    api_key_env: str = Field("OPENAI_API_KEY", description="Variable holding the key (a local server may need none).")
    timeout_s: float = Field(60.0, gt=0)
    max_retries: int = Field(4, ge=0, description="Retries with exponential backoff on 429/5xx/network errors.")
    concurrency: int = Field(4, ge=1, description="Requests in flight at once.")
    temperature: float = Field(0.7, ge=0, le=2)
    cache_dir: str = Field("", description="Response cache (reruns cost nothing); empty = <MCPRL_CACHE>/openai.")


class GenerationConfig(Strict):
    """`python -m jobs.generate_tasks`; each knob also has a CLI option and an environment variable."""

    n_samples: int = Field(50, ge=1, description="Tasks to generate (env N_SAMPLES).")
    seed: int = 0
    domains: list[str] = Field(default_factory=list, description="Servers to draw tools from (env DOMAINS); [] = all.")
    complexities: list[Complexity] = Field(
        default_factory=lambda: ["simple", "medium", "hard"], description="Env COMPLEXITIES, comma-separated."
    )
    max_tools: int = Field(4, ge=1, description="Most distinct tools in one task (env MAX_TOOLS).")
    max_turns: int = Field(8, ge=1, le=50, description="Turn budget written into each task (env MAX_TURNS).")
    splits: dict[str, float] = Field(
        default_factory=dict,
        description="e.g. {train: 0.8, validation: 0.1, test: 0.1}; no template shared across splits.",
    )
    instance_splits: list[str] = Field(
        default_factory=list,
        description="Splits made of held-out instances (tickers, phrasings) of the train split's templates, e.g. "
        "[validation]; the other splits are by whole template (rule generator only).",
    )
    split_rows: dict[str, int] = Field(
        default_factory=dict,
        description="Rows per split, e.g. {train: 460, validation: 100, transfer: 60}, in place of n_samples "
        "shared by the fractions (which still decide the templates of each by-template split); the keys are "
        "the splits' (rule generator only). {} = n_samples by the fractions.",
    )
    near_duplicate_threshold: float = Field(
        0.9, gt=0, le=1, description="Prompt similarity at which a task is a near-duplicate."
    )
    openai: OpenAIConfig = Field(default_factory=OpenAIConfig)

    @model_validator(mode="after")
    def _split_rows_name_the_splits(self) -> GenerationConfig:
        if self.split_rows:
            if set(self.split_rows) != set(self.splits):
                raise ValueError(
                    f"split_rows must give a row count for each split and only those: splits "
                    f"{sorted(self.splits) or 'none'}, split_rows {sorted(self.split_rows)}"
                )
            low = {k: v for k, v in self.split_rows.items() if v < 1}
            if low:
                raise ValueError(f"split_rows: every split needs at least one row; got {low}")
        return self


# --------------------------------------------------------------------------- environment and rewards


class ToolSource(Strict):
    """Where MCPToolEnv finds its tools when nobody hands it a client (SkyRL's generator, a user's script).

    The same block in YAML (`env.tools`) and in the `env_config` given to `skyrl_gym.make`.
    """

    source: Literal["local", "serve", "http"] = Field(
        "local",
        description="local: an in-process pool of the configured servers, built on first use; serve: the Serve "
        "pool's applications inside a Ray cluster; http: MCP servers over streamable HTTP (ours or anyone's).",
    )
    config: str | dict = Field(
        "",
        description="local: the servers, as a YAML file holding a `tools:` section (an mcprl config) or the section "
        "itself, or that section as a dict; empty = env_config's own `tools` key, else the built-in defaults.",
    )
    servers: list[str] = Field(
        default_factory=list,
        description="serve: the servers to use ([] = every application of the pool); http: the servers under `url`.",
    )
    ray_address: str = Field("", description="serve: the cluster to join when Ray is not up; empty = $RAY_ADDRESS.")
    url: str = Field("", description="http: the pool's root, each server at <url>/mcp/<server>/.")
    endpoints: dict[str, str] = Field(
        default_factory=dict, description="http: server name -> full MCP URL, for servers anywhere (with `url`, added)."
    )
    bearer_token_env: str = Field(
        "", description="http: the variable holding the bearer token sent to every endpoint; empty = no token."
    )

    @model_validator(mode="after")
    def _http_needs_endpoints(self) -> ToolSource:
        if self.source == "http" and not (self.endpoints or (self.url and self.servers)):
            raise ValueError("source http needs `endpoints`, or `url` with `servers`")
        return self


class EnvConfig(Strict):
    """MCPToolEnv: how model text becomes tool calls and tool results become observations."""

    tools: ToolSource = Field(default_factory=ToolSource, description="Where the tools are (see ToolSource).")

    observation_role: Literal["tool", "user"] = Field(
        "tool", description="Role of the messages that carry tool results."
    )
    max_observation_chars: int = Field(4000, ge=100, description="Longer tool output is cut, with a note saying so.")
    final_answer: Literal["tag", "no_call"] = Field(
        "tag", description="tag: a final answer is <answer>...</answer>; no_call: any turn without a tool call."
    )
    max_calls_per_turn: int = Field(4, ge=1, description="Calls beyond this in one turn are refused (penalised).")
    argument_aliases: dict[str, str] = Field(
        default_factory=lambda: {
            "symbol": "ticker",
            "query_text": "query",
            "channel_name": "channel",
            "source": "code",
        },
        description="Argument names the model may use for a tool's real parameter, applied only when the tool "
        "has the target and lacks the alias (e.g. symbol→ticker for polygon, ticker→symbol is not implied).",
    )
    default_max_turns: int = Field(8, ge=1, le=50, description="Used when a task's ground truth names none.")
    tool_prompt: Literal["system", "template"] = Field(
        "system",
        description="Where the prompt shows the tools. system: a tool block in the system message (for callers "
        "that apply the chat template without tools=, e.g. SkyRL's generator); template: init leaves them out and "
        "returns them in info['tool_definitions'] for the chat template's tools=. mcprl's runners and expert play "
        "choose per model: template when its chat template renders tools (Qwen, Llama 3, Hermes), else system.",
    )
    tool_format: Literal["compact", "json"] = Field(
        "compact",
        description="How the system tool block (tool_prompt system) lists the tools. compact: one line per tool, "
        "a signature and the description's first sentence, e.g. `fmp.income_statement(symbol: string, period?: "
        '"annual"|"quarter" = "annual") — Income statements, newest first: ...` (? = optional), under half of '
        "json's tokens; json: one JSON object per tool (name, description, parameters schema without "
        "validation-only keywords). The server checks every call against the full schema either way. "
        "tool_prompt template is not affected: the chat template formats the tools.",
    )


class HeuristicWeights(Strict):
    """Step-wise shaped reward; see envs/rewards.py for the ranges these defaults give."""

    allowed_tool: float = 0.2
    must_call_first: float = 0.4
    expected_next: float = 0.2
    params_match: float = 0.1
    tool_ok: float = 0.1
    malformed: float = -0.2
    unknown_tool: float = -0.2
    timeout: float = -0.2
    guess: float = Field(-0.5, description="An answer before any call was tried, on a task that needs tools.")
    outcome: float = 1.0


class JudgeConfig(Strict):
    """The LLM judge (OpenAI-compatible endpoint, structured outputs)."""

    openai: OpenAIConfig = Field(
        default_factory=lambda: OpenAIConfig(temperature=0.0), description="The judge's endpoint; greedy by default."
    )
    rubric: dict[str, float] = Field(
        default_factory=lambda: {"tool_choice": 0.35, "arguments": 0.25, "progress": 0.3, "safety": 0.1},
        description="Weights of the judge's scores in its reward.",
    )
    max_input_tokens: int = Field(3000, ge=256, description="Token cap of what is sent (approximate, 4 chars/token).")
    max_tool_result_chars: int = Field(800, ge=50, description="Tool results are cut to this before judging.")
    secret_env_vars: list[str] = Field(default_factory=list, description="Extra variables whose values are redacted.")
    source: Literal["auto", "local", "serve"] = Field(
        "auto",
        description="local: an in-process judge calling `openai` (any OpenAI-compatible endpoint); serve: the Ray "
        "Serve deployment `app_name` (the driver deploys it); auto: serve when Ray is up in this process, else local.",
    )
    app_name: str = Field("judge", description="The judge's Serve application.")
    max_batch_size: int = Field(8, ge=1)
    batch_wait_s: float = Field(0.02, ge=0)
    rate_limit_per_s: float | None = Field(None, gt=0)
    replica_resources: Resources = Field(
        default_factory=lambda: Resources(num_cpus=0.1),
        description="What the judge's replica reserves (older spelling: `num_cpus`).",
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_resources(cls, data: Any) -> Any:
        return _read_flat_resources(data, "replica_resources", {"num_cpus": "num_cpus"})


class RewardConfig(Strict):
    backend: Literal["heuristic", "llm_judge", "group_judge", "hybrid"] = "heuristic"
    heuristic: HeuristicWeights = Field(default_factory=HeuristicWeights)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    hybrid_judge_weight: float = Field(0.5, ge=0, le=1, description="hybrid = (1-w)·heuristic + w·judge.")


# --------------------------------------------------------------------------- rollout


class SamplingConfig(Strict):
    temperature: float = Field(1.0, ge=0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(256, ge=1, description="Per generation (one assistant turn).")
    stop: list[str] = Field(default_factory=lambda: ["</tool_call>", "</answer>"], description="Kept in the output.")
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = Field(None, description="Per-request seed; None = engine default randomness.")


class LoraConfig(Strict):
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class FinetuneConfig(Strict):
    mode: Literal["lora", "qlora", "full"] = Field(
        "lora",
        description="lora: a LoRA adapter over the frozen base in learner.dtype. qlora: the same adapter over the "
        "base loaded in 4 bit (bitsandbytes NF4, computing in learner.dtype; extra `qlora`; one learner rank; see "
        "actors/qlora.py). full: every weight trains.",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)
    init_adapter: str = Field(
        "",
        description="LoRA: a PEFT adapter folder to start from (e.g. the warm start's). The engines serve it as "
        "policy v1 before the first rollout, and the run evaluates it first (stage 'initial adapter', not 'base').",
    )

    @property
    def trains_adapter(self) -> bool:
        """lora and qlora: a LoRA adapter trains over a frozen base (and is what rollouts load)."""
        return self.mode in ("lora", "qlora")


class RolloutConfig(Strict):
    """Rollout engines (vLLM or HF transformers) and the episode runners that drive them."""

    backend: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="auto: vLLM for LoRA runs when importable, HF otherwise (and HF for full fine-tune)."
    )
    engines: int = Field(1, ge=1, description="Engine actors, each in a placement group of its own.")
    engine_resources: Resources = Field(
        default_factory=Resources,
        description="What each engine reserves (older spelling: num_cpus_per_engine, num_gpus_per_engine).",
    )
    max_model_len: int = Field(4096, ge=128, description="Env VLLM_MAX_MODEL_LEN overrides.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    hf_max_batch_size: int = Field(32, ge=1, description="HF: requests gathered into one batched generate.")
    hf_batch_wait_ms: float = Field(5.0, ge=0, description="HF: how long the first request waits for company.")
    vllm_gpu_memory_utilization: float = Field(
        0.1, gt=0, le=1, description="On CPU the fraction of RAM; env VLLM_GPU_MEMORY_UTILIZATION overrides."
    )
    vllm_kv_cache_gb: float = Field(1.0, gt=0, description="CPU only: VLLM_CPU_KVCACHE_SPACE.")
    missing_logprob_floor: float = Field(-20.0, description="Used (and counted) when an engine returns no logprob.")
    mode: Literal["async", "lockstep"] = Field("async", description="Episodes move on independently, or turn by turn.")
    max_total_tokens: int = Field(2048, ge=64, description="Per episode: prompt + responses + observations.")
    max_episode_restarts: int = Field(2, ge=0, description="Restarts of an episode whose engine died.")
    runners: int = Field(1, ge=1, description="EpisodeRunner actors; each drives every engine.")
    runner_resources: Resources = Field(
        default_factory=lambda: Resources(num_cpus=0.1),
        description="What each runner reserves (older spelling: num_cpus_per_runner).",
    )
    max_concurrent_episodes: int | None = Field(None, ge=1, description="Per runner; None = all at once.")
    max_engine_restarts: int = Field(
        3, ge=0, description="Engine actors a RolloutGroup restarts (with the current policy) over its life."
    )
    max_runner_restarts: int = Field(
        3, ge=0, description="Runner actors a RolloutGroup replaces (re-running their tasks) over its life."
    )
    overlap: bool = Field(False, description="Generate step k+1 while step k trains (one step off-policy).")
    weight_push: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="finetune.mode lora/qlora only: what the learner pushes to the engines after each step. adapter: "
        "the LoRA adapter (engines serve it as a LoRA request); merged: the base weights with the adapter merged in "
        "(W + scaling * B @ A under the base model's names, a full-weight reload; engines run without LoRA). "
        "auto: merged when the engines are vLLM on CPU (vLLM-cpu generates ~9x slower through a LoRA adapter), "
        "adapter otherwise (LoRA kernels are fast on GPU; the HF engine applies adapters per batch). qlora: merged "
        "sends the dequantized 4-bit base with the adapter (the policy the learner trains), and auto is merged on any "
        "engine; adapter is applied over the unquantized base (a learner/engine logprob gap of ~1 nat on SmolLM2).",
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_resources(cls, data: Any) -> Any:
        data = _read_flat_resources(
            data, "engine_resources", {"num_cpus_per_engine": "num_cpus", "num_gpus_per_engine": "num_gpus"}
        )
        return _read_flat_resources(data, "runner_resources", {"num_cpus_per_runner": "num_cpus"})


# --------------------------------------------------------------------------- training


class AlgorithmConfig(Strict):
    """GRPO or PPO: advantages and the policy loss (grpo/)."""

    name: Literal["grpo", "ppo"] = Field(
        "grpo",
        description="grpo: one advantage per episode from its group (`advantage`); ppo: a value head on the policy "
        "and per-token GAE advantages (gamma, lam, value_loss_coef, value_clip, whiten_advantages; `advantage` and "
        "`std_normalize` are not used).",
    )
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = Field(
        "grpo",
        description="grpo: minus the group mean (over the group std); dr_grpo: minus the group mean, never over the "
        "std (std_normalize is ignored), and the loss divided by a constant (dr_grpo_norm_tokens × the minibatch's "
        "episodes) instead of its token count (loss_reduction is ignored); rloo: minus the mean of the others; "
        "reinforce_pp: batch mean.",
    )
    std_normalize: bool = Field(True, description="Divide by the group's std (grpo) or the batch's (reinforce_pp).")
    outcome_first: float | None = Field(
        0.5,
        ge=0,
        lt=1,
        description="Group advantages rank episodes by outcome first (grpo/groups.py): score = answer right (0/1) + "
        "this × logistic(shaped total), so no failed episode outranks a succeeded one of its group; the shaped part "
        "only orders episodes of equal outcome. None = the summed reward as it is. Heuristic rewards only.",
    )
    filter_groups: Literal["none", "outcome"] = Field(
        "none",
        description="outcome: leave out of the learner's batch every group whose episodes all answered right or all "
        "wrong (DAPO's dynamic sampling, on the binary outcome, never the shaped total); the share kept is logged as "
        "rollout/groups_kept. A step with no such group trains nothing. none: every group trains.",
    )
    refill_rounds: int = Field(
        0,
        ge=0,
        description="filter_groups outcome: while fewer than train.tasks_per_step groups of a step hold both outcomes, "
        "play up to this many more rounds of train.tasks_per_step new tasks (drawn as the step's were) and train on "
        "every such group found (DAPO's dynamic sampling, bounded); the rounds played are logged as "
        "rollout/refill_rounds. 0: no refill.",
    )
    dr_grpo_norm_tokens: int | None = Field(
        None,
        ge=1,
        description="dr_grpo: L_max, the constant the loss's token sum is divided by (per episode); None = the "
        "episode's generation budget, rollout.sampling.max_new_tokens × generation.max_turns.",
    )
    clip_eps_low: float = Field(0.2, ge=0, description="Ratio clipped below at 1 - clip_eps_low.")
    clip_eps_high: float = Field(0.28, ge=0, description="Ratio clipped above at 1 + clip_eps_high.")
    loss_reduction: Literal["token", "sequence"] = Field(
        "token", description="token: mean over all generated tokens of the batch; sequence: per-sequence mean first."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of KL(policy || reference) in the loss; 0 = no reference.")
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    tis_cap: float | None = Field(
        2.0, gt=0, description="Truncated importance weight cap for learner/rollout logprob gaps; None = off."
    )
    gamma: float = Field(0.99, ge=0, le=1, description="ppo: GAE discount per generated token.")
    lam: float = Field(0.95, ge=0, le=1, description="ppo: GAE lambda.")
    value_loss_coef: float = Field(0.5, ge=0, description="ppo: weight of the value loss beside the policy loss.")
    value_clip: float | None = Field(
        0.2, gt=0, description="ppo: new values kept within ±value_clip of the old ones in the value loss; None = off."
    )
    whiten_advantages: bool = Field(
        True, description="ppo: GAE advantages shifted and scaled to mean 0, std 1 over the batch's generated tokens."
    )

    @model_validator(mode="after")
    def _refill_needs_the_filter(self) -> AlgorithmConfig:
        if self.refill_rounds and (self.filter_groups != "outcome" or self.name == "ppo"):
            raise ValueError(
                "refill_rounds plays more tasks to find groups with both outcomes: it needs filter_groups: outcome "
                f"and a group algorithm (name is {self.name!r}, filter_groups {self.filter_groups!r})"
            )
        return self


class OptimConfig(Strict):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="linear/cosine decay ends at lr * min_lr_ratio.")
    grad_clip: float = Field(1.0, gt=0)


class DeepspeedConfig(Strict):
    """`learner.backend: deepspeed`: DeepSpeed ZeRO over the learner's torch.distributed group."""

    stage: Literal[2, 3] = Field(
        2, description="ZeRO stage: 2 shards optimizer state and gradients; 3 shards the parameters as well."
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra DeepSpeed config keys merged into the one mcprl builds (e.g. offload_optimizer, "
        "reduce_bucket_size under zero_optimization). Batch sizes, optimizer, scheduler, gradient clipping, "
        "gradient accumulation and precision (learner.dtype) are the learner's own and cannot be set here. "
        "ZeRO-3 runs with stage3_param_persistence_threshold 0 (no parameter kept whole, so that a moving KL "
        "reference blends partitions in place); a run with a fixed reference may raise it. A DeepSpeed "
        "checkpoint resumes at the same learner.workers and stage.",
    )

    @field_validator("config")
    @classmethod
    def _not_ours(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(value) & DEEPSPEED_OWNED_KEYS)
        if owned:
            raise ValueError(
                f"learner.deepspeed.config: {owned} are set by the learner (from learner.optim, learner.dtype "
                "and its own micro-batching); remove them"
            )
        return value


# DeepSpeed config keys the learner derives itself (actors/sharding/deepspeed_zero.py, DeepspeedBackend).
DEEPSPEED_OWNED_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "managed_gradient_accumulation",
        "gradient_clipping",
        "optimizer",
        "scheduler",
        "bf16",
        "fp16",
    }
)


class LearnerConfig(Strict):
    """The learner group: L workers, torch.distributed + FSDP2 or DeepSpeed ZeRO."""

    workers: int = Field(1, ge=1, description="Ranks, PACKed in one placement group (one node when they fit).")
    backend: Literal["fsdp2", "deepspeed"] = Field(
        "fsdp2",
        description="Sharding backend at world size > 1: fsdp2 (torch's fully_shard) or deepspeed (ZeRO 2/3, "
        "`learner.deepspeed`; needs the `deepspeed` extra). One rank shards nothing: the plain backend.",
    )
    deepspeed: DeepspeedConfig = Field(default_factory=DeepspeedConfig, description="learner.backend: deepspeed.")
    worker_resources: Resources = Field(
        default_factory=Resources,
        description="What each rank reserves (older spelling: num_cpus_per_worker, num_gpus_per_worker).",
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="Parameter/compute dtype of the learner; float32 on a CPU where torch has no bf16 kernels "
        "(x86 without AVX-512 or AMX: ~100x slower there; actors/precision.py).",
    )
    gradient_checkpointing: bool = True
    micro_batch_tokens: int = Field(4096, ge=64, description="Tokens (padded) per forward/backward micro-batch.")
    selective_logits: bool = Field(
        True,
        description="Run the LM head only where the loss mask is 1 (generated tokens), not at every prompt and "
        "observation position; false: the whole sequence (the old path, kept for comparison).",
    )
    shared_prompt: bool = Field(
        True,
        description="With selective_logits: a GRPO group's prompt is computed once per micro-batch, its "
        "episodes' responses attending to it (grpo.batch.pack_shared; attention through "
        "actors/learner/row_attention.py, which computes only the pairs that attend): the same logprobs on fewer "
        "tokens; false: each episode whole (the old path, kept for comparison).",
    )
    shared_prompt_when: Literal["cheaper", "always"] = Field(
        "cheaper",
        description="cheaper: a group's prompt is shared only where its row costs less than the episodes whole "
        "(grpo.batch.share_pays: after a short prompt, one long response, such as a big tool result, pads the "
        "row's attention past what sharing saves); always: every group (the old path, kept for comparison).",
    )
    pad_mask: bool = Field(
        False,
        description="Pass the padding mask to attention where episodes are each whole (SFT demonstrations, "
        "shared_prompt false); false: none, since right padding comes after every real token and the causal "
        "mask already hides it, and without a mask SDPA runs its causal kernel, which skips the masked half "
        "(the same logprobs; true is the old path, kept for comparison).",
    )
    reference: Literal["fixed", "periodic", "ema"] = Field(
        "fixed",
        description="How the KL reference moves: fixed (the base, or the warm-started policy); periodic (a copy of "
        "the policy every `reference_every` GRPO steps); ema (the policy blended in every `reference_every` steps).",
    )
    reference_every: int = Field(
        100, ge=0, description="periodic / ema: N, the GRPO steps between reference updates (>= 1 for both)."
    )
    reference_ema: float = Field(
        0.99, gt=0, lt=1, description="ema: a in ref = a*ref + (1-a)*policy, applied every `reference_every` steps."
    )
    reference_cpu_offload: bool = Field(False, description="full mode: keep the frozen reference on CPU.")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    max_restarts: int = Field(
        1,
        ge=0,
        description="Times a run rebuilds its learner group after a worker died, from the last checkpoint (the "
        "steps after it are run again); past that, or with no checkpoint yet, it stops and prints the resume command.",
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_resources(cls, data: Any) -> Any:
        return _read_flat_resources(
            data, "worker_resources", {"num_cpus_per_worker": "num_cpus", "num_gpus_per_worker": "num_gpus"}
        )

    @model_validator(mode="after")
    def _reference_period(self) -> LearnerConfig:
        if self.reference != "fixed" and self.reference_every < 1:
            raise ValueError(
                f"learner.reference_every must be >= 1 with learner.reference {self.reference!r} (the reference is "
                f"updated every N GRPO steps), got {self.reference_every}"
            )
        return self


FindingName = Literal["zero_variance", "ratio_degenerate", "logprob_gap", "kl_blowup", "grad_norm"]


class HealthConfig(Strict):
    """Training-health checks after every GRPO step (grpo/health.py; the same names): each finding is logged
    and listed in the report. A finding named in `stop_on` that holds at `patience` consecutive steps ends the
    run: the driver checkpoints, writes the report and exits with status 3 (jobs.train.HEALTH_STOP_EXIT; a crash
    is 1), printing the finding, its values and the command that resumes the run."""

    logprob_gap_limit: float = Field(
        0.5, gt=0, description="logprob_gap: fires when the learner's and the engine's logprobs differ by more."
    )
    kl_limit: float = Field(1.0, gt=0, description="kl_blowup: fires when the KL to the reference exceeds this,")
    kl_growth: float = Field(10.0, gt=1, description="kl_blowup: or grows by this factor within 3 steps,")
    kl_floor: float = Field(
        1e-3, gt=0, description="kl_blowup: growth is measured from at least this KL (it starts at 0)."
    )
    ratio_std_eps: float = Field(
        1e-7, ge=0, description="ratio_degenerate: fires when the ratio's std after the first minibatch is <= this."
    )
    stop_on: list[FindingName] = Field(
        default_factory=list,
        description="The findings that end the run: zero_variance, ratio_degenerate, logprob_gap, kl_blowup, "
        "grad_norm. [] = none (they are only reported).",
    )
    patience: int = Field(3, ge=1, description="K: consecutive steps a stop_on finding must hold to end the run.")
    patience_per_finding: dict[FindingName, int] = Field(
        default_factory=dict, description="K for one finding, overriding `patience`, e.g. {kl_blowup: 1}."
    )

    @field_validator("patience_per_finding")
    @classmethod
    def _at_least_one(cls, value: dict[str, int]) -> dict[str, int]:
        for name, k in value.items():
            if k < 1:
                raise ValueError(f"patience of {name} must be >= 1 (consecutive steps), got {k}")
        return value


class DataConfig(Strict):
    train: str = Field("data/train.jsonl", description="Task rows for training (.jsonl/.json/.parquet).")
    validation: str = Field(
        "",
        description="Held-out task rows for evaluation, the run's headline figure (ideally held-out instances of the "
        "training templates: generation.instance_splits); empty = none.",
    )
    transfer: str = Field(
        "",
        description="A second held-out set, evaluated at the same stages and reported beside the first (e.g. "
        "templates never trained on); empty = none.",
    )
    generate: Literal["", "rule"] = Field(
        "", description="rule: when the files are missing, generate them with the `generation` section (+ splits)."
    )


class SftConfig(Strict):
    """Supervised warm start on expert trajectories before RL (a small model has no signal otherwise)."""

    enabled: bool = False
    steps: int = Field(8, ge=1, description="Stops early by design so that RL has room to show its gain.")
    batch_size: int = Field(8, ge=1, description="Expert trajectories per step.")
    lr: float = Field(2e-4, gt=0)


class CurriculumConfig(Strict):
    """Draw tasks by their recent pass rate, favouring those neither always solved nor always failed
    (a GRPO group whose episodes all agree gives no signal). See tasks/curriculum.py."""

    enabled: bool = Field(
        False, description="Weight tasks by pass rate p as p·(1−p) + min_weight; false = the plain shuffled stream."
    )
    window: int = Field(16, ge=1, description="A task's pass rate counts its last `window` episodes.")
    min_weight: float = Field(
        0.02, gt=0, description="Floor on every task's draw weight, so tasks near 0 or 1 still come back sometimes."
    )


class TrainConfig(Strict):
    steps: int = Field(10, ge=0, description="GRPO iterations; 0 = the warm start alone (a baseline to compare with).")
    tasks_per_step: int = Field(4, ge=1, description="B: tasks sampled per iteration.")
    group_size: int = Field(
        4, ge=1, description="G: episodes per task (the GRPO group); at least 2, except with algorithm.name ppo."
    )
    epochs: int = Field(1, ge=1, description="Passes over each iteration's batch.")
    minibatches: int = Field(1, ge=1, description="Optimizer steps per epoch (the batch is split in this many).")
    seed: int = 0
    curriculum: CurriculumConfig = Field(
        default_factory=CurriculumConfig, description="Pass-rate curriculum for drawing each step's tasks."
    )
    eval_every: int = Field(0, ge=0, description="Evaluate on the validation split every N steps; 0 = start/end only.")
    eval_tasks: int = Field(32, ge=1, description="Tasks of each held-out set played (greedy) per evaluation.")
    eval_base: bool = Field(
        True,
        description="Evaluate the base model before training (stage 'base'); false skips it when its figure is "
        "known (a small model's base answers none: minutes of evaluation for a 0).",
    )
    checkpoint_every: int = Field(0, ge=0, description="Checkpoint every N steps (and at the end); 0 = end only.")
    keep_checkpoints: int = Field(
        0,
        ge=0,
        description="K: keep the newest K checkpoints, the best by evaluation success (the evaluations every "
        "eval_every steps) and the one the run resumed from; delete the others. 0 = keep all.",
    )
    storage: str = Field(
        "runs",
        description="Where runs are kept, <storage>/<run_name>/: a folder (every node must see it: one node, or a "
        "shared filesystem) or a URI (s3://bucket/prefix, gs://...). Checkpoints, adapters, metrics, report and "
        "W&B files go there. A relative folder resolves against the launch directory; in a submitted Ray job "
        "(whose working directory is deleted with it) against ~/mcprl.",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "output_dir" in data:
            raise ValueError("train.output_dir was renamed train.storage (a folder or an s3:// / gs:// URI)")
        return data


class LoggingConfig(Strict):
    wandb: Literal["auto", "online", "offline", "off"] = Field(
        "auto",
        description="auto: online when WANDB_API_KEY is set, offline otherwise; off: no W&B. YAML's booleans "
        "count too: off/false/no mean off, on/true/yes mean auto.",
    )
    wandb_project: str = "mcprl"

    @field_validator("wandb", mode="before")
    @classmethod
    def _wandb_bool(cls, value: Any) -> Any:
        # YAML 1.1 (PyYAML, so `--set` too) reads a bare off/on/no/yes as a boolean.
        if isinstance(value, bool):
            return "auto" if value else "off"
        return value

    sample_trajectories: int = Field(4, ge=0, description="Trajectories logged as a W&B table per step.")
    ray_metrics: bool = Field(
        True,
        description="Export Ray metrics tagged run=<run_name> (cluster/metrics.py lists them): the driver's step "
        "figures, each engine's policy version, tool latency and errors; cluster/grafana/mcprl.json plots them.",
    )
    engine_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING",
        description="What vLLM prints in the engine actors, which Ray echoes into the driver's (and the job's) log; "
        "every line also stays in Ray's worker log files. `-v` makes it INFO.",
    )


# --------------------------------------------------------------------------- model, cluster


class ModelConfig(Strict):
    name: str = Field(
        "tiny-random",
        description="An HF id, a local folder, or a built-in name: smollm2-135m-instruct, tiny-random.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="What the engines compute in and the policy is pushed in. On a CPU where torch has no kernels "
        "for it (x86 without AVX-512 or AMX), float32: bf16 runs ~100x slower there (actors/precision.py).",
    )
    cache_dir: str = Field("", description="Where built-in models are built; empty = $MCPRL_CACHE or ~/.cache/mcprl.")


class ClusterConfig(Strict):
    address: str | None = Field(None, description="Ray address; None = $RAY_ADDRESS, else start an embedded local Ray.")
    num_cpus: float | None = Field(None, description="CPUs of the embedded Ray (None = all cores).")
    namespace: str = "mcprl"
    dashboard: bool = Field(
        False,
        description="Start the dashboard with the embedded Ray (127.0.0.1:8265, or the next free port; the run "
        "prints its URL).",
    )


class Config(Strict):
    """The root of the config tree."""

    run_name: str = "mcprl"
    model: ModelConfig = Field(default_factory=ModelConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft_warmup: SftConfig = Field(default_factory=SftConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _qlora_is_one_rank(self) -> Config:
        # FSDP2 (and DeepSpeed) do not shard bitsandbytes' packed 4-bit weights: QLoRA is for one device.
        if self.finetune.mode == "qlora" and (self.learner.workers != 1 or self.learner.backend != "fsdp2"):
            raise ValueError(
                f"finetune.mode qlora runs on one learner rank, unsharded: learner.workers must be 1 (got "
                f"{self.learner.workers}) and learner.backend fsdp2 (got {self.learner.backend})"
            )
        return self

    @model_validator(mode="after")
    def _group_of_one_only_for_ppo(self) -> Config:
        if self.train.group_size < 2 and self.algorithm.name != "ppo":
            raise ValueError(
                f"train.group_size is {self.train.group_size}: GRPO needs at least 2 episodes per task (a group of "
                "one has no baseline); only algorithm.name ppo allows 1"
            )
        return self
