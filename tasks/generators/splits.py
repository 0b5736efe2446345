"""Train/validation/test splits, of two kinds: by template and by instance.

A split by template (the default) holds whole templates that no other split has: it measures
transfer to a tool pattern and wording never trained on. A split by instance (`instance_splits`,
e.g. [validation]; only the rule generator makes them) holds new draws of the *training* split's
templates from choices training never shows: held-out tickers (hence companies) and a held-out
phrasing of each prompt (rule.py's `HELD_OUT_TICKERS`, `Ctx.say`). It measures the skill trained on.

Tasks made from one template share their wording and their tool pattern, so a by-template split that
shared templates would test memory of the template, not skill. So whole templates go to the
by-template splits (their fractions renormalized to sum to 1 when there are instance splits):

1. Each split's number of templates is its fraction of all templates (largest remainder), at least
   one each; the largest split takes what is left.
2. Templates are shuffled within each complexity with `Random(f"splits|{seed}")`, so the assignment
   is deterministic for a seed and changes with it.
3. The smaller splits pick first, one template at a time, cycling through the complexities
   (simple, medium, hard, simple, ...), so the evaluation splits see different complexities even
   when they hold only a few templates; the largest split (train) gets every template left.

Rows are then allotted to each split, of either kind, by its fraction of all rows (`row_quotas`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tasks.generators.options import GenerationError

SPLIT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
COMPLEXITY_ORDER = ("simple", "medium", "hard")


def parse_splits(text: str) -> dict[str, float]:
    """`train=0.8,validation=0.1,test=0.1` → {"train": 0.8, ...}; fractions must be > 0 and sum to 1."""
    splits: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or not SPLIT_NAME.match(name):
            raise GenerationError(f"bad split {part!r}: expected NAME=FRACTION, e.g. train=0.8,test=0.2")
        try:
            splits[name] = float(value)
        except ValueError:
            raise GenerationError(f"bad split {part!r}: {value.strip()!r} is not a number") from None
    return check_splits(splits)


def check_splits(splits: Mapping[str, float]) -> dict[str, float]:
    """The splits, validated: at least two, names usable in file names, fractions in (0, 1] summing to 1."""
    if len(splits) < 2:
        raise GenerationError(f"a split needs at least two parts, e.g. train=0.9,test=0.1; got {dict(splits)}")
    for name, frac in splits.items():
        if not SPLIT_NAME.match(name):
            raise GenerationError(f"split name {name!r} must be letters, digits, _ or - (it becomes a file name)")
        if not 0 < frac <= 1:
            raise GenerationError(f"split {name}={frac}: a fraction must be in (0, 1]")
    total = sum(splits.values())
    if abs(total - 1) > 1e-6:
        raise GenerationError(f"split fractions must sum to 1; {dict(splits)} sums to {total:g}")
    return dict(splits)


def check_instance_splits(splits: Mapping[str, float], instance_splits: Sequence[str]) -> list[str]:
    """The instance splits, validated against `splits` (already checked): each is a split, `train` is one
    of the splits and not an instance split (its templates are what the instance splits redraw)."""
    names = list(dict.fromkeys(instance_splits))
    if not names:
        return []
    key = "generation.instance_splits"
    unknown = [n for n in names if n not in splits]
    if unknown:
        raise GenerationError(
            f"{key}: {', '.join(unknown)} not among the splits ({', '.join(splits) or 'none'}); "
            "an instance split must also be in generation.splits"
        )
    if "train" not in splits:
        raise GenerationError(
            f"{key}: needs a split named train (its templates are redrawn), splits: {', '.join(splits)}"
        )
    if "train" in names:
        raise GenerationError(f"{key}: train cannot be an instance split: the instance splits hold out from it")
    return names


def template_splits(splits: Mapping[str, float], instance_splits: Sequence[str]) -> dict[str, float]:
    """The by-template splits, their fractions renormalized to sum to 1 (template assignment shares them)."""
    kept = {n: f for n, f in splits.items() if n not in instance_splits}
    total = sum(kept.values())
    return {n: f / total for n, f in kept.items()}


def _largest_remainder(total: int, splits: Mapping[str, float]) -> dict[str, int]:
    exact = {name: total * frac for name, frac in splits.items()}
    counts = {name: int(x) for name, x in exact.items()}
    by_remainder = sorted(splits, key=lambda n: (-(exact[n] - counts[n]), list(splits).index(n)))
    for name in by_remainder[: total - sum(counts.values())]:
        counts[name] += 1
    return counts


def row_quotas(n: int, splits: Mapping[str, float]) -> dict[str, int]:
    """How many of `n` rows each split gets (largest remainder: they sum to n)."""
    return _largest_remainder(n, splits)


def assign_templates(
    templates: Sequence[str], splits: Mapping[str, float], seed: int, complexity: Mapping[str, str] | None = None
) -> dict[str, str]:
    """template id → split name, no template in two splits (see the module docstring for how)."""
    splits = check_splits(splits)
    ids = sorted(set(templates))
    if len(ids) < len(splits):
        raise GenerationError(
            f"{len(ids)} template(s) cannot fill {len(splits)} splits without sharing one; "
            "use fewer splits or widen --domains/--complexities"
        )
    counts = _largest_remainder(len(ids), splits)
    largest = max(splits, key=lambda n: (splits[n], -list(splits).index(n)))
    for name in splits:  # every split gets a template; the largest gives them up
        if counts[name] == 0:
            counts[name], counts[largest] = 1, counts[largest] - 1

    rng = random.Random(f"splits|{seed}")
    kinds = {t: (complexity or {}).get(t, "") for t in ids}
    order = sorted(set(kinds.values()), key=lambda k: (COMPLEXITY_ORDER.index(k) if k in COMPLEXITY_ORDER else 9, k))
    strata = {k: [t for t in ids if kinds[t] == k] for k in order}
    for members in strata.values():
        rng.shuffle(members)

    out: dict[str, str] = {}
    turn = 0
    small = sorted((n for n in splits if n != largest), key=lambda n: (counts[n], list(splits).index(n)))
    for name in small:
        for _ in range(counts[name]):
            for _ in range(len(order)):  # the next complexity in the cycle that still has templates
                kind = order[turn % len(order)]
                turn += 1
                if strata[kind]:
                    out[strata[kind].pop()] = name
                    break
    for members in strata.values():
        for t in members:
            out[t] = largest
    return out


def assign_rows(rows: list[dict[str, Any]], splits: Mapping[str, float], seed: int) -> dict[str, list[dict[str, Any]]]:
    """Group rows into splits; a row's `extra_info.split` is kept, the others go by their template.

    Rows without a template (e.g. converted conversations) count as a template of their own each.
    """
    splits = check_splits(splits)
    unset = [r for r in rows if (r.get("extra_info") or {}).get("split") not in splits]
    key = {id(r): _template_of(r) for r in unset}
    complexity = {key[id(r)]: r["reward_spec"]["ground_truth"]["complexity"] for r in unset}
    assigned = assign_templates(list(complexity), splits, seed, complexity) if unset else {}
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in splits}
    for r in rows:
        split = (r.get("extra_info") or {}).get("split")
        if split not in splits:
            split = assigned[key[id(r)]]
            r.setdefault("extra_info", {})["split"] = split
        out[split].append(r)
    return out


def _template_of(row: dict[str, Any]) -> str:
    extra = row.get("extra_info") or {}
    template = extra.get("template")
    return f"template:{template}" if template else f"task:{row['reward_spec']['ground_truth']['task_id']}"
