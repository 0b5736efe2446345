"""Preflight of a training run: everything that can be checked before any GPU time is spent.

`python -m jobs.train --config X` (without `--run`) runs these checks and prints the plan, and writes
nothing (rule tasks it would generate are generated into a temporary folder, checked, and deleted);
with `--run` the same checks gate the run, so a bad config, bad data or a missing key stops it before
any actor starts. Each failed check says what to fix.

Checks: resources (what each role asks of the cluster, and whether it holds them now, after growing, or
never; with --run, a cluster that must grow is asked for them at once), data (task files through the gate), model and
tokenizer, the chat template round trip (render a task, tokenize, parse a tool call back), API keys
(live tools, the judge), and that every MCP server answers with its tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster import storage
from cluster.placement import ClusterView, NodeType, Role
from configs.schema import Config, LiveService
from jobs.cli import counted

PASS, FAIL = "ok", "FAIL"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass
class Preflight:
    """The checks, and what they loaded that the run reuses (rows, listing, tokenizer)."""

    checks: list[Check] = field(default_factory=list)
    listing: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    train_rows: list[dict[str, Any]] = field(default_factory=list)
    validation_rows: list[dict[str, Any]] = field(default_factory=list)
    transfer_rows: list[dict[str, Any]] = field(default_factory=list)
    tokenizer: Any = None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str, fix: str = "") -> bool:
        self.checks.append(Check(name, ok, detail, fix))
        return ok

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


# --------------------------------------------------------------------------- resources


def run_roles(cfg: Config) -> list[Role]:
    """Every role the run starts: how many actors (or replicas, at most), what each reserves, its config key."""
    from serve_apps.tool_pool import server_specs

    r, ln = cfg.rollout, cfg.learner
    roles = [
        Role("engines", r.engines, r.engine_resources, key="rollout.engine_resources"),
        Role("runners", r.runners, r.runner_resources, key="rollout.runner_resources"),
        Role("learner workers", ln.workers, ln.worker_resources, key="learner.worker_resources"),
    ]
    externals = {e.name: i for i, e in enumerate(cfg.tools.external)}
    for spec in server_specs(cfg.tools):
        key = f"tools.external[{externals[spec.name]}]" if spec.external else f"tools.servers.{spec.name}"
        scaled = f"{spec.min_replicas}-{spec.max_replicas}" if spec.cfg.autoscaling else ""
        roles.append(
            Role(f"tool {spec.name}", spec.max_replicas, spec.cfg.replica_resources, scaled, f"{key}.replica_resources")
        )
    if cfg.reward.backend != "heuristic" and cfg.reward.judge.source != "local":
        roles.append(Role("judge", 1, cfg.reward.judge.replica_resources, key="reward.judge.replica_resources"))
    return roles


def cluster_view(cfg: Config) -> ClusterView:
    """What the run will have: the connected cluster (nodes, autoscaler node types), or the embedded Ray."""
    from cluster.placement import connected_view
    from cluster.ray_env import checked_address, configure_ray_env

    address = checked_address(cfg.cluster)
    if address:
        configure_ray_env()  # before ray is imported: a loopback address needs the loopback setting
        import ray

        if not ray.is_initialized():
            ray.init(address=address, namespace=cfg.cluster.namespace, logging_level="ERROR")
        return connected_view(address)
    import torch

    cpus = cfg.cluster.num_cpus if cfg.cluster.num_cpus is not None else float(os.cpu_count() or 1)
    gpus = float(torch.cuda.device_count()) if torch.cuda.is_available() else 0.0
    this = NodeType("this machine", {"CPU": cpus, **({"GPU": gpus} if gpus else {})})
    return ClusterView("embedded Ray on this machine", [this])


def check_resources(cfg: Config, pf: Preflight, request: bool = False) -> None:
    """Can the cluster hold every role now, after growing, or never (cluster/placement.py)? With `request`
    (--run) and a cluster that must grow, ask its autoscaler for all the roles' bundles at once."""
    from cluster.placement import fit_roles, fit_table, request_bundles

    roles = run_roles(cfg)
    view = cluster_view(cfg)
    report = fit_roles(roles, view)
    table = "".join(f"\n      {line}" for line in fit_table(report, view))
    never = [f for f in report.fits if f.verdict == "never"]
    if never:
        names = ", ".join(f.role.name for f in never)
        keys = ", ".join(sorted({f.role.key for f in never}))
        fix = f"ask less of {keys} (or fewer actors), or use a cluster with a node (type) that has it"
        if view.nodes and not view.autoscaling and view.connected:
            fix += "; no autoscaler was found for this cluster, so it cannot grow"
        if not view.connected:
            fix += "; the embedded Ray has this machine only (raise cluster.num_cpus for more logical CPUs)"
        pf.add("resources", False, f"{view.where} can never hold {names}{table}", fix)
        return
    grow = [f.role.name for f in report.fits if f.verdict == "must grow"]
    if not grow:
        pf.add("resources", True, f"{view.where} holds every role now{table}")
        return
    if request and view.connected:
        bundles = [b for role in roles for b in role.bundles()]
        request_bundles(bundles)
        asked = f"asked its autoscaler for room for all {len(bundles)} actors"
    else:
        asked = "--run asks its autoscaler for room for all of them"
    pf.add("resources", True, f"{view.where} must grow for {', '.join(grow)}: {asked}{table}")


# --------------------------------------------------------------------------- data


def generated_data_paths(cfg: Config) -> tuple[Path, dict[str, Path]]:
    """Where `data.generate: rule` writes: `<dir>/<stem>.jsonl` splits into `<dir>/<stem>.<split>.jsonl`."""
    from jobs.generate_tasks import output_paths

    train = storage.node_path(cfg.data.train, "data.train")
    stem, dot, split = train.stem.rpartition(".")
    if not dot or split != "train":
        raise ValueError(
            f"data.train {train}: with data.generate=rule the file must be named <stem>.train<suffix> "
            "(e.g. data/tasks.train.jsonl), the generator's name for the train split"
        )
    out = train.with_name(stem + train.suffix)
    splits = cfg.generation.splits or {"train": 1.0}
    return out, {str(k): v for k, v in output_paths(out, splits).items()}


@contextlib.contextmanager
def task_files(cfg: Config, write: bool) -> Iterator[tuple[str, dict[str, Path]]]:
    """The task files to check, by config key, and a line saying where they come from.

    With `data.generate: rule` and files missing, the rule tasks are generated: into their configured
    place when `write`, else (a dry run writes nothing) into a temporary folder that exists only
    while the context is open."""
    wanted = {"data.train": storage.node_path(cfg.data.train, "data.train")}
    for key in ("validation", "transfer"):
        if getattr(cfg.data, key):
            wanted[f"data.{key}"] = storage.node_path(getattr(cfg.data, key), f"data.{key}")
    if cfg.data.generate != "rule" or all(p.is_file() for p in wanted.values()):
        yield ("task files present" if cfg.data.generate == "rule" else "task files"), wanted
        return
    out, paths = generated_data_paths(cfg)
    written = {str(q) for q in paths.values()}
    missing = [(key, str(p)) for key, p in wanted.items() if str(p) not in written]
    if missing:
        raise ValueError(
            f"{missing[0][0]} {missing[0][1]} is not a split the generator writes; with generation.splits "
            f"{cfg.generation.splits} it writes {', '.join(map(str, paths.values()))}"
        )
    if write:
        _generate_rule_tasks(cfg, out)
        yield f"generated rule tasks into {out.parent}", wanted
        return
    with tempfile.TemporaryDirectory(prefix="mcprl-preflight-") as tmp:
        with contextlib.redirect_stdout(io.StringIO()):  # its "wrote N rows to <temp file>" would mislead
            _generate_rule_tasks(cfg, Path(tmp) / out.name)
        where = ", ".join(str(p) for p in wanted.values())
        yield (
            f"--run would generate rule tasks into {where} (nothing written now)",
            {key: Path(tmp) / p.name for key, p in wanted.items()},
        )


def _generate_rule_tasks(cfg: Config, out: Path) -> None:
    from jobs.generate_tasks import build_parser, resolve, run

    args = build_parser().parse_args(["--method", "rule", "--out", str(out)])
    resolve(args, cfg, os.environ)
    if asyncio.run(run(args, cfg)) != 0:
        raise ValueError("rule generation admitted no tasks")


def check_data(cfg: Config, pf: Preflight, write: bool = False) -> None:
    """Load the task files through the gate; `write`: generate missing rule tasks into place (see task_files)."""
    from tasks.dataset import DataError, load_tasks
    from tasks.inventory import inventory_from_listing, live_writing_tools

    inventory = inventory_from_listing(pf.listing)
    live = live_writing_tools(pf.listing, cfg.tools)
    try:
        with task_files(cfg, write) as (detail, files):
            pf.train_rows = load_tasks(files["data.train"], inventory, "data.train", live)
            if "data.validation" in files:
                pf.validation_rows = load_tasks(files["data.validation"], inventory, "data.validation", live)
            if "data.transfer" in files:
                pf.transfer_rows = load_tasks(files["data.transfer"], inventory, "data.transfer", live)
    except DataError as e:
        pf.add("data", False, str(e), "fix or drop the rows named (python -m jobs.validate_tasks --in FILE)")
        return
    except storage.StorageError as e:
        pf.add("data", False, str(e), "set data.train and data.validation to paths on the driver's node")
        return
    except Exception as e:
        pf.add("data", False, f"generating tasks failed: {e}", "fix the generation section or data paths")
        return
    if len(pf.train_rows) < cfg.train.tasks_per_step:
        pf.add(
            "data",
            False,
            f"{len(pf.train_rows)} training tasks, fewer than train.tasks_per_step={cfg.train.tasks_per_step}",
            "add tasks or lower train.tasks_per_step",
        )
        return
    val = f", {len(pf.validation_rows)} validation" if cfg.data.validation else ", no validation split"
    val += f", {len(pf.transfer_rows)} transfer" if cfg.data.transfer else ""
    pf.add("data", True, f"{detail}: {len(pf.train_rows)} training tasks{val}; all pass the gate")


# --------------------------------------------------------------------------- model, template


def check_model(cfg: Config, pf: Preflight) -> None:
    """The config and tokenizer (the driver's share of the model); an HF id's weights may stay on the Hub,
    for each node to download when it loads the model."""
    from huggingface_hub import constants
    from transformers import AutoConfig

    from actors.models import BUILTIN_MODELS, ModelNotFoundError, load_tokenizer, resolve_model

    name = cfg.model.name
    try:
        folder = resolve_model(name, cfg.model.cache_dir, weights=False)
        model_cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
        pf.tokenizer = load_tokenizer(cfg.model)
    except Exception as e:
        detail = str(e) if isinstance(e, ModelNotFoundError) else f"{name}: {type(e).__name__}: {e}"
        fix = "set model.name to a built-in, a local folder, or an HF id (downloaded unless HF_HUB_OFFLINE is set)"
        pf.add("model", False, detail, fix)
        return
    weights = sorted(p.name for p in Path(folder).glob("*.safetensors")) or sorted(Path(folder).glob("*.bin"))
    hub_id = name not in BUILTIN_MODELS and not Path(name).expanduser().is_dir()
    where = f"at {folder}"
    if not weights:
        if not hub_id or constants.is_offline_mode():
            pf.add("model", False, f"{folder} has no weight files", "point model.name at a complete model folder")
            return
        where = f"config and tokenizer at {folder}; each node downloads the weights when it first loads the model"
    if not pf.tokenizer.chat_template:
        pf.add("model", False, f"{name} has no chat template", "choose an instruct/chat model")
        return
    positions = getattr(model_cfg, "max_position_embeddings", None)
    if cfg.rollout.backend == "vllm" and positions and cfg.rollout.max_model_len > positions:
        detail = f"rollout.max_model_len {cfg.rollout.max_model_len} > {name}'s {positions} positions (vLLM refuses)"
        pf.add("model", False, detail, f"set rollout.max_model_len to at most {positions}")
        return
    pf.add("model", True, f"{name}: {model_cfg.model_type}, vocab {model_cfg.vocab_size}, {where}")


def check_template(cfg: Config, pf: Preflight) -> None:
    """Render the first task's prompt, tokenize it, and parse the expected first call back from tokens."""
    from envs.parsing import ToolIndex, parse_turn
    from envs.prompting import call_syntax, count_prompt_tokens, tool_prompt_for
    from tasks.inventory import inventory_from_listing
    from tasks.schema import TaskRow

    if pf.tokenizer is None or not pf.train_rows:
        pf.add("chat template", False, "skipped: needs the model and the data", "fix the checks above")
        return
    row = pf.train_rows[0]
    task = row if isinstance(row, TaskRow) else TaskRow.model_validate(row)
    step = task.reward_spec.ground_truth.tool_sequence[0]
    try:
        # What an episode's prompt costs, rendered as the runner renders it (envs/prompting.py).
        n_tokens = count_prompt_tokens(pf.tokenizer, task, pf.listing, cfg.env.final_answer, cfg.env.tool_format)
        call = call_syntax(pf.tokenizer)(f"{step.server}.{step.tool}", step.params)
        call_ids = pf.tokenizer(call, add_special_tokens=False)["input_ids"]
        back = pf.tokenizer.decode(call_ids)
        parsed = parse_turn(
            back,
            ToolIndex(inventory_from_listing(pf.listing)),
            aliases=cfg.env.argument_aliases,
            final_answer=cfg.env.final_answer,
        )
    except Exception as e:
        pf.add("chat template", False, f"rendering task {task.reward_spec.ground_truth.task_id}: {e}", "")
        return
    got = [(c.server, c.tool, c.arguments) for c in parsed.calls]
    want = [(step.server, step.tool, step.params)]
    shown = (
        "the chat template's tools="
        if tool_prompt_for(pf.tokenizer) == "template"
        else f"a {cfg.env.tool_format} system tool block"
    )
    ok = got == want
    pf.add(
        "chat template",
        ok,
        f"prompt of {n_tokens} tokens (tools in {shown}); a tool call round-trips through the tokenizer"
        if ok
        else f"the call {call!r} came back as {got or parsed.errors}",
        "" if ok else "the tokenizer does not round-trip tool-call text; check the model's tokenizer",
    )


# --------------------------------------------------------------------------- keys, servers


def check_keys(cfg: Config, pf: Preflight) -> None:
    from serve_apps.tool_pool import LIVE_KEYS

    missing = []
    for name in type(cfg.tools.servers).model_fields:
        server = getattr(cfg.tools.servers, name)
        if isinstance(server, LiveService) and server.enabled and server.backend == "live":
            key = LIVE_KEYS.get(name)
            if key and not os.environ.get(key):
                missing.append(f"{key} (tools.servers.{name}.backend=live)")
    if cfg.reward.backend != "heuristic":
        judge = cfg.reward.judge.openai
        if not judge.base_url and not os.environ.get(judge.api_key_env):
            missing.append(f"{judge.api_key_env} (reward.backend={cfg.reward.backend})")
    pf.add(
        "API keys",
        not missing,
        "none missing" if not missing else "missing: " + ", ".join(missing),
        "set them in the environment or .env (see .env.example), or use the offline backends",
    )


def check_servers(cfg: Config, pf: Preflight) -> bool:
    """Build each configured server in this process, list its tools and run its health probe (the one Serve
    runs on its replicas: the python tool's runs a program in the sandbox). Returns whether all passed."""
    from serve_apps.tool_pool import LocalToolPool, make_host, server_specs

    async def listing() -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
        hosts, errors = {}, []
        for spec in server_specs(cfg.tools):
            try:
                hosts[spec.name] = await make_host(spec)
            except Exception as e:
                errors.append(f"{spec.name}: {type(e).__name__}: {e}")
        pool = LocalToolPool(hosts)
        try:
            out = {}
            for name, host in hosts.items():
                try:
                    out[name] = (await LocalToolPool({name: host}).list_tools())[name]
                    # A server can list its tools and still fail every call (the python tool without
                    # bubblewrap): the rule tasks that need it would be dropped as if their templates had
                    # run out of tasks.
                    if host.probe and (problem := await host.probe()):
                        errors.append(f"{name}: {problem}")
                except Exception as e:
                    errors.append(f"{name}: {type(e).__name__}: {e}")
            return out, errors
        finally:
            await pool.close()

    pf.listing, errors = asyncio.run(listing())
    detail = ", ".join(f"{name} ({counted(len(tools), 'tool')})" for name, tools in pf.listing.items())
    return pf.add(
        "MCP servers",
        not errors and bool(pf.listing),
        detail if not errors else "; ".join(errors),
        "" if not errors else "fix the server's config (command, url, backend) or disable it",
    )


def check_tools_port(cfg: Config, pf: Preflight) -> None:
    """Where the pool's HTTP door will be when the run starts its own Ray; a port set explicitly and taken fails
    here, before anything starts. A cluster's Serve listens on its own machines (and may be running already)."""
    from cluster.ports import PortTaken, taken_port
    from cluster.ray_env import cluster_address

    http = cfg.tools.http
    if cluster_address(cfg.cluster):
        return
    try:
        moves = taken_port("tools.http.port", http.host, http.port, explicit=http.port_is_explicit())
    except PortTaken as e:
        pf.add("tools port", False, e.problem, e.fix)
        return
    if moves:
        detail = f"{http.port} is in use (another run?): the MCP tool pool will take a free port, printed at start"
        pf.add("tools port", True, detail)
    else:
        pf.add("tools port", True, f"the MCP tool pool will serve on {http.host}:{http.port}")


# --------------------------------------------------------------------------- all of it


def run_preflight(cfg: Config, write: bool = False) -> Preflight:
    """All checks. Without `write` (the dry run) nothing is written: missing rule tasks are generated
    into a temporary folder, checked and deleted; with it (`--run`) they are written into place."""
    pf = Preflight()
    check_resources(cfg, pf, request=write)
    check_keys(cfg, pf)
    servers_ok = check_servers(cfg, pf)
    check_tools_port(cfg, pf)
    check_model(cfg, pf)
    if servers_ok:
        check_data(cfg, pf, write)
    else:
        pf.add("data", False, "skipped: the tasks are checked against working MCP servers", "fix the MCP servers first")
    check_template(cfg, pf)
    if write and not pf.ok:
        from cluster.placement import release_request

        release_request()  # nothing will start: the nodes asked for must not stay up
    return pf


def plan_lines(cfg: Config) -> list[str]:
    from actors.engine_api import choose_backend
    from actors.precision import dtype_note

    t = cfg.train
    episodes = t.tasks_per_step * t.group_size
    alg = cfg.algorithm
    if alg.name == "ppo":
        advantage = f"GAE (gamma {alg.gamma}, lam {alg.lam}) with a value head"
    else:
        advantage = alg.advantage
        if alg.outcome_first is not None and cfg.reward.backend == "heuristic":
            advantage += ", outcome first"
        if alg.filter_groups == "outcome":
            advantage += ", groups without both outcomes left out"
            if alg.refill_rounds:
                advantage += f" (up to {alg.refill_rounds} more round(s) of {t.tasks_per_step} tasks to find them)"
        if t.curriculum.enabled:
            advantage += "; tasks drawn by pass rate (curriculum)"
    lines = [
        f"fine-tune: {cfg.finetune.mode}"
        + (f" (r={cfg.finetune.lora.r}, alpha={cfg.finetune.lora.alpha})" if cfg.finetune.trains_adapter else ""),
        f"rollout backend: {choose_backend(cfg)} ({cfg.rollout.engines} engines, {cfg.rollout.runners} runners, "
        f"{cfg.rollout.mode}{', overlapped with training' if cfg.rollout.overlap else ''}), {cfg.model.dtype}"
        + (dtype_note(cfg.model.dtype) if not cfg.rollout.engine_resources.num_gpus else ""),
        f"learner: {cfg.learner.workers} × {cfg.learner.backend} worker(s), {cfg.learner.dtype}"
        + (dtype_note(cfg.learner.dtype) if not cfg.learner.worker_resources.num_gpus else ""),
        f"plan: {t.steps} {alg.name.upper()} steps × {t.tasks_per_step} tasks × {t.group_size} episodes = "
        f"{episodes} episodes/step; {t.epochs} epoch(s) × {t.minibatches} minibatch(es) per step; "
        f"advantage {advantage}",
    ]
    if cfg.sft_warmup.enabled:
        lines.append(f"warm start: {cfg.sft_warmup.steps} SFT steps × {cfg.sft_warmup.batch_size} expert trajectories")
    base = "base, " if t.eval_base else ""
    stages = f"{base}after the warm start and at the end" if cfg.sft_warmup.enabled else "at the start and the end"
    evals = f"{stages}, and every {t.eval_every} steps" if t.eval_every else stages
    held_out = "validation" + (" and transfer" if cfg.data.transfer else "")
    lines.append(f"evaluation: up to {t.eval_tasks} {held_out} tasks, greedy, {evals}" if cfg.data.validation else "")
    ck = f"every {t.checkpoint_every} steps and at the end" if t.checkpoint_every else "at the end"
    from cluster import storage

    if t.keep_checkpoints:
        ck += f", keeping the newest {t.keep_checkpoints} and the best by evaluation"
    lines.append(f"checkpoints: {ck}, under {storage.join(storage.resolve(t.storage), cfg.run_name)}")
    from jobs.tracking import wandb_mode

    lines.append(f"W&B: {wandb_mode(cfg.logging.wandb) or 'off'} (logging.wandb: {cfg.logging.wandb})")
    if cfg.health.stop_on:
        lines.append(
            f"health: stops on {', '.join(cfg.health.stop_on)} after {cfg.health.patience} consecutive steps"
            + (f" (per finding: {cfg.health.patience_per_finding})" if cfg.health.patience_per_finding else "")
        )
    return [line for line in lines if line]
