"""What `python -m jobs.generate_tasks` resolved for a generator (CLI > environment > config).

Every generator has one signature, `async def generate(cfg, opts, pool) -> list[dict]`: `cfg` is the
whole config (the OpenAI settings stay in `cfg.generation.openai`), `opts` these resolved knobs, and
`pool` the in-process tool pool (`serve_apps.tool_pool.LocalToolPool`, offline backends).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from configs.schema import Complexity, Config


class GenerationError(ValueError):
    """Bad input to a generator (no template fits the options, a malformed input file, ...).

    The job prints its message and exits with code 2, without a traceback.
    """


@dataclass(frozen=True)
class GenerateOptions:
    """Resolved generation knobs; a generator reads these, never the CLI or the environment."""

    n: int = 50  # candidate rows to produce (admission may keep fewer)
    seed: int = 0  # same seed, same rows
    domains: tuple[str, ...] = ()  # servers to draw tools from; () = all
    complexities: tuple[Complexity, ...] = ("simple", "medium", "hard")
    max_tools: int = 4  # most distinct tools in one task
    max_turns: int = 8  # turn budget written into each task; a task needing more calls is not made
    input_path: Path | None = None  # `dependent`: the conversations file (JSON or JSONL)
    servers: tuple[str, ...] = ()  # `mcp`: the servers to explore; () = all in the pool
    splits: dict[str, float] = field(default_factory=dict)  # e.g. {train: 0.8, test: 0.2}; {} = no split
    # Splits of held-out instances (tickers, phrasings) of the train split's templates, e.g. ("validation",);
    # the other splits are by whole template (see splits.py). Only the rule generator makes them.
    instance_splits: tuple[str, ...] = ()
    split_rows: dict[str, int] = field(default_factory=dict)  # rows per split, in place of n by the fractions
    extra: dict[str, object] = field(default_factory=dict)  # method-specific extras, free-form
    # Called as progress(done, total) while generating; the job draws its progress bar from it.
    progress: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)

    def report(self, done: int, total: int) -> None:
        """Tell the caller how far along we are (no-op without a progress callback)."""
        if self.progress is not None:
            self.progress(done, total)

    @classmethod
    def from_config(cls, cfg: Config, **overrides: object) -> GenerateOptions:
        """Defaults from `cfg.generation`; `overrides` (already-resolved CLI/env values) win."""
        g = cfg.generation
        base: dict[str, object] = {
            "n": sum(g.split_rows.values()) if g.split_rows else g.n_samples,
            "seed": g.seed,
            "domains": tuple(g.domains),
            "complexities": tuple(g.complexities),
            "max_tools": g.max_tools,
            "max_turns": g.max_turns,
            "splits": dict(g.splits),
            "instance_splits": tuple(g.instance_splits),
            "split_rows": dict(g.split_rows),
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)  # type: ignore[arg-type]
