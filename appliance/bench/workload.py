"""Workloads: random prompts (token ids), length distributions, Poisson arrivals, uniform and Zipf popularity.
Pure Python, numpy-free."""

from __future__ import annotations

import bisect
import math
import random
from itertools import accumulate
from typing import Optional

# Lognormal lengths give a long right tail like ShareGPT's conversations; sigma 0.8: p99 ~6x the median.
LOGNORMAL_SIGMA = 0.8


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of exactly `length` token ids: equal lengths, so baselines need no padding."""
    return prompts_of_lengths([length] * n, vocab, seed)


def prompts_of_lengths(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    """One prompt of random token ids per entry of `lengths`."""
    rng = random.Random(seed)
    lo = min(10, vocab - 1)  # keep clear of the usual special ids at the bottom of the vocabulary
    return [[rng.randrange(lo, vocab) for _ in range(n)] for n in lengths]


def even_arrivals(n: int, rate: float) -> list[float]:
    """`n` sends evenly spaced at `rate` per second, the first at 0."""
    return [i / rate for i in range(n)]


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


def sample_lengths(n: int, mean: int, dist: str, seed: int, range_ratio: float = 0.5,
                   cap: Optional[int] = None) -> list[int]:
    """`n` lengths around `mean`: fixed (all equal), uniform in [mean·(1-r), mean·(1+r)], or lognormal
    with that mean and sigma LOGNORMAL_SIGMA (the long right tail of ShareGPT's prompt and reply lengths).
    Each is at least 1 and at most `cap` (default 8·mean)."""
    rng = random.Random(seed)
    hi = cap if cap is not None else 8 * mean
    if dist == "fixed":
        xs = [mean] * n
    elif dist == "uniform":
        lo, up = round(mean * (1 - range_ratio)), round(mean * (1 + range_ratio))
        xs = [rng.randint(lo, up) for _ in range(n)]
    elif dist == "lognormal":
        mu = math.log(mean) - LOGNORMAL_SIGMA ** 2 / 2  # E[X] = exp(mu + sigma²/2) = mean
        xs = [round(rng.lognormvariate(mu, LOGNORMAL_SIGMA)) for _ in range(n)]
    else:
        raise ValueError(f"unknown length distribution {dist!r}")
    return [max(1, min(hi, x)) for x in xs]


def uniform_choices(n: int, num_items: int, seed: int) -> list[int]:
    """`n` draws from {0..num_items-1}, each equally likely."""
    rng = random.Random(seed)
    return [rng.randrange(num_items) for _ in range(n)]


def percentile(xs: list[float], p: float) -> float:
    """Nearest-rank percentile; NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(-(-p / 100 * len(s) // 1)) - 1))
    return s[k]
