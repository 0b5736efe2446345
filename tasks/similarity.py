"""Near-duplicate prompts, without dependencies.

The measure: the Jaccard similarity of two texts' sets of word bigrams, after normalisation.
Normalising lowercases the text, keeps only runs of letters and digits as words (punctuation and
spacing do not count), and turns every run of digits into `0`, so prompts that differ only in a
number, a date or a quantity are identical (similarity 1.0). A text of a single word is its word;
a text without words is one shared empty token. Two prompts differing in one word of a twenty-word
sentence score about 0.8; in one word of five, about 0.3.

Pairs are found exactly, in the style of prefix filtering for set-similarity joins: with bigrams
ordered rarest first, two sets whose Jaccard similarity reaches t must share one of the first
|S| - ceil(t·|S|) + 1 bigrams of each set, so only pairs sharing such a rare bigram are compared.
Template-heavy datasets degrade towards the plain O(n²) comparison, which is fine for thousands.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter, defaultdict
from collections.abc import Sequence

_WORD = re.compile(r"[^\W_]+")  # letters and digits, any script
_DIGITS = re.compile(r"\d+")
_EPS = 1e-9  # float slack: 0.7 * 10 is 7.000000000000001


def words(text: str) -> list[str]:
    """The normalised words of a text: lowercased, digit runs replaced by `0`."""
    return [_DIGITS.sub("0", w) for w in _WORD.findall(text.lower())]


def shingles(text: str) -> frozenset[str]:
    """The set a text is compared by: its word bigrams (its word, or an empty token, when shorter)."""
    ws = words(text)
    if len(ws) < 2:
        return frozenset(ws or [""])
    return frozenset(f"{a} {b}" for a, b in itertools.pairwise(ws))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    if not a and not b:
        return 1.0
    inter = len(a & b)
    return inter / (len(a) + len(b) - inter)


def similarity(a: str, b: str) -> float:
    """How alike two texts are, 0..1 (see the module docstring)."""
    return jaccard(shingles(a), shingles(b))


def near_duplicates(texts: Sequence[str], threshold: float) -> list[tuple[int, int, float]]:
    """Every pair (i, j, similarity) with i < j and similarity >= threshold, sorted by (i, j).

    `threshold` is in (0, 1]; indices are positions in `texts`.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    sets = [shingles(t) for t in texts]
    frequency = Counter(s for shingle_set in sets for s in shingle_set)
    index: dict[str, list[int]] = defaultdict(list)  # bigram -> texts whose prefix holds it
    pairs = []
    for j, current in enumerate(sets):
        ordered = sorted(current, key=lambda s: (frequency[s], s))
        prefix = ordered[: len(ordered) - math.ceil(threshold * len(ordered) - _EPS) + 1]
        candidates = {i for s in prefix for i in index[s]}
        for i in sorted(candidates):
            score = jaccard(sets[i], current)
            if score >= threshold - _EPS:
                pairs.append((i, j, score))
        for s in prefix:
            index[s].append(j)
    return sorted(pairs)
