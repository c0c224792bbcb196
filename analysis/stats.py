"""The statistics of the run comparison (analysis/compare.py): intervals, Welch's t-test, Holm's
adjustment, the difference seeds could detect, a bootstrap of medians, O1-Pruner's AES.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics

import mpmath


def aes(L, A, L_b, A_b, alpha: float = 1.0, beta: float = 3.0, gamma: float = 5.0) -> float:
    """O1-Pruner's accuracy-efficiency score of length L and accuracy A against a baseline's."""
    if L_b <= 0 or A_b <= 0:
        return math.nan
    dA = (A - A_b) / A_b
    return alpha * (L_b - L) / L_b + (beta if dA >= 0 else gamma) * dA


def bootstrap(values: list[float], stat=statistics.median) -> tuple[float, float]:
    """95 % percentile bootstrap interval of `stat`, linear between neighbours (inf stays inf):
    every resample of ≤ 6 values, else 20,000 with a fixed seed."""
    draws = itertools.product(values, repeat=len(values))
    if len(values) > 6:
        rng = random.Random(0)
        draws = (rng.choices(values, k=len(values)) for _ in range(20_000))
    stats = sorted(map(stat, draws))  # (values may be pairs: `paired_ratio`)
    if any(map(math.isnan, stats)):  # a resample without a defined value: no interval either
        return math.nan, math.nan
    bounds = []
    for q in (0.025, 0.975):
        i, f = divmod(q * (len(stats) - 1), 1)
        a, b = stats[int(i)], stats[min(int(i) + 1, len(stats) - 1)]
        bounds.append(a if f == 0 or a == b else a + f * (b - a))
    return bounds[0], bounds[1]


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom (regularized incomplete beta)."""
    p = 0.5 * float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))
    return p if t >= 0 else 1 - p


def t_quantile(p: float, df: float) -> float:
    """The p-quantile (p ≥ 0.5) of Student's t, by bisection."""
    lo, hi = 0.0, 1e3
    for _ in range(100):
        mid = (lo + hi) / 2
        if t_sf(mid, df) < 1 - p:
            hi = mid
        else:
            lo = mid
    return hi


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def mean_known(xs: list) -> float:
    """The mean of the values a run recorded (NaN when none did)."""
    known = [x for x in xs if x is not None]
    if not known:
        return math.nan
    return mean(known)


def mean_interval(xs: list[float]) -> tuple[float, float]:
    """95 % Student-t interval of the mean."""
    if len(xs) < 2:
        return math.nan, math.nan
    half = t_quantile(0.975, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5
    return mean(xs) - half, mean(xs) + half


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """Standard error of mean(a) − mean(b) and its Welch–Satterthwaite degrees of freedom."""
    if len(a) < 2 or len(b) < 2:
        return math.nan, math.nan
    va = statistics.variance(a) / len(a)
    vb = statistics.variance(b) / len(b)
    if va + vb == 0:
        return 0.0, math.nan
    return math.sqrt(va + vb), (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of Welch's t-test that the means of `a` and `b` differ."""
    se, df = welch(a, b)
    if not se > 0:  # NaN: too few values; 0: no spread
        return math.nan if math.isnan(se) else float(mean(a) == mean(b))
    return 2 * t_sf(abs(mean(a) - mean(b)) / se, df)


def detectable(a: list[float], b: list[float], alpha: float = 0.05) -> float:
    """The smallest difference of means Welch's two-sided test at level `alpha` finds with 80 %
    power: (t_{1−α/2,ν} + t_{0.8,ν}) · SE, Welch's SE and ν (t quantiles: a few seeds estimate the
    SDs). At α = 0.05 / m, the level Holm's first step over m tests asks."""
    se, df = welch(a, b)
    if not se > 0:
        return math.nan
    return (t_quantile(1 - alpha / 2, df) + t_quantile(0.8, df)) * se


def ratio_of_medians(pairs: list[tuple[float, float]]) -> float:
    """median(a) / median(b) over pairs (a, b) of values ≥ 0, inf where never reached: inf when
    median(a) is (or both are); NaN (no ratio is defined, never a misleading 0) when only
    median(b) is. median(b) = 0 (the baseline there from its start): inf when median(a) > 0, NaN
    when it is 0 too."""
    a = statistics.median([p[0] for p in pairs])
    b = statistics.median([p[1] for p in pairs])
    if math.isinf(a):
        return math.inf
    if math.isinf(b):
        return math.nan
    if b == 0:
        return math.inf if a > 0 else math.nan
    return a / b


def paired_ratio(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
    """`ratio_of_medians` of the pairs (an arm's and the baseline's value of one seed) and its 95 %
    paired bootstrap interval: the seeds are resampled, each with both of its values."""
    if not pairs:
        return math.nan, math.nan, math.nan
    return ratio_of_medians(pairs), *bootstrap(pairs, ratio_of_medians)


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment (NaN: no test, not counted in m): with p_(1) ≤ … ≤ p_(m),
    adjusted p_(i) = max over j ≤ i of min(1, (m − j + 1) p_(j))."""
    order = sorted((i for i, p in enumerate(ps) if not math.isnan(p)), key=lambda i: ps[i])
    adjusted = [math.nan] * len(ps)
    running = 0.0
    for j, i in enumerate(order):  # j = rank − 1, so m − j is (m − rank + 1)
        running = max(running, min(1.0, (len(order) - j) * ps[i]))
        adjusted[i] = running
    return adjusted
