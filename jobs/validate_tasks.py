"""Validate a task file: schema, tool inventory, params, duplicates, live writes, prompt lengths; print stats.

python -m jobs.validate_tasks --in FILE [--model NAME] [--max-tokens N] [--strict] [--config ...] [--set ...]

FILE is .json (a list), .jsonl or .parquet. The inventory comes from the configured servers, built
in this process (no Ray). Prompt tokens are counted with the model's chat template and the tools of
the servers each task uses (`envs/prompting.py`). A task whose plan calls a writing tool (one not
annotated `readOnlyHint`) of a server configured with `backend: live` gets a warning.
Exit status: 0 "Validation passed"; 1 the rows have errors (or the file cannot be parsed);
2 a usage error (no such file, unknown file type, bad config, unknown model, servers that cannot start).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from jobs.cli import base_parser, counted, setup, usage_error
from tasks.io import FORMATS, TaskFileError, read_rows
from tasks.validate import Stats, ValidationReport, validate_rows

MAX_LISTED = 200  # issues printed of each kind; the counts are always complete


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--in", dest="in_path", required=True, metavar="FILE", help=f"task file ({', '.join(FORMATS)})")
    parser.add_argument("--model", help="tokenizer for prompt lengths (default: the config's model.name)")
    parser.add_argument(
        "--max-tokens", type=int, help="longest allowed prompt in tokens (default: the model's context length)"
    )
    parser.add_argument("--strict", action="store_true", help="warnings (long prompts, near-duplicates) are errors")
    args = parser.parse_args(argv)
    cfg = setup(args)

    path = Path(args.in_path)
    if path.suffix.lower() not in FORMATS:
        usage_error(f"{path}: unknown task file type {path.suffix or '(none)'!r}; use one of {', '.join(FORMATS)}")
    if not path.is_file():
        usage_error(f"{path}: no such file")
    try:
        rows = read_rows(path)
    except TaskFileError as e:  # the file exists but its content is bad: the data fails
        print(f"error: {e}")
        print("Validation failed: the file cannot be read")
        sys.exit(1)

    from actors.models import ModelNotFoundError, load_tokenizer
    from configs.schema import ModelConfig
    from envs.prompting import count_prompt_tokens
    from tasks.inventory import inventory_from_listing, live_writing_tools, load_tool_listing

    model = args.model or cfg.model.name
    try:
        tokenizer = load_tokenizer(ModelConfig(name=model, cache_dir=cfg.model.cache_dir))
    except ModelNotFoundError as e:
        usage_error(str(e))
    if not tokenizer.chat_template:
        usage_error(f"model {model!r} has no chat template: prompts cannot be rendered (choose --model)")
    try:
        listing = asyncio.run(load_tool_listing(cfg.tools))
    except Exception as e:  # a server that cannot start (e.g. an external command): say so, no traceback
        usage_error(f"cannot list the tools of the configured servers: {type(e).__name__}: {e}")
    max_tokens = args.max_tokens
    if max_tokens is None and 0 < (tokenizer.model_max_length or 0) < 10**7:  # unset lengths are huge sentinels
        max_tokens = int(tokenizer.model_max_length)

    report = validate_rows(
        rows,
        inventory_from_listing(listing),
        count_tokens=lambda task: count_prompt_tokens(
            tokenizer, task, listing, cfg.env.final_answer, cfg.env.tool_format
        ),
        max_tokens=max_tokens,
        strict=args.strict,
        near_duplicate_threshold=cfg.generation.near_duplicate_threshold,
        live_writes=live_writing_tools(listing, cfg.tools),
    )
    print_report(report, path, model, max_tokens)
    sys.exit(0 if report.ok else 1)


def print_report(report: ValidationReport, path: Path, model: str, max_tokens: int | None) -> None:
    print(f"{path}: {counted(report.rows, 'row')}")
    for title, issues in (("error", report.errors), ("warning", report.warnings)):
        if not issues:
            continue
        print(f"\n{counted(len(issues), title)}:")
        for issue in issues[:MAX_LISTED]:
            print(f"  {issue}")
        if len(issues) > MAX_LISTED:
            print(f"  ... and {len(issues) - MAX_LISTED} more")
    print()
    print_stats(report.stats, model, max_tokens)
    print()
    if report.ok:
        print("Validation passed" + (f" with {counted(len(report.warnings), 'warning')}" if report.warnings else ""))
    else:
        print(
            f"Validation failed: {counted(len(report.errors), 'error')} in {len(report.error_rows)} of "
            f"{counted(report.rows, 'row')}"
        )


def print_stats(s: Stats, model: str, max_tokens: int | None) -> None:
    print(f"valid rows: {s.valid_rows} of {s.rows} (stats below are over these)")
    if not s.valid_rows:
        return
    print("complexity: " + ", ".join(f"{k} {v}" for k, v in s.by_complexity.items()))
    print("reward method: " + ", ".join(f"{k} {v}" for k, v in s.by_method.items()))
    print(f"prompt chars: mean {s.prompt_chars_mean:.0f}, max {s.prompt_chars_max}")
    if s.prompt_tokens_mean is not None:
        limit = f" (limit {max_tokens})" if max_tokens else ""
        print(f"prompt tokens ({model}, with tools): mean {s.prompt_tokens_mean:.0f}, max {s.prompt_tokens_max}{limit}")
    print(f"max_turns: mean {s.max_turns_mean:.1f}, max {s.max_turns_max}")
    print(f"tool calls per task: mean {s.tool_calls_mean:.2f}")
    print("tool calls: " + ", ".join(f"{k} {v}" for k, v in s.tool_calls.items()))
    print("tools no task uses: " + (", ".join(s.unused_tools) or "none"))


if __name__ == "__main__":
    main()
