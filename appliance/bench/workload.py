"""Workloads: random prompts (token ids), Poisson arrivals, Zipf adapter popularity. Pure Python + numpy-free."""

from __future__ import annotations

import bisect
import random
from itertools import accumulate


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of exactly `length` token ids: equal lengths, so baselines need no padding."""
    rng = random.Random(seed)
    lo = min(10, vocab - 1)  # keep clear of the usual special ids at the bottom of the vocabulary
    return [[rng.randrange(lo, vocab) for _ in range(length)] for _ in range(n)]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets in seconds of `n` requests at `rate` per second (exponential gaps), first at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def zipf_choices(n: int, num_items: int, s: float, seed: int) -> list[int]:
    """`n` draws from {0..num_items-1} with P(k) ∝ 1/(k+1)^s (item 0 the most popular)."""
    rng = random.Random(seed)
    cdf = list(accumulate(1.0 / (k + 1) ** s for k in range(num_items)))
    return [min(bisect.bisect_left(cdf, rng.random() * cdf[-1]), num_items - 1) for _ in range(n)]


def percentile(xs: list[float], p: float) -> float:
    """Nearest-rank percentile; NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(-(-p / 100 * len(s) // 1)) - 1))
    return s[k]
