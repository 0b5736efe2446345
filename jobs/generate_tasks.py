"""Generate task rows, send every one through the gate (admission), and write the kept ones.

python -m jobs.generate_tasks --method rule|llm|dependent|mcp [--n N] [--seed S] [--out data/train.jsonl]
    [--in FILE] [--servers a,b] [--domains a,b] [--complexities simple,medium,hard] [--max-tools N]
    [--max-turns N] [--split train=0.8,validation=0.1,test=0.1] [--instance-splits validation]
    [--config FILE] [--set KEY=VALUE ...]

Each knob is taken from, first to last: the command-line option; a `--set generation.KEY=...`; the
environment variable (N_SAMPLES, DOMAINS, COMPLEXITIES, MAX_TOOLS, MAX_TURNS, and OPENAI_MODEL,
OPENAI_BACKEND, OPENAI_BASE_URL for the OpenAI settings; an empty variable counts as unset); the
config file; the defaults.

The tool pool runs in this process (`LocalToolPool`, no Ray) with every built-in server on its
offline backend (and a fresh in-memory Slack workspace, and the python tool's timeout at least 30 s),
so answers come from the deterministic simulation; external servers are used as configured.
The output format follows the suffix of --out (.jsonl, .json or .parquet). With a split, each split
goes to `<out stem>.<split><suffix>`, e.g. data/train.validation.jsonl; no template is shared across
splits, except that an instance split (--instance-splits, rule only) holds held-out tickers and
phrasings of the train split's templates (see tasks/generators/splits.py).

Exit status: 0 rows written; 1 nothing was admitted; 2 bad input (options, config, input file).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cluster import storage
from configs.loader import ConfigError, apply_openai_env
from configs.schema import Config, GenerationConfig
from jobs.cli import base_parser, counted, setup, usage_error
from tasks.generators import METHODS, GeneratorUnavailable, get_generator
from tasks.generators.options import GenerateOptions, GenerationError
from tasks.generators.splits import assign_rows, check_instance_splits, check_splits, parse_splits
from tasks.io import FORMATS, TaskFileError, write_rows

log = logging.getLogger("generate_tasks")
MAX_REJECTIONS_SHOWN = 20

# option dest → (environment variable, config key under `generation`)
KNOBS = {
    "n": ("N_SAMPLES", "n_samples"),
    "domains": ("DOMAINS", "domains"),
    "complexities": ("COMPLEXITIES", "complexities"),
    "max_tools": ("MAX_TOOLS", "max_tools"),
    "max_turns": ("MAX_TURNS", "max_turns"),
}


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--method", required=True, choices=METHODS, help="how to make tasks")
    p.add_argument("--n", type=_positive_int, help="rows to generate (env N_SAMPLES; dependent converts all)")
    p.add_argument("--seed", type=int, help="random seed: the same seed gives the same rows")
    p.add_argument("--out", default="data/train.jsonl", help=f"output file ({', '.join(FORMATS)})")
    p.add_argument("--in", dest="in_path", metavar="FILE", help="dependent: conversations (.jsonl or .json)")
    p.add_argument("--servers", type=_csv, help="mcp: servers to make tasks for, comma-separated (default: all)")
    p.add_argument("--domains", type=_csv, help="servers to draw tools from, comma-separated (env DOMAINS)")
    p.add_argument("--complexities", type=_csv, help="simple,medium,hard or a subset (env COMPLEXITIES)")
    p.add_argument("--max-tools", type=_positive_int, help="most distinct tools in one task (env MAX_TOOLS)")
    p.add_argument("--max-turns", type=_positive_int, help="turn budget of each task (env MAX_TURNS)")
    p.add_argument("--split", help="e.g. train=0.8,validation=0.1,test=0.1 (no template shared across splits)")
    p.add_argument(
        "--instance-splits",
        type=_csv,
        help="rule: splits of held-out tickers and phrasings of train's templates, e.g. validation",
    )
    return p


def resolve(args: argparse.Namespace, cfg: Config, env: dict[str, str] | os._Environ[str]) -> None:
    """Write the winning value of each knob into `cfg.generation` (validated there; errors name the source)."""
    set_keys = {o.split("=", 1)[0].strip() for o in args.overrides}
    gen = cfg.generation
    for dest, (var, key) in KNOBS.items():
        cli = getattr(args, dest)
        raw = env.get(var, "").strip()
        if cli is not None:
            value, source = cli, f"--{dest.replace('_', '-')}"
        elif raw and f"generation.{key}" not in set_keys:
            value, source = (_csv(raw) if key in ("domains", "complexities") else raw), f"environment {var}"
        else:
            continue
        _assign(gen, key, value, f"{source}={raw if cli is None else _show(cli)}")
    if args.seed is not None:
        gen.seed = args.seed
    try:
        apply_openai_env(gen.openai, "generation.openai", args.overrides, env)
    except ConfigError as e:
        raise GenerationError(str(e)) from None
    if args.split is not None:  # assigned through the schema, whose checks (split_rows' keys) name the option
        _assign(gen, "splits", parse_splits(args.split), f"--split={args.split}")
    elif gen.splits:
        check_splits(gen.splits)
    if args.instance_splits is not None:
        gen.instance_splits = args.instance_splits
    check_instance_splits(gen.splits, gen.instance_splits)
    if gen.instance_splits and args.method != "rule":
        raise GenerationError(f"generation.instance_splits: only the rule method makes them, not {args.method}")
    if gen.split_rows:
        check_split_rows(args, gen, env)


def check_split_rows(args: argparse.Namespace, gen: GenerationConfig, env: dict[str, str] | os._Environ[str]) -> None:
    """`generation.split_rows` sets every split's row count (the config checked that it names the splits): nothing
    else may set a count."""
    key = "generation.split_rows"
    if args.method != "rule":
        raise GenerationError(f"{key}: only the rule method fills splits to a row count, not {args.method}")
    if args.n is not None or env.get("N_SAMPLES", "").strip():
        given = f"--n {args.n}" if args.n is not None else f"environment N_SAMPLES={env['N_SAMPLES'].strip()}"
        raise GenerationError(f"{given} and {key} both say how many rows to make: drop one")


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _assign(section: Any, key: str, value: Any, source: str) -> None:
    try:
        setattr(section, key, value)
    except ValidationError as e:
        problems = "; ".join(err["msg"] for err in e.errors())
        raise GenerationError(f"{source}: {problems}") from None


def output_paths(out: Path, splits: dict[str, float]) -> dict[str | None, Path]:
    if not splits:
        return {None: out}
    return {name: out.with_name(f"{out.stem}.{name}{out.suffix}") for name in splits}


async def run(args: argparse.Namespace, cfg: Config) -> int:
    from serve_apps.tool_pool import LocalToolPool
    from tasks.admission import admit
    from tasks.inventory import load_inventory

    out = Path(args.out)
    generate = get_generator(args.method)  # fails early (exit 2) when the method cannot be imported
    tools = cfg.tools.offline()
    try:
        pool = await LocalToolPool.create(tools)
    except Exception as e:  # an external server that cannot start: say which, no traceback
        raise GenerationError(f"cannot start the tool pool: {type(e).__name__}: {e}") from None
    try:
        servers = sorted(pool.hosts)
        for option, names in (("--domains/DOMAINS", cfg.generation.domains), ("--servers", args.servers or [])):
            unknown = sorted(set(names) - set(servers))
            if unknown:
                raise GenerationError(f"{option}: no server {', '.join(unknown)}; servers: {', '.join(servers)}")
        inventory = await load_inventory(tools)
        with _progress(f"{args.method}: generating") as progress:
            opts = GenerateOptions.from_config(
                cfg,
                input_path=Path(args.in_path) if args.in_path else None,
                servers=tuple(args.servers or ()),
                progress=progress,
            )
            rows = await generate(cfg, opts, pool)
        with _status(f"admitting {len(rows)} rows (schema, tools, params, offline replay, near-duplicates)"):
            admission = await admit(rows, pool, inventory, cfg.generation.near_duplicate_threshold)
    finally:
        await pool.close()

    print(f"{args.method}: {admission.summary()}")
    for r in admission.rejected[:MAX_REJECTIONS_SHOWN]:
        print(f"  rejected {r.task_id}: {r.reason}" + (f" ({r.detail})" if r.detail else ""))
    if len(admission.rejected) > MAX_REJECTIONS_SHOWN:
        print(f"  ... and {len(admission.rejected) - MAX_REJECTIONS_SHOWN} more rejections")
    if not admission.kept:
        print("nothing was admitted: no file written")
        return 1

    splits = cfg.generation.splits
    groups: dict[str | None, list[dict[str, Any]]]
    groups = assign_rows(admission.kept, splits, cfg.generation.seed) if splits else {None: admission.kept}
    for split, path in output_paths(out, splits).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_rows(groups[split], path)
        templates = {(r.get("extra_info") or {}).get("template") for r in groups[split]} - {None}
        what = f" ({counted(len(templates), 'template')})" if templates else ""
        print(f"wrote {counted(len(groups[split]), 'row')}{what} to {path}" + (f"  [{split}]" if split else ""))
    return 0


class _progress:
    """A rich progress bar on stderr, fed by the generator's progress(done, total) callback."""

    def __init__(self, label: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self.task = self.bar.add_task(label, total=None)

    def __enter__(self) -> Callable[[int, int], None]:
        if self.bar.console.is_terminal:  # a bar in a log file or a pipe is noise
            self.bar.start()
        return lambda done, total: self.bar.update(self.task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


def _status(message: str) -> Any:
    from rich.console import Console

    console = Console(stderr=True)
    return console.status(message) if console.is_terminal else contextlib.nullcontext()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cfg = setup(args)
    try:
        out = storage.node_path(args.out, "--out")
    except storage.StorageError as e:
        usage_error(str(e))
    args.out = str(out)  # a relative --out in a submitted job: under ~/mcprl, not its deleted working directory
    if out.suffix.lower() not in FORMATS:
        usage_error(f"--out {out}: unknown file type {out.suffix or '(none)'!r}; use one of {', '.join(FORMATS)}")
    if args.method == "dependent" and not args.in_path:
        usage_error("--method dependent needs --in FILE (conversations, .jsonl or .json)")
    if args.in_path and not Path(args.in_path).is_file():
        usage_error(f"--in {args.in_path}: no such file")
    try:
        resolve(args, cfg, os.environ)
        code = asyncio.run(run(args, cfg))
    except (GenerationError, GeneratorUnavailable, TaskFileError) as e:
        usage_error(str(e))
    sys.exit(code)


if __name__ == "__main__":
    main()
